"""The engine serves Kimi K3 with no family-specific code (its attention-residual bank lives in
one step's activations, its caches are KDA state slots and MLA latent pages): 32 greedy tokens
equal the loop oracle's, and batching, preemption, the prefix cache and n-gram speculation
leave greedy output unchanged."""

import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.models import load_model
from tests.engine.spec_check import assert_spec_equals_greedy
from tests.oracles.kimi_k3_checkpoint import build_kimi_k3_checkpoint, config_dict, random_state
from tests.oracles.kimi_k3_oracle import k3_oracle_logits
from tests.oracles.variants import rand_tokens as rand

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_kimi_k3_checkpoint(tmp_path_factory.mktemp("k3-engine"))


@pytest.fixture(scope="module")
def prompts():
    return [rand(n, 3000 + n) for n in (1, 5, 40, 17, 33)]


@pytest.fixture(scope="module")
def alone(ckpt, prompts):
    llm = LLM(str(ckpt), dtype="float64", max_num_seqs=1)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_greedy_equals_loop_oracle(ckpt, prompts):
    """fp32 engine greedy (chunked prefill, recurrent decode, paged MLA) == the fp64 oracle's."""
    state, text = random_state(config_dict(), 0), config_dict()["text_config"]
    llm = LLM(str(ckpt), dtype="float32")
    chosen = [prompts[1]]  # 5 tokens; the oracle re-runs the whole sequence for every new token
    outs = llm.generate(chosen, GREEDY, use_tqdm=False)
    for p, o in zip(chosen, outs):
        ids = list(p)
        for _ in range(GREEDY.max_tokens):
            ids.append(int(k3_oracle_logits(state, text, ids)[-1].argmax()))
        assert o.outputs[0].token_ids == ids[len(p):]


@pytest.mark.parametrize("kw", [dict(max_num_seqs=3, max_num_batched_tokens=24), "preemption"],
                         ids=["chunked_prefill", "preemption"])
def test_batched_greedy_equals_alone(ckpt, prompts, alone, kw):
    if kw == "preemption":
        probe = load_model(ckpt, dtype=torch.float64)
        slot, page = probe.state_bytes_per_slot(), probe.kv_bytes_per_token() * 16
        kw = dict(max_num_seqs=4, max_model_len=80, memory_budget=4 * slot + 9 * page)
    llm = LLM(str(ckpt), dtype="float64", **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    m = llm.get_metrics()
    if "memory_budget" in kw:
        assert m["num_preemptions"] > 0
    assert m["kv_pages_free"] == m["kv_pages_total"] and m["state_slots_free"] == m["state_slots_total"]


def test_prefix_cache_equals_plain_greedy(ckpt):
    system = rand(50, 1)
    # the third shares a state checkpoint with the first two; the fourth repeats it (all but its last token hit)
    prompts = [system + rand(5, 2), system + rand(11, 3), system + rand(7, 4), system + rand(7, 4)]
    plain = LLM(str(ckpt), dtype="float64")
    want = [plain.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True)
    outs, hits = [], []
    for p in prompts:
        before = llm.get_metrics()["prefix_cache_hit_tokens"]
        outs.append(llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        hits.append(llm.get_metrics()["prefix_cache_hit_tokens"] - before)
    assert outs == want
    assert hits[0] == 0 and hits[2] >= 48 and hits[3] == len(prompts[3]) - 1


SPEC_PROMPTS = [rand(12, 1) * 3, rand(5, 3) * 4 + [9], [7]]
SPEC_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def spec_reference(ckpt):
    return [o.outputs[0].token_ids
            for o in LLM(str(ckpt), dtype="float64").generate(SPEC_PROMPTS, SPEC_GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("rollback,prefix_cache", [("slots", False), ("replay", True)])
def test_ngram_speculation_equals_plain_greedy(ckpt, spec_reference, rollback, prefix_cache):
    assert_spec_equals_greedy(ckpt, None, SPEC_PROMPTS, SPEC_GREEDY, spec_reference, rollback, "ngram", prefix_cache)


def test_hyla_serve_answers_with_the_engine_greedy_tokens(ckpt):
    """`hyla serve` on the K3 checkpoint: an OpenAI completion returns LLM's greedy continuation."""
    import httpx

    from tests.server.live import start, stop

    prompt = "the cat sat on the mat"
    want = LLM(str(ckpt), dtype="float32").generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                                                ignore_eos=True), use_tqdm=False)
    proc, base = start(ckpt)
    try:
        body = {"model": ckpt.name, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        got = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
    finally:
        stop(proc)
    assert got["choices"][0]["text"] == want[0].outputs[0].text
    assert got["usage"]["completion_tokens"] == 8
