"""GLM-5-Next memory report for the GLM-5.3-Flash sizes: hyla's per-token and per-request bytes,
and vLLM's page unification as seed 000 derives it (block 640, 20.7% padding, groups [9, 9, 8, 8])."""

import torch

from hyla.models import load_model
from hyla.models.glm5_next_memory import (
    glm5_next_memory_report, indexer_bytes_per_token, kda_state_bytes, released_config, vllm_page_unification,
)
from tests.oracles.glm5_next_checkpoint import glm5_next_checkpoint  # noqa: F401


def test_released_sizes_and_seed_figures():
    c = released_config()
    assert (len(c.linear_layers), len(c.attention_layers), c.num_experts, c.index_kpool) == (34, 11, 288, 4)
    r = glm5_next_memory_report(c)
    assert r.base.kv_bytes_per_token == 11 * 512 * 2  # NoPE latents only
    assert r.indexer_bytes_per_token == 11 * (2 * 128 * 2 + 128 * 2 // 4)
    assert r.kda_state_by_tp[8] == 34 * (8 * 128 * 128 * 4 + 3 * 8 * 128 * 3 * 2)
    assert r.kda_state_by_tp[1] == 8 * r.kda_state_by_tp[8] == r.base.state_bytes_per_request
    v = r.vllm
    assert v.mamba_page == 542_720 and v.mla_bytes_per_token == 1024 and v.indexer_bytes_per_pool == 132
    assert v.block_size == 640 == 128 * -(-542_720 // (128 * 1024))
    assert v.mla_block == 655_360 and v.indexer_block == 20.625 * 1024
    assert f"{100 * v.padding:.1f}" in ("20.7", "20.8") and abs(v.padding - 0.2075) < 1e-3
    assert v.kda_groups == [9, 9, 8, 8]
    text = str(r)
    for figure in ("34 KDA + 11 DSA-MLA", "640 tokens", "542,720", "20.75%", "[9, 9, 8, 8]", "20.625 KiB"):
        assert figure in text


def test_vllm_sizing_moves_with_tp():
    c = released_config()
    assert kda_state_bytes(c, 1) == 8 * kda_state_bytes(c, 8)
    v1 = vllm_page_unification(c, tp=1)
    assert v1.block_size == 128 * -(-v1.mamba_page // (128 * 1024)) and v1.block_size > 640


def test_model_budgets_the_indexer_pages(glm5_next_checkpoint):  # noqa: F811
    model = load_model(glm5_next_checkpoint("hc2"), dtype=torch.float32)
    c = model.config
    cache = model.allocate_cache(num_slots=2, num_pages=3, page_size=16)
    assert all(c.state.transpose(-1, -2).is_contiguous() and not c.state.is_contiguous()
               for c in cache.linear_layers), "K-last (hyla.contract.state_pool)"
    paged = sum(t.numel() * t.element_size() for layer in cache.attention_layers for t in layer.tensors())
    assert paged == 3 * 16 * model.kv_bytes_per_token()
    assert model.kv_bytes_per_token() == 4 * len(c.attention_layers) * c.kv_lora_rank + indexer_bytes_per_token(
        c, torch.float32)
