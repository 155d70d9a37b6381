"""Kimi K3's parameter and memory report for the released config: seed 001's KDA counts from a
meta-device model, the config's own count equal to the model's, and per-GPU weights / KV / state
at TP = EP = 8, 16, 32 from their formulas."""

import pytest
import torch

from hyla.models.kimi_k3_memory import (
    MXFP4_BYTES_PER_WEIGHT, count_parameters, kimi_k3_memory_report, meta_model, per_gpu, released_config,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def report():
    return kimi_k3_memory_report()


def test_seed_001_kda_counts_from_a_meta_model(report):
    c = report.counts
    assert len(c.kda_per_layer) == 69 and len(c.mla_per_layer) == 24
    assert set(c.kda_per_layer) == {443_740_416}
    assert c.kda == 30_618_088_704
    assert c.total == sum(report.config_counts)  # the config's formula counts every tensor the model has
    cfg = released_config()
    assert sum(cfg.kda_parameters()) == 443_740_416


def test_tiny_config_counts_match_its_model():
    from tests.oracles.kimi_k3_checkpoint import config_dict
    from hyla.models.kimi_k3_config import KimiK3Config

    cfg = KimiK3Config.from_hf_dict(config_dict())
    assert count_parameters(meta_model(cfg)).total == sum(cfg.parameter_counts())


def test_per_gpu_figures(report):
    cfg = released_config()
    g8, g16, g32 = report.gpus
    assert [g.degree for g in report.gpus] == [8, 16, 32]
    assert [g.experts_per_gpu for g in report.gpus] == [112, 56, 28]
    assert g8.kv_bytes_per_token == g32.kv_bytes_per_token == 24 * (512 + 64) * 2  # latents are not split
    assert g8.state_bytes_per_request == 69 * (12 * 128 * 128 * 4 + 3 * 1536 * 3 * 2)
    assert g8.state_bytes_per_request == 2 * g16.state_bytes_per_request == 4 * g32.state_bytes_per_request
    assert g8.expert_weight_bytes == 92 * 112 * 3 * 3584 * 3072 * MXFP4_BYTES_PER_WEIGHT
    assert g8.weight_bytes > g16.weight_bytes > g32.weight_bytes
    # one GPU holds the whole checkpoint: bf16, fp32 tensors at 4 bytes, MXFP4 routed experts
    main, fp32 = cfg.parameter_counts()
    one = per_gpu(cfg, 1)
    routed = report.counts.routed_experts
    assert one.dense_weight_bytes == 2 * (main - routed) + 4 * fp32
    assert one.expert_weight_bytes == routed * MXFP4_BYTES_PER_WEIGHT
    with pytest.raises(ValueError, match="linear_num_heads"):
        per_gpu(cfg, 64)
    text = str(report)
    for figure in ("443,740,416 per layer x 69 = 30,618,088,704", "112 experts/layer", "27,648 B/token"):
        assert figure in text
