"""The oracle checkpoints are what the tests claim: official names, randomised gates, variants."""

import json

import pytest
from safetensors.torch import load_file

from tests.oracles.kimi_checkpoint import DERIVED, VARIANTS


@pytest.mark.parametrize("variant", sorted(VARIANTS) + sorted(DERIVED))
def test_variant_files(kimi_checkpoint, variant):
    path = kimi_checkpoint(variant)
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    assert config["model_type"] == "kimi_linear" and config["num_hidden_layers"] == 4
    assert config["hidden_size"] == 64 and config["vocab_size"] == 256
    assert "model.layers.0.self_attn.q_conv1d.weight" in tensors
    assert tensors["model.layers.0.self_attn.A_log"].ndim == 4
    # transformers' init puts dt_bias in [-6.9, -2.25] and norm weights at 1: randomised away from both
    assert tensors["model.layers.0.self_attn.dt_bias"].max() > -2.0
    assert (tensors["model.layers.0.self_attn.o_norm.weight"] != 1).all()
    full_rank = variant == "full_rank_gate"
    assert ("model.layers.0.self_attn.g_proj.weight" in tensors) == full_rank
    assert ("model.layers.0.self_attn.g_a_proj.weight" in tensors) != full_rank
    lower_bound = config["linear_attn_config"].get("gate_lower_bound")
    assert lower_bound == (-5.0 if variant == "safe_gate" else None)


def test_moe_variant_has_experts_and_two_mla_layers(kimi_checkpoint):
    path = kimi_checkpoint("moe")
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    assert config["linear_attn_config"]["full_attn_layers"] == [2, 4] and config["q_lora_rank"] == 24
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in tensors
    assert tensors["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].abs().sum() > 0
