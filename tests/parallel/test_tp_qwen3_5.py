"""Qwen3.5's text layouts over 2 ranks (gloo, fp32) == one process, token for token, with the
prefix cache and n-gram speculation on (the multimodal MoE layout is in test_tp_qwen3_next):
the dense model (qwen3_5_text: GDN value heads grouped 2 per key head, 2 KV heads split one per
rank, dense MLPs) and the MoE model (qwen3_5_moe_text) with expert parallelism."""

import pytest

from hyla import LLM
from tests.oracles.qwen3_5_checkpoint import build_qwen3_5_checkpoint
from tests.parallel.tp_cases import assert_same, generate, prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize("variant,model_type,kw", [
    ("dense", "qwen3_5_text", dict()),
    ("moe", "qwen3_5_moe_text", dict(enable_expert_parallel=True)),
], ids=["dense-text", "moe-text-expert_parallel"])
def test_tp2_equals_tp1(tmp_path, variant, model_type, kw):
    path = build_qwen3_5_checkpoint(tmp_path, variant, "text")
    first = prompts(seed=6, lengths=(40, 1))
    reference = generate(LLM(str(path), dtype="float32", enable_prefix_caching=True), first)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, enable_prefix_caching=True,
              speculative_config=NGRAM, **kw)
    try:
        assert llm.engine.model.config.model_type == model_type
        assert_same(generate(llm, first, [r[0] for r in reference]), reference)
        m = llm.get_metrics()
        assert m["prefix_cache_hit_tokens"] > 0 and m["spec_num_draft_tokens"] > 0
        layers = llm.engine.model.model.layers
        gdn = next(layer.linear_attn for layer in layers if layer.is_linear)
        attn = next(layer.self_attn for layer in layers if not layer.is_linear)
        if variant == "dense":  # 2 key heads / 4 value heads / 4 query heads / 2 KV heads, halved
            assert (gdn.num_k_heads, gdn.num_v_heads, attn.num_heads, attn.num_kv_heads) == (1, 2, 2, 1)
        else:
            assert layers[0].mlp.experts.num_experts == 8  # 16 experts, whole, 8 per rank
    finally:
        llm.shutdown()
