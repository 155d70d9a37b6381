"""GLM-5-Next over 2 ranks (gloo, fp32) == one process, token for token: KDA with the safe gate
and A_log [H], DSA-MLA heads split with the indexer and the mHC streams replicated, clamped
SwiGLU experts whole on each rank (expert parallel); prefix cache and n-gram speculation on."""

from hyla import LLM
from tests.oracles.glm5_next_checkpoint import build_glm5_next_checkpoint
from tests.parallel.tp_cases import assert_same, generate, prompts


def test_tp2_expert_parallel_equals_tp1(tmp_path):
    path = build_glm5_next_checkpoint(tmp_path, "hc2")
    first = prompts(seed=2, lengths=(40, 17, 1))
    reference = generate(LLM(str(path), dtype="float32", enable_prefix_caching=True), first)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True,
              enable_prefix_caching=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    try:
        assert_same(generate(llm, first, [r[0] for r in reference]), reference)
        m = llm.get_metrics()
        assert m["prefix_cache_hit_tokens"] > 0 and m["spec_num_draft_tokens"] > 0
    finally:
        llm.shutdown()
