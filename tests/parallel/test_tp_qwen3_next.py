"""Qwen3-Next and Qwen3.5 over 2 ranks (gloo, fp32) == one process, token for token, with the
prefix cache and n-gram speculation on: Qwen3-Next's head-interleaved GDN projections and
grouped conv channels with expert parallelism; Qwen3.5's multimodal layout with tied
embeddings, one KV head replicated on both ranks and an o_proj bias, experts split along
their width."""

import pytest

from hyla import LLM
from tests.oracles.qwen3_5_checkpoint import build_qwen3_5_checkpoint
from tests.oracles.qwen3_next_checkpoint import build_qwen3_next_checkpoint
from tests.parallel.tp_cases import assert_same, generate, prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tp-qwen")


@pytest.mark.parametrize("family,kw", [
    ("qwen3_next", dict(enable_expert_parallel=True)),
    ("qwen3_5", dict()),
], ids=["qwen3_next-expert_parallel", "qwen3_5-multimodal"])
def test_tp2_equals_tp1(root, family, kw):
    path = (build_qwen3_next_checkpoint(root, "moe") if family == "qwen3_next"
            else build_qwen3_5_checkpoint(root, "moe", "multimodal"))
    first = prompts(seed=1, lengths=(40, 17, 1))
    reference = generate(LLM(str(path), dtype="float32", enable_prefix_caching=True), first)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, enable_prefix_caching=True,
              speculative_config=NGRAM, **kw)
    try:
        assert_same(generate(llm, first, [r[0] for r in reference]), reference)
        m = llm.get_metrics()
        assert m["prefix_cache_hit_tokens"] > 0 and m["spec_num_draft_tokens"] > 0
        attn = next(layer.self_attn for layer in llm.engine.model.model.layers if not layer.is_linear)
        assert attn.num_kv_heads == 1  # Qwen3-Next: 2 KV heads split in 2; Qwen3.5: its 1 replicated
    finally:
        llm.shutdown()
