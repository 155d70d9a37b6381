"""Overlapped decode steps (hyla.engine.overlap), on the CPU: a CUDAGraphRunner with capture off
runs the decode graphs' padded inputs eagerly, so the step launched before the previous one's
draws are read (its token ids copied on the device, stopped rows turned into padding) runs the
same code as on a GPU. Output equals the engine without overlap token for token: greedy and
seeded sampling, logprobs, requests that stop on a token mid-chain (EOS, stop_token_ids), the
prefix cache (states filed while a step was in flight, then hit), preemption under a small
budget, aborts and new requests while a step is in flight; requests the device cannot decide
for (stop strings) never launch ahead; an all-greedy batch draws the graph's argmax, with no sampler
pass, and a failed argmax draw (-1) runs as padding in the step behind it."""

import pytest

from hyla import LLM, SamplingParams
from hyla.engine import model_runner
from hyla.models import default_model_path

PROMPTS = ["def read_file(path):", "import os", "class Point:", "for i in range(10):", "The capital of"]


def _llm(monkeypatch, overlap: bool, **kw) -> LLM:
    with monkeypatch.context() as m:
        m.setattr(model_runner, "use_cuda_graphs", lambda model, eager: True)  # graphs, capture off
        llm = LLM(str(default_model_path()), device="cpu", dtype="float32", async_scheduling=overlap,
                  max_num_seqs=8, **kw)
    assert (llm.engine.overlap is not None) == overlap
    return llm


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def stop_ids():
    """Token ids the bundled model's greedy continuations emit early: stopping on them ends
    requests mid-chain."""
    llm = LLM(str(default_model_path()), device="cpu", dtype="float32")
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return sorted({o.outputs[0].token_ids[5] for o in out[:3]})


def _params(stop_ids):
    return [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=stop_ids[:1]),
            SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20, logprobs=3),
            SamplingParams(temperature=0.0, max_tokens=17, stop_token_ids=stop_ids, min_tokens=3),
            SamplingParams(temperature=0.7, seed=3, max_tokens=26, repetition_penalty=1.2, ignore_eos=True)]


def test_overlap_equals_plain_steps(monkeypatch, stop_ids):
    params = _params(stop_ids)
    want = _run(_llm(monkeypatch, False), PROMPTS, params)
    llm = _llm(monkeypatch, True)
    assert _run(llm, PROMPTS, params) == want
    assert _run(llm, PROMPTS[:1], params[:1]) == want[:1]  # batch 1
    assert llm.engine.overlap.launched > 0 and llm.engine.overlap.flight is None
    assert any(r == "stop" for _, r in want), "no request stopped on a token: the padding rows went untested"


def test_overlap_logprobs_equal(monkeypatch):
    p = SamplingParams(temperature=0.8, seed=11, max_tokens=16, logprobs=2, ignore_eos=True)
    a = _llm(monkeypatch, False).generate(PROMPTS[:3], p, use_tqdm=False)
    b = _llm(monkeypatch, True).generate(PROMPTS[:3], p, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[t] - ly[t]) < 1e-5 for t in lx)


def test_overlap_with_prefix_cache_and_preemption(monkeypatch, stop_ids):
    """A small budget preempts; the prefix cache files the states of requests that stopped
    while a step was in flight, and the second pass hits them."""
    params = _params(stop_ids)
    # ~395-token prompts sharing 24 pages, prefilled in 64-token chunks: 3 state slots and 66
    # pages of 16 tokens run out as they decode
    base = "import numpy as np\n" + "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(30))
    prompts = [base + p for p in PROMPTS]
    kw = dict(enable_prefix_caching=True, max_model_len=512, memory_budget=2_700_000, max_num_batched_tokens=64)
    want = _run(_llm(monkeypatch, False), prompts, params)
    llm = _llm(monkeypatch, True, **kw)
    for _ in range(2):
        assert _run(llm, prompts, params) == want
    m = llm.get_metrics()
    assert m["prefix_cache_hit_tokens"] > 0 and m["num_preemptions"] > 0 and llm.engine.overlap.launched > 0, m


def test_abort_and_arrival_while_in_flight(monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = dict(zip(PROMPTS, _run(_llm(monkeypatch, False), PROMPTS, params)))
    engine = _llm(monkeypatch, True).engine
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), p, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        steps += 1
        if steps == 6:
            assert engine.overlap.flight is not None
            engine.add_request("3", PROMPTS[3], params)  # arrives while a step is in flight
            assert engine.abort_request("1")  # lands the step in flight first
    assert done["0"] == want[PROMPTS[0]] and done["2"] == want[PROMPTS[2]] and done["3"] == want[PROMPTS[3]]
    assert "1" not in done and "1" not in engine.requests  # aborted: no further output
    assert engine.pools.pages.num_free == engine.pools.pages.num_pages  # nothing leaked


def test_an_incoming_request_holds_the_launch(monkeypatch):
    """While a request is on its way (a server's Scheduler.incoming), no step is launched ahead:
    the request's prefill joins the next step instead of the one after it. Output unchanged."""
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = _run(_llm(monkeypatch, False), PROMPTS[:2], [p, p])
    llm = _llm(monkeypatch, True)
    on_its_way = [True]
    llm.engine.scheduler.incoming = lambda: on_its_way[0]
    assert _run(llm, PROMPTS[:2], [p, p]) == want
    assert llm.engine.overlap.launched == 0
    on_its_way[0] = False
    assert _run(llm, PROMPTS[:2], [p, p]) == want
    assert llm.engine.overlap.launched > 0


def test_stop_strings_never_launch_ahead(monkeypatch):
    llm = _llm(monkeypatch, True)
    want = _run(_llm(monkeypatch, False), PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=12, stop=["zzz"]))
    assert _run(llm, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=12, stop=["zzz"])) == want
    assert llm.engine.overlap.launched == 0


def test_greedy_batches_take_the_graphs_argmax(monkeypatch, stop_ids):
    """A batch whose every draw is the argmax takes it from the decode graph (no sampler pass over
    the logits): token for token the engine without graphs, whose sampler draws every step, with
    the overlap and without; the sampler then runs for the prompts' steps only."""
    from hyla.engine import sampler

    params = [SamplingParams(temperature=0.0, max_tokens=20 + i, stop_token_ids=stop_ids[:i % 2 + 1])
              for i in range(len(PROMPTS))]
    want = _run(LLM(str(default_model_path()), device="cpu", dtype="float32"), PROMPTS, params)
    passes = []
    real = sampler._sample_on_device
    monkeypatch.setattr(sampler, "_sample_on_device", lambda *a: passes.append(1) or real(*a))
    for overlap in (True, False):
        passes.clear()
        assert _run(_llm(monkeypatch, overlap), PROMPTS, params) == want
        assert 0 < len(passes) <= len(PROMPTS), len(passes)


def test_a_failed_argmax_draw_stops_its_row_in_flight():
    """A failed argmax draw is -1 (sampler.argmax_ids); every row's padded stop ids hold a -1,
    so the step launched behind it runs that row as padding, also with MAX_STOPS stop ids."""
    from types import SimpleNamespace

    from hyla.engine import overlap as overlap_mod

    ov = overlap_mod.DecodeOverlap(runner=None, scheduler=None, max_model_len=100)
    seq = SimpleNamespace(num_tokens=5)
    for ids in ([], [7], list(range(overlap_mod.MAX_STOPS))):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(overlap_mod, "device_stop_ids", lambda s, n, ids=ids: list(ids))
            stops = ov.stops(seq)
        assert len(stops) == overlap_mod.MAX_STOPS + 1 and -1 in stops and list(stops[:len(ids)]) == ids
