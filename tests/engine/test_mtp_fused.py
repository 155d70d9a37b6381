"""MTP's fused greedy step (hyla.engine.spec.mtp.fused), on the CPU: the verify, the acceptance, the
head's catch-up and the next draft chain run as one function over the verify graph's buffers
(a CUDAGraphRunner with capture off runs it eagerly: what a capture records). Output equals plain
greedy token for token with the fused path taken (counted), for k = 1..3, both rollbacks, prefix
cache on and off, requests ending mid-acceptance, eviction and preemption; a batch with a
sampling request falls back to the unfused step; a request alone drafts exactly the unfused
path's drafts; the device part reads nothing on the host."""

import pytest

from hyla import LLM, SamplingParams
from hyla.engine import model_runner
from hyla.engine.spec.mtp import drafter as mtp
from hyla.engine.spec.mtp.fused import FusedVerify
from tests.engine.test_mtp_graph import _guarded, build_leaky_head
from tests.oracles.variants import rand_tokens as rand

PROMPTS = [rand(12, 1) * 3, [7], rand(5, 3) * 4, rand(20, 4), rand(40, 5)]  # the last: across pages
# requests finish at different steps, mid-acceptance too: near its end a request drafts fewer
PARAMS = [SamplingParams(temperature=0.0, max_tokens=5 + 4 * i, ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # the MoE checkpoint's target repeats itself now and then: partial acceptance
    return build_leaky_head(tmp_path_factory.mktemp("mtp-fused"), variant=("moe", "multimodal"))


@pytest.fixture(scope="module")
def plain(ckpt):
    llm = LLM(str(ckpt), dtype="float64", device="cpu")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _engine(ckpt, k: int, rollback: str, monkeypatch, fused: bool = True, graphs: bool = True, chain: bool = True,
            **kw) -> LLM:
    with monkeypatch.context() as m:
        if graphs:  # a CUDAGraphRunner with capture off: the verify (and fused) graphs run eagerly
            m.setattr(model_runner, "use_cuda_graphs", lambda model, eager: True)
        llm = LLM(str(ckpt), dtype="float64", device="cpu", max_num_seqs=kw.pop("max_num_seqs", len(PROMPTS)),
                  speculative_config={"method": "mtp", "num_speculative_tokens": k, "rollback": rollback}, **kw)
    drafter = llm.engine.spec.drafter
    assert (drafter.fused is not None) == graphs
    assert (llm.engine.chain is not None) == graphs
    if not fused or not chain:  # no overlapped steps (hyla.engine.spec.mtp.overlap): one readback per step
        llm.engine.chain = drafter.chain = None
    if not fused:
        drafter.fused = None
    return llm


class _Counts:
    """Wraps an engine's drafter: how many fused steps committed in full / fell back at commit
    (the request kept fewer tokens than it accepted), how many proposals came prefetched."""

    def __init__(self, drafter, monkeypatch):
        self.full = self.partial = self.prefetched = 0
        commit = mtp.commit_fused

        def counted(d, seq, kept, result):
            done = commit(d, seq, kept, result)
            if done:
                self.full += 1
            else:
                self.partial += 1
            return done
        monkeypatch.setattr(mtp, "commit_fused", counted)
        take = drafter._prefetched

        def prefetched(seq):
            d = take(seq)
            self.prefetched += d is not None
            return d
        drafter._prefetched = prefetched


def _generate(llm, prompts=PROMPTS, params=PARAMS) -> list:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("k,rollback,prefix_cache", [
    (1, "replay", False), (1, "slots", True), (2, "slots", False), (2, "replay", True), (3, "slots", True),
    (3, "replay", False),
])
def test_fused_step_equals_plain_greedy(ckpt, plain, k, rollback, prefix_cache, monkeypatch):
    llm = _engine(ckpt, k, rollback, monkeypatch, enable_prefix_caching=prefix_cache)
    counts = _Counts(llm.engine.spec.drafter, monkeypatch)
    passes = 2 if prefix_cache else 1  # a second pass hits the prefix cache (a head view starting past 0)
    for _ in range(passes):
        assert _generate(llm) == plain
    fused = llm.engine.spec.drafter.fused
    m = llm.get_metrics()
    assert fused.runs > 0 and counts.full > 0 and counts.prefetched > 0
    assert 0 < m["spec_num_accepted_tokens"] < m["spec_num_draft_tokens"]
    assert any(key[4:] for key in llm.engine.runner.graphs.verify_graphs)  # the fused graph's key
    if prefix_cache:
        assert m["prefix_cache_hit_tokens"] > 0
    assert not llm.engine.spec.drafter.views and not llm.engine.spec.drafter._fused


@pytest.fixture(scope="module")
def bundled():
    """The bundled qwen3.5-mtp (its head drafts well: whole acceptances), fp64, with the bench's
    prompts and its plain greedy outputs."""
    from hyla.bench.spec import FREE, REPETITIVE
    from hyla.models.hub import resolve_model

    path = resolve_model("qwen3.5-mtp")
    prompts = REPETITIVE + FREE
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return path, prompts, params, _generate(LLM(str(path), dtype="float64", device="cpu"), prompts, params)


@pytest.mark.parametrize("k,rollback", [(1, "slots"), (2, "replay"), (3, "slots"), (3, "replay")])
def test_bundled_model_fused_equals_plain_greedy(bundled, k, rollback, monkeypatch):
    path, prompts, params, want = bundled
    llm = _engine(path, k, rollback, monkeypatch)
    counts = _Counts(llm.engine.spec.drafter, monkeypatch)
    assert _generate(llm, prompts, params) == want
    m = llm.get_metrics()
    assert counts.full > 0 and counts.prefetched > 0 and m["spec_mean_accepted_length"] > 1.5, m


@pytest.mark.parametrize("k,rollback", [(1, "slots"), (3, "replay")])
def test_stop_token_mid_acceptance(bundled, k, rollback, monkeypatch):
    """Requests that stop on a token of their output (stop_token_ids) keep fewer tokens than the
    fused step accepted: their kept rows go back to pending pairs and the prefetched drafts are
    dropped; the output is plain greedy cut after the stop token."""
    path, prompts, base, plain = bundled
    llm = _engine(path, k, rollback, monkeypatch)
    counts = _Counts(llm.engine.spec.drafter, monkeypatch)
    for j in range(2, 22, 3):  # stop at each request's j-th output token (an accepted draft or a bonus token)
        params = [SamplingParams(temperature=0.0, max_tokens=base.max_tokens, ignore_eos=True,
                                 stop_token_ids=[t[j]]) for t in plain]
        want = [t[:t.index(t[j]) + 1] for t in plain]
        assert _generate(llm, prompts, params) == want
    assert counts.full > 0 and counts.partial > 0
    assert not llm.engine.spec.drafter.views and not llm.engine.spec.drafter._fused


@pytest.mark.parametrize("rollback", ["slots", "replay"])
def test_fused_drafts_equal_unfused_drafts_alone(ckpt, plain, rollback, monkeypatch):
    """A request alone (no padding request writes the head's scratch page): every proposal of the
    fused engine equals the unfused engine's, step for step."""
    def proposals(fused: bool) -> list:
        llm = _engine(ckpt, 3, rollback, monkeypatch, fused=fused, chain=False)  # every step proposes
        drafter, seen = llm.engine.spec.drafter, []
        propose = drafter.propose

        def record(seqs, ks, generator=None):
            out = propose(seqs, ks, generator)
            seen.append([d for d, _ in out])
            return out
        drafter.propose = record
        outs = [_generate(llm, [p], [q])[0] for p, q in zip(PROMPTS, PARAMS)]
        assert outs == plain
        assert (drafter.fused.runs > 0) if fused else drafter.fused is None
        return seen

    want, got = proposals(False), proposals(True)
    assert got == want and sum(len(d) for step in got for d in step) > 0


def test_sampling_in_the_batch_falls_back(ckpt, plain, monkeypatch):
    """Seeded sampling requests beside greedy ones: no fused step while a sampling request is in
    the batch (the greedy rest fuses once they finished); the greedy requests give plain greedy,
    the sampling ones what the engine without graphs gives."""
    params = [p if i % 2 else SamplingParams(temperature=0.8, seed=i, max_tokens=4 + i, ignore_eos=True)
              for i, p in enumerate(PARAMS)]
    want = _generate(_engine(ckpt, 3, "slots", monkeypatch, graphs=False), params=params)
    llm = _engine(ckpt, 3, "slots", monkeypatch)
    spec, batches = llm.engine.spec, []
    verify = spec._verify_extended  # the verify with the drafter's graph extension: the fused step

    def record(seqs, drafts, pad_to, chain=None):
        out = verify(seqs, drafts, pad_to, chain)
        batches.append((any(not s.params.greedy for s in seqs), out is not None))
        return out
    spec._verify_extended = record
    got = _generate(llm, params=params)
    assert got == want
    assert [got[i] for i in range(1, len(PROMPTS), 2)] == [plain[i] for i in range(1, len(PROMPTS), 2)]
    assert any(s for s, _ in batches) and not any(f for s, f in batches if s)
    assert any(f for s, f in batches if not s)


def test_logprobs_fall_back_and_stay_exact(ckpt, plain, monkeypatch):
    """A greedy request asking for logprobs runs the unfused step (its logits are read on the
    host); its logprobs equal the plain engine's."""
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)]
    base = LLM(str(ckpt), dtype="float64", device="cpu").generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    llm = _engine(ckpt, 3, "replay", monkeypatch)
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids and llm.engine.spec.drafter.fused.runs == 0
    for a, b in zip(out.logprobs, base.logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a), (a, b)  # fp32 logits


@pytest.mark.parametrize("k,rollback", [(2, "slots"), (3, "replay")])
def test_fused_under_eviction_and_preemption(k, rollback, tmp_path, monkeypatch):
    """test_mtp_eviction's pressure (a few pages, prefix cache on: pages and checkpoints evicted,
    running requests preempted and recomputed) with the fused step: plain greedy output."""
    from tests.engine.test_mtp_eviction import PARAMS as EPARAMS, PROMPTS as EPROMPTS
    from tests.engine.test_mtp_prompt import _checkpoint

    path = _checkpoint(tmp_path, repeat=True)
    probe = LLM(str(path), dtype="float64", device="cpu", max_model_len=80)
    want = _generate(probe, EPROMPTS, EPARAMS)
    model = probe.engine.model
    page = probe.engine.kv_bytes_per_page + model.config.layer_sizes().kv_per_token * 8 * 16  # + the head's layer
    per_seq = 1 + k if rollback == "slots" else 1
    slots = 3 * per_seq + 3
    llm = _engine(path, k, rollback, monkeypatch, max_num_seqs=3, max_model_len=80, enable_prefix_caching=True,
                  checkpoint_interval=8, memory_budget=slots * model.state_bytes_per_slot() + 10 * page)
    for _ in range(2):
        assert _generate(llm, EPROMPTS, EPARAMS) == want
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hit_tokens"] > 0, m
    assert llm.engine.spec.drafter.fused.runs > 0
    assert llm.engine.chain.launched > 0  # steps launched in flight (hyla.engine.spec.mtp.overlap) under pressure too
    assert not llm.engine.spec.drafter.views


def test_fused_device_part_reads_nothing_on_the_host(ckpt, plain, monkeypatch):
    """FusedVerify.forward (what the graph captures after the verify forward) with every host
    sync failing inside it: the engine still gives plain greedy."""
    from tests.engine.test_cuda_graph import _NoSync

    llm = _engine(ckpt, 3, "slots", monkeypatch)
    fused = llm.engine.spec.drafter.fused
    with monkeypatch.context() as m:
        nosync = _NoSync(m)
        m.setattr(fused, "forward", _guarded(nosync, fused.forward))
        assert _generate(llm) == plain
    assert fused.runs > 0


def test_fused_off_without_graphs_or_under_tensor_parallelism(ckpt, monkeypatch):
    eager = _engine(ckpt, 2, "slots", monkeypatch, graphs=False).engine.spec.drafter
    assert eager.fused is None and eager.graph_extension is None
    llm = _engine(ckpt, 2, "slots", monkeypatch)
    drafter = llm.engine.spec.drafter
    assert isinstance(drafter.fused, FusedVerify) and drafter.graph_extension is drafter.fused
    drafter.group = object()  # a model group: each step's tokens would be broadcast
    assert drafter.graph_extension.extend([], [], 3) is None


def test_a_fused_step_reads_the_host_once(bundled, monkeypatch):
    """Outside the captured part (what a graph replay stands for), a steady-state fused step
    (propose returning the prefetched drafts, the fused verify, the bookkeeping) reads the
    device once: the readback of (argmax ids, accepted counts, next drafts)."""
    import torch

    path, prompts, params, want = bundled
    llm = _engine(path, 3, "slots", monkeypatch)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    reads, state = [], {"inside": False, "on": False}
    for name in ("item", "tolist", "cpu", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(t, *a, _original=original, _name=name, **k):
            if state["on"] and not state["inside"]:
                reads.append(_name)
            return _original(t, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    verify_step = graphs._verify_step

    def captured(*a):  # a graph replay on a GPU: no host reads counted inside
        state["inside"] = True
        try:
            return verify_step(*a)
        finally:
            state["inside"] = False
    graphs._verify_step = captured
    spec_step, per_step = engine._spec_step, []

    def counted_step(batch):
        runs = engine.spec.drafter.fused.runs
        del reads[:]
        state["on"] = True
        try:
            return spec_step(batch)
        finally:
            state["on"] = False
            if engine.spec.drafter.fused.runs > runs:
                per_step.append(list(reads))
    engine._spec_step = counted_step
    assert _generate(llm, prompts[:1], params) == want[:1]
    # the first fused step's propose ran the head (its chain's readback): the request's first drafts
    assert len(per_step) > 3 and all(r == ["tolist"] for r in per_step[1:]), per_step
