"""Overlapped MTP steps (hyla.engine.spec.mtp.overlap), on the CPU: the next fused step launched
before the current one's readback is read, its inputs derived from the current step's outputs
(DerivedExtension). A CUDAGraphRunner with capture off runs the same functions eagerly on the
same buffers. Output equals plain greedy token for token with steps launched in flight
(counted), k = 1..3, both rollbacks, prefix cache on (second passes hit states filed while a step was in
flight); requests that stop on a token mid-chain (a padding row of the step in flight: their
filed state stays exact); aborts and new requests while a step is in flight; requests the
device stop check cannot take (stop strings) never chain; the derivation reads nothing on the
host."""

import pytest

from hyla import SamplingParams
from hyla.engine.spec.mtp.fused import DerivedExtension
from tests.engine.test_mtp_fused import _engine, _generate
from tests.engine.test_mtp_graph import _guarded

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def bundled():
    """The bundled qwen3.5-mtp (its head drafts well: long chains), fp64, the bench's prompts
    and their plain greedy outputs."""
    from hyla import LLM
    from hyla.bench.spec import FREE, REPETITIVE
    from hyla.models.hub import resolve_model

    path = resolve_model("qwen3.5-mtp")
    prompts = REPETITIVE + FREE
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return path, prompts, params, _generate(LLM(str(path), dtype="float64", device="cpu"), prompts, params)


def _finishes_in_flight(llm, monkeypatch) -> list[bool]:
    """Record, for every finished request, whether a step was in flight when it finished."""
    engine, seen = llm.engine, []
    on_finish = engine.on_finish

    def record(seq):
        seen.append(engine.chain.flight is not None)
        return on_finish(seq)
    monkeypatch.setattr(engine, "on_finish", record)
    return seen


# the two tests below share the (k, rollback) cells between them: each cell runs in one of them
@pytest.mark.parametrize("k,rollback", [(1, "slots"), (2, "replay"), (3, "slots")])
def test_overlapped_steps_equal_plain_greedy(bundled, k, rollback, monkeypatch):
    """("replay": the current step's commit runs on the device, from its kept counts, before the
    next step's verify; the host does not commit it again.)"""
    path, prompts, params, want = bundled
    llm = _engine(path, k, rollback, monkeypatch, enable_prefix_caching=True)
    for _ in range(2):  # the second pass hits the prefix cache
        assert _generate(llm, prompts, params) == want
        assert _generate(llm, prompts[:1], params) == want[:1]  # alone: batch 1
    chain, m = llm.engine.chain, llm.get_metrics()
    assert chain.launched > 0 and chain.flight is None
    assert m["prefix_cache_hit_tokens"] > 0 and m["spec_mean_accepted_length"] > 1.5, m
    assert not llm.engine.spec.drafter.views and not llm.engine.spec.drafter._fused


@pytest.mark.parametrize("k,rollback", [(2, "slots"), (3, "replay")])
def test_stop_tokens_while_a_step_is_in_flight(bundled, k, rollback, monkeypatch):
    """Each request stops on its j-th plain output token (stop_token_ids; EOS is token 0 and
    ignore_eos is off too) while the next step is in flight: that step holds it as a padding
    row, so the state filed in the prefix cache at its finish is exact: a follow-up request
    whose prompt is prompt + output (a next turn) restores that state and continues exactly as
    plain greedy does from scratch. ("replay": the device commits a stopped request's tokens up
    to its stop token, as the host keeps them.)"""
    from hyla import LLM

    path, prompts, base, plain = bundled
    llm = _engine(path, k, rollback, monkeypatch, enable_prefix_caching=True)
    ref = LLM(str(path), dtype="float64", device="cpu")
    in_flight = _finishes_in_flight(llm, monkeypatch)
    more = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for j in (3, 11, 19):
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[t[j]]) for t in plain]
        want = [t[:min(t.index(x) for x in (t[j], 0) if x in t) + 1] for t in plain]  # 0: EOS
        got = _generate(llm, prompts, params)
        assert got == want
        turns = [llm.engine.encode(p)[1] + out for p, out in zip(prompts, got)]
        hits = llm.get_metrics()["prefix_cache_hit_tokens"]
        assert _generate(llm, turns, more) == _generate(ref, turns, more)
        assert llm.get_metrics()["prefix_cache_hit_tokens"] - hits > sum(len(t) for t in turns) // 2
    assert llm.engine.chain.launched > 0 and any(in_flight)
    assert not llm.engine.spec.drafter.views and not llm.engine.spec.drafter._fused


def test_abort_and_admission_while_a_step_is_in_flight(bundled, monkeypatch):
    """An abort collects the step in flight first (its outputs come with the next step); a
    request added while a step is in flight starts after it. The others give plain greedy."""
    path, prompts, params, want = bundled
    llm = _engine(path, 2, "slots", monkeypatch)
    engine = llm.engine
    for i in range(3):
        engine.add_request(str(i), prompts[i], params)
    done: dict[str, list[int]] = {}
    aborted = added = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if engine.chain.flight is not None and not aborted:
            assert engine.abort_request("1") and engine.chain.flight is None
            aborted = True
        elif engine.chain.flight is not None and aborted and not added:
            engine.add_request("3", prompts[3], params)
            added = True
    assert aborted and added and engine.chain.launched > 0
    assert done == {"0": want[0], "2": want[2], "3": want[3]}
    assert engine.get_metrics()["num_requests_aborted"] == 1 and not engine.spec.drafter.views


def test_a_request_finishing_in_a_drained_step_is_still_handed_out(bundled, monkeypatch):
    """An abort drains the step in flight; a request that finishes in that step has its final
    output handed out by the next `step` even when nothing else is left to run."""
    path, prompts, params, want = bundled
    stop = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[want[0][20]])

    def run(abort_at: int | None) -> tuple[int | None, dict]:
        engine = _engine(path, 2, "slots", monkeypatch).engine
        engine.add_request("a", prompts[0], stop)
        engine.add_request("b", prompts[1], params)
        finished, steps, done_at = {}, 0, None
        while engine.has_unfinished_requests():
            if steps == abort_at:
                assert engine.chain.flight is not None and engine.abort_request("b")
                assert engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
                    done_at = steps if out.request_id == "a" else done_at
            steps += 1
        return done_at, finished

    done_at, finished = run(None)
    a = want[0][:want[0].index(want[0][20]) + 1]
    assert finished["a"] == a
    _, again = run(done_at)  # abort b just before the step that finishes a is collected
    assert again == {"a": a}


def test_requests_the_device_check_cannot_take_never_chain(bundled, monkeypatch):
    """A stop string needs the decoded text: no step is launched in flight for its batch."""
    path, prompts, params, want = bundled
    llm = _engine(path, 2, "slots", monkeypatch)
    stop = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=["\u2603"])
    assert _generate(llm, prompts[:2], [params, stop]) == want[:2]
    assert llm.engine.chain.launched == 0 and llm.engine.spec.drafter.fused.runs > 0


def test_derivation_reads_nothing_on_the_host(bundled, monkeypatch):
    from tests.engine.test_cuda_graph import _NoSync

    path, prompts, params, want = bundled
    llm = _engine(path, 3, "slots", monkeypatch)
    with monkeypatch.context() as m:
        nosync = _NoSync(m)
        fill = DerivedExtension.fill
        m.setattr(DerivedExtension, "fill", lambda self, *a: _guarded(nosync, fill)(self, *a))
        assert _generate(llm, prompts, params) == want
    assert llm.engine.chain.launched > 0


@pytest.mark.parametrize("k,j", [(2, 5), (3, 11)])
def test_replay_commit_of_a_step_past_a_finished_row(bundled, k, j, monkeypatch):
    """Every request stops on its j-th token, on a fresh engine: a step in flight then holds
    padding rows for requests that finished before it, ahead of live rows. Its "replay" commit
    must advance each live row's state in the row it ran in (the counts go to the commit graph
    in row order, the padding rows' too), or the rows after a padding row get another's count."""
    path, prompts, params, want = bundled
    llm = _engine(path, k, "replay", monkeypatch)
    stops = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[w[j]])
             for w in want]
    assert _generate(llm, prompts, stops) == [w[:w.index(w[j]) + 1] for w in want]
    assert llm.engine.chain.launched > 0
