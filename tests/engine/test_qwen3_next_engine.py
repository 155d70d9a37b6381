"""The engine runs Qwen3-Next (Gated DeltaNet + gated GQA attention, MoE) with no family-specific
code: batching, chunked prefill, preemption, the prefix cache, speculative decoding (n-gram and
draft model, both rollbacks) and the CUDA-graph decode inputs all leave greedy output unchanged,
and greedy output equals transformers' generate."""


import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.engine.cuda_graph import graph_safe
from hyla.models import load_model
from tests.engine.spec_check import assert_spec_equals_greedy
from tests.oracles.qwen3_next_checkpoint import build_qwen3_next_checkpoint, load_qwen3_next_reference
from tests.oracles.variants import noisy_lm_head_copy
from tests.oracles.variants import rand_tokens as rand

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_qwen3_next_checkpoint(tmp_path_factory.mktemp("qwen3next-engine"), "moe", with_tokenizer=True)


@pytest.fixture(scope="module")
def prompts():
    return [rand(n, 1000 + n) for n in (1, 2, 150, 15, 16, 17, 63, 64, 65, 3, 31, 33, 7, 129)]


@pytest.fixture(scope="module")
def alone(ckpt, prompts):
    """Each prompt by itself, fp64 (batching can then only differ by rounding far below any
    argmax margin)."""
    llm = LLM(str(ckpt), dtype="float64", max_num_seqs=1)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(max_num_seqs=3, max_num_batched_tokens=24),
    "preemption",
], ids=["default", "chunked_prefill", "preemption"])
def test_batched_greedy_equals_alone(ckpt, prompts, alone, kw):
    if kw == "preemption":
        probe = load_model(ckpt, dtype=torch.float64)
        slot, page = probe.state_bytes_per_slot(), probe.kv_bytes_per_token() * 16
        # Slots for 5 requests, pages for fewer tokens than they hold together.
        kw = dict(max_num_seqs=5, max_model_len=176, memory_budget=5 * slot + 14 * page)
    llm = LLM(str(ckpt), dtype="float64", **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    m = llm.get_metrics()
    if "memory_budget" in kw:
        assert m["num_preemptions"] > 0
    assert m["kv_pages_free"] == m["kv_pages_total"] and m["state_slots_free"] == m["state_slots_total"]


def test_equals_transformers_generate(ckpt, prompts):
    ref = load_qwen3_next_reference(ckpt)
    chosen = [prompts[i] for i in (0, 3, 8, 13)]
    llm = LLM(str(ckpt), dtype="float32")
    outs = llm.generate(chosen, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, o in zip(chosen, outs):
        ids = torch.tensor([p])
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                eos_token_id=None)
        assert o.outputs[0].token_ids == want[0, len(p):].tolist()


# -- prefix cache ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(ckpt):
    """Cache-off greedy output of one prompt, memoised."""
    llm = LLM(str(ckpt), dtype="float64", max_model_len=600)
    seen = {}

    def run(prompt, params=GREEDY):
        key = (tuple(prompt), params.max_tokens)
        if key not in seen:
            seen[key] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        return seen[key]

    return run


def _one_by_one(llm, prompts, params=GREEDY):
    outs, hits = [], []
    for p in prompts:
        before = llm.get_metrics()["prefix_cache_hit_tokens"]
        outs.append(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
        hits.append(llm.get_metrics()["prefix_cache_hit_tokens"] - before)
    return outs, hits


def test_prefix_cache_shared_prefix_and_retries(ckpt, reference):
    system = rand(100, 1)
    prompts = [system + rand(5, 2), system + rand(11, 3), system + rand(7, 4), system + rand(7, 4), rand(9, 5)]
    prompts += [prompts[-1]] * 2  # identical retries of a short prompt
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=600)
    outs, hits = _one_by_one(llm, prompts)
    assert outs == [reference(p) for p in prompts]
    assert hits[0] == 0 and hits[2] >= 96  # the shared junction is exported by the 2nd request
    assert hits[3] == len(prompts[3]) - 1  # an identical retry: everything but the last token
    assert hits[5] == hits[6] == len(prompts[4]) - 1


def test_prefix_cache_multi_turn_and_batched(ckpt, reference):
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=600,
              max_num_batched_tokens=40, checkpoint_interval=32)
    context = rand(40, 6)
    previous = None  # prompt + output length of the previous turn
    for turn in range(3):
        (out,), (hit,) = _one_by_one(llm, [context])
        assert out == reference(context)
        if previous is not None:
            assert hit >= previous - 16
        previous = len(context) + len(out)
        context = context + out + rand(9 + turn, 30 + turn)
    system = rand(70, 7)
    batch = [system + rand(n, 50 + n) for n in (2, 30, 1, 17)]
    outs = [o.outputs[0].token_ids for o in llm.generate(batch + batch, GREEDY, use_tqdm=False)]
    assert outs == [reference(p) for p in batch + batch]
    assert llm.get_metrics()["prefix_cache_hit_tokens"] > 4 * 64


# -- speculative decoding -------------------------------------------------------------------

SPEC_PROMPTS = [rand(12, 1) * 3, rand(30, 2), rand(5, 3) * 4 + [9], [7], rand(70, 4)]
SPEC_GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def near_draft(ckpt, tmp_path_factory):
    """The target with noise on its LM head: agrees often, not always (partial acceptance)."""
    return noisy_lm_head_copy(ckpt, tmp_path_factory.mktemp("qwen3next-draft") / "near", scale=0.05)


@pytest.fixture(scope="module")
def spec_reference(ckpt):
    llm = LLM(str(ckpt), dtype="float64")
    return [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, SPEC_GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method,rollback,prefix_cache", [
    ("ngram", "slots", False), ("ngram", "replay", True), ("draft", "slots", True), ("draft", "replay", False),
])
def test_speculative_greedy_equals_plain_greedy(ckpt, near_draft, spec_reference, method, rollback, prefix_cache):
    assert_spec_equals_greedy(ckpt, near_draft, SPEC_PROMPTS, SPEC_GREEDY, spec_reference, rollback, method, prefix_cache)


def test_a_b_a_with_spec_and_prefix_cache_is_never_poisoned(ckpt, near_draft, reference):
    shared = rand(40, 11)
    a, b = shared + rand(6, 12), shared + rand(9, 13)
    cfg = {"method": "draft_model", "model": str(near_draft), "num_speculative_tokens": 4, "rollback": "slots"}
    llm = LLM(str(ckpt), dtype="float64", speculative_config=cfg, enable_prefix_caching=True)
    got, hits = _one_by_one(llm, [a, b, a])
    assert got == [reference(p) for p in (a, b, a)]
    assert hits[2] >= len(a) - 1


# -- CUDA-graph decode inputs ---------------------------------------------------------------

def test_graph_safety_is_declared_by_the_layers(ckpt):
    model = load_model(ckpt)
    assert graph_safe(model)  # MoE routing and the stacked experts run without host syncs
    model.model.layers[1].mlp.graph_safe = False  # a module that would sync turns graphs off
    assert not graph_safe(model)

