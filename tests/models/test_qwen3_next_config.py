"""Qwen3-Next config.json parsing, the loader's dispatch and errors, and the memory report."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyla.models import KimiLinearConfig, Qwen3NextConfig, load_config, load_model, memory_report
from hyla.models.memory import parameter_counts

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (the keys that matter; written by transformers 4.57).
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "torch_dtype": "bfloat16",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "decoder_sparse_step": 1, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_released_config_and_memory_report():
    c = Qwen3NextConfig.from_hf_dict(QWEN3_NEXT_80B)
    assert c.attention_layers == list(range(3, 48, 4)) and len(c.linear_layers) == 36
    assert c.mlp_layer_types == ["sparse"] * 48
    assert (c.rope_theta, c.partial_rotary_factor, c.rotary_dim) == (10000000, 0.25, 64)
    assert c.conv_dim == 2 * 16 * 128 + 32 * 128 and c.dtype == "bfloat16"
    r = memory_report(c, torch.bfloat16, torch.float32)
    assert r.recurrent_state_bytes_per_request == 36 * 32 * 128 * 128 * 4
    assert r.conv_state_bytes_per_request == 36 * 8192 * 3 * 2
    assert r.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2
    assert "36 GDN + 12 GQA" in str(r)


def test_parameter_count_equals_transformers_model_on_meta():
    from transformers import Qwen3NextConfig as HFConfig
    from transformers import Qwen3NextForCausalLM

    skip = ("architectures", "model_type", "torch_dtype", "use_sliding_window")
    with torch.device("meta"):
        ref = Qwen3NextForCausalLM(HFConfig(**{k: v for k, v in QWEN3_NEXT_80B.items() if k not in skip}))
    want = sum(t.numel() for t in ref.state_dict().values())
    main, fp32 = parameter_counts(Qwen3NextConfig.from_hf_dict(QWEN3_NEXT_80B))
    assert main + fp32 == want and 79e9 < want < 81e9  # "80B-A3B"


@pytest.mark.parametrize("variant", ["moe", "dense"])
def test_parameter_count_and_weight_bytes_of_a_built_model(qwen3_next_checkpoint, variant):
    model = load_model(qwen3_next_checkpoint(variant))
    main, fp32 = parameter_counts(model.config)
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}  # tied once
    assert main + fp32 == sum(t.numel() for t in unique.values())
    assert model.memory_report().weight_bytes == model.weight_bytes() == 4 * (main + fp32)
    bf16 = load_model(qwen3_next_checkpoint(variant), dtype="bfloat16")
    assert bf16.weight_bytes() == 2 * main + 4 * fp32  # router, A_log, dt_bias stay fp32
    assert bf16.model.layers[0].linear_attn.A_log.dtype == torch.float32


def test_layer_schedules_and_rope_spellings():
    base = dict(QWEN3_NEXT_80B, num_hidden_layers=6, full_attention_interval=3, mlp_only_layers=[0, 4],
                decoder_sparse_step=2, rope_theta=None, partial_rotary_factor=None,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5})
    c = Qwen3NextConfig.from_hf_dict(base)
    assert c.layer_types == ["linear_attention", "linear_attention", "full_attention"] * 2
    assert c.mlp_layer_types == ["dense", "sparse", "dense", "sparse", "dense", "sparse"]
    assert (c.rope_theta, c.rotary_dim) == (500.0, 128)
    explicit = Qwen3NextConfig.from_hf_dict(dict(base, layer_types=["full_attention"] * 6))
    assert explicit.attention_layers == list(range(6))
    dense = Qwen3NextConfig.from_hf_dict(dict(base, num_experts=0))
    assert dense.mlp_layer_types == ["dense"] * 6
    defaults = {k: v for k, v in QWEN3_NEXT_80B.items() if k not in ("rope_theta", "partial_rotary_factor")}
    assert Qwen3NextConfig.from_hf_dict(defaults).rope_theta == 10000.0  # transformers' defaults
    assert Qwen3NextConfig.from_hf_dict(defaults).partial_rotary_factor == 0.25


@pytest.mark.parametrize("changes,match", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (dict(linear_num_value_heads=24), "multiple"),
    (dict(num_key_value_heads=3), "multiple"),
    (dict(num_experts_per_tok=600), "num_experts_per_tok"),
    (dict(layer_types=["full_attention"] * 3), "layer_types"),
    (dict(layer_types=["mamba"] * 48), "unknown kinds"),
    (dict(partial_rotary_factor=0.0), "partial_rotary_factor"),
    (dict(head_dim=6, partial_rotary_factor=0.5), "even"),
    (dict(full_attention_interval=0), "full_attention_interval"),
    (dict(vocab_size=None), "vocab_size"),
    (dict(hidden_size=0), "hidden_size"),
])
def test_clear_errors(changes, match):
    d = dict(QWEN3_NEXT_80B)
    for k, v in changes.items():
        if v is None:
            d.pop(k)
        else:
            d[k] = v
    with pytest.raises(ValueError, match=match):
        Qwen3NextConfig.from_hf_dict(d)


def test_load_config_dispatches_on_model_type(qwen3_next_checkpoint, kimi_checkpoint, tmp_path):
    assert isinstance(load_config(qwen3_next_checkpoint("dense")), Qwen3NextConfig)
    assert isinstance(load_config(kimi_checkpoint("dense")), KimiLinearConfig)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"unknown model_type 'llama'; hyla supports \[.*'kimi_linear'.*'qwen3_next'.*\]"):
        load_config(tmp_path)


def _copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = edit(load_file(dst / "model.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_mtp_tensors_are_skipped(qwen3_next_checkpoint, tmp_path):
    """The released checkpoints carry a multi-token-prediction head; like transformers, hyla
    loads the rest and ignores it."""
    src = qwen3_next_checkpoint("dense")
    dst = _copy(src, tmp_path / "mtp", lambda t: {**t, "mtp.fc.weight": torch.randn(64, 128),
                                                 "mtp.layers.0.input_layernorm.weight": torch.randn(64)})
    ids = torch.arange(12)[None] * 7 % 256
    with torch.no_grad():
        assert torch.equal(load_model(dst)(ids), load_model(src)(ids))


@pytest.mark.parametrize("edit,match", [
    (lambda t: {k: v for k, v in t.items() if k != "model.layers.1.linear_attn.dt_bias"},
     r"missing tensors.*model\.layers\.1\.linear_attn\.dt_bias"),
    (lambda t: {**t, "model.layers.0.linear_attn.bogus": torch.zeros(2)},
     r"unexpected tensors.*model\.layers\.0\.linear_attn\.bogus"),
    (lambda t: {**t, "model.layers.0.linear_attn.conv1d.weight": torch.zeros(96, 1, 4)},
     r"shape mismatch for model\.layers\.0\.linear_attn\.conv1d\.weight: checkpoint \[96, 1, 4\], "
     r"model expects \[160, 1, 4\]"),
])
def test_tensor_errors_name_the_tensor(qwen3_next_checkpoint, tmp_path, edit, match):
    dst = _copy(qwen3_next_checkpoint("moe"), tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=match):
        load_model(dst)
