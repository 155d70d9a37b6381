"""The engine serves Qwen3.5 with no family-specific code: on the released multimodal layout
(MoE) chunked prefill, the prefix cache and n-gram speculation (both rollbacks) leave greedy output
unchanged; the causal-LM layout (dense) runs the same with everything on at once. (Greedy tokens
equal to transformers' generate: tests/models/test_qwen3_5_oracle.py, all four layouts.)"""

import pytest

from hyla import LLM, SamplingParams
from tests.engine.spec_check import assert_spec_equals_greedy
from tests.oracles.qwen3_5_checkpoint import build_qwen3_5_checkpoint
from tests.oracles.variants import rand_tokens as rand

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3_5-engine")


@pytest.fixture(scope="module")
def ckpt(root):
    return build_qwen3_5_checkpoint(root, "moe", "multimodal", with_tokenizer=True)


PROMPTS = [rand(n, 1000 + n) for n in (1, 150, 17, 33)]


@pytest.fixture(scope="module")
def reference(ckpt):
    """Cache-off greedy output of one prompt, each prompt alone, fp64, memoised."""
    llm = LLM(str(ckpt), dtype="float64", max_num_seqs=1, max_model_len=600)
    seen = {}

    def run(prompt, params=GREEDY):
        key = (tuple(prompt), params.max_tokens)
        if key not in seen:
            seen[key] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        return seen[key]

    return run


def test_chunked_prefill_batched_greedy_equals_alone(ckpt, reference):
    llm = LLM(str(ckpt), dtype="float64", max_num_seqs=3, max_num_batched_tokens=24)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference(p) for p in PROMPTS]
    m = llm.get_metrics()
    assert m["kv_pages_free"] == m["kv_pages_total"] and m["state_slots_free"] == m["state_slots_total"]


def test_prefix_cache_shared_prefix_and_retries(ckpt, reference):
    system = rand(100, 1)
    prompts = [system + rand(5, 2), system + rand(11, 3), system + rand(7, 4), system + rand(7, 4)]
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, max_model_len=600)
    outs, hits = [], []
    for p in prompts:
        before = llm.get_metrics()["prefix_cache_hit_tokens"]
        outs.append(llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        hits.append(llm.get_metrics()["prefix_cache_hit_tokens"] - before)
    assert outs == [reference(p) for p in prompts]
    assert hits[0] == 0 and hits[2] >= 96  # the shared junction is exported by the 2nd request
    assert hits[3] == len(prompts[3]) - 1  # an identical retry: everything but the last token


SPEC_PROMPTS = [rand(12, 1) * 3, rand(5, 3) * 4 + [9], [7]]
SPEC_GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("rollback,prefix_cache", [("slots", True), ("replay", False)])
def test_ngram_speculation_equals_plain_greedy(ckpt, reference, rollback, prefix_cache):
    want = [reference(p, SPEC_GREEDY) for p in SPEC_PROMPTS]
    assert_spec_equals_greedy(ckpt, None, SPEC_PROMPTS, SPEC_GREEDY, want, rollback, "ngram", prefix_cache)


def test_text_layout_with_chunked_prefill_prefix_cache_and_ngram(root):
    path = build_qwen3_5_checkpoint(root, "dense", "text", with_tokenizer=True)
    shared = rand(48, 21)
    # the 2nd request exports the shared junction, the 3rd hits it
    prompts = [shared + rand(5, 22), shared + rand(9, 23), shared + rand(3, 25), rand(8, 24) * 3]
    plain = LLM(str(path), dtype="float64", max_num_seqs=1)
    want = [plain.generate([p], SPEC_GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(str(path), dtype="float64", enable_prefix_caching=True, max_num_batched_tokens=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "rollback": "slots"})
    got = [llm.generate([p], SPEC_GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == want
    m = llm.get_metrics()
    assert m["prefix_cache_hit_tokens"] >= 32 and m["spec_num_draft_tokens"] > 0
