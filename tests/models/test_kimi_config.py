"""Config parsing (released checkpoint keys and transformers' keys), validation, memory report."""

import copy

import pytest
import torch

from hyla.models import KimiLinearConfig, memory_report
from hyla.models.memory import parameter_counts

# The released moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (sizes and schedules).
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "bfloat16",
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "num_expert_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.446, "use_grouped_topk": True, "bos_token_id": 163584, "eos_token_id": 163586,
    "pad_token_id": 163839,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
    },
}


def test_released_config_schedule():
    c = KimiLinearConfig.from_hf_dict(KIMI_LINEAR_48B)
    assert len(c.kda_layers) == 20 and c.mla_layers == [3, 7, 11, 15, 19, 23, 26]
    assert c.mlp_layer_types == ["dense"] + ["sparse"] * 26
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (256, 8, 1)
    assert c.gate_lower_bound is None and not c.use_full_rank_gate


def test_memory_report_for_released_config():
    c = KimiLinearConfig.from_hf_dict(KIMI_LINEAR_48B)
    r = memory_report(c, torch.bfloat16, torch.float32)
    assert r.recurrent_state_bytes_per_request == 20 * 32 * 128 * 128 * 4
    assert r.conv_state_bytes_per_request == 20 * 3 * 4096 * 3 * 2
    assert r.kv_bytes_per_token == 7 * (512 + 64) * 2
    assert 48e9 < r.num_parameters < 50e9  # "48B-A3B"
    text = str(r)
    assert "20 KDA + 7 MLA" in text and "KV / token" in text


def test_parameter_count_matches_a_built_model(kimi_checkpoint):
    from hyla.models import load_model

    for variant in ("dense", "moe", "full_rank_gate"):
        model = load_model(kimi_checkpoint(variant))
        main, fp32 = parameter_counts(model.config)
        assert main + fp32 == sum(t.numel() for t in model.state_dict().values())
        assert model.memory_report().weight_bytes == model.weight_bytes() == 4 * (main + fp32)


def test_transformers_spelling_and_defaults():
    d = {"model_type": "kimi_linear", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 9,
         "num_local_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "n_shared_experts": 0,
         "norm_topk_prob": False, "linear_num_heads": 2, "linear_head_dim": 4}
    c = KimiLinearConfig.from_hf_dict(d)
    assert c.layer_types[4] == c.layer_types[8] == "full_attention" and c.layer_types.count("full_attention") == 2
    assert c.mlp_layer_types[0] == "dense" and c.mlp_layer_types[1] == "sparse"
    assert (c.num_experts, c.num_experts_per_token, c.num_expert_group, c.num_shared_experts) == (4, 2, 2, 0)
    assert c.moe_renormalize is False and (c.linear_num_heads, c.linear_head_dim) == (2, 4)


def test_variants_from_linear_attn_config():
    d = copy.deepcopy(KIMI_LINEAR_48B)
    d["linear_attn_config"].update(gate_lower_bound=-5, use_full_rank_gate=True)
    c = KimiLinearConfig.from_hf_dict(d)
    assert c.gate_lower_bound == -5.0 and c.use_full_rank_gate
    d["linear_attn_config"] = {**KIMI_LINEAR_48B["linear_attn_config"], "safe_gate": True}
    assert KimiLinearConfig.from_hf_dict(d).gate_lower_bound == -5.0


def _edit(**changes):
    d = copy.deepcopy(KIMI_LINEAR_48B)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


@pytest.mark.parametrize("changes,match", [
    (dict(model_type="llama"), "unknown model_type 'llama'"),
    (dict(num_experts_per_token=300), "num_experts_per_token"),
    (dict(num_expert_group=3), "divisible"),
    (dict(topk_group=2), "topk_group"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
    (dict(vocab_size=None), "vocab_size"),
    (dict(mla_use_nope=False), "mla_use_nope"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mla_use_output_gate=True), "mla_use_output_gate"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (dict(layer_types=["linear_attention"] * 27), "disagrees"),
    (dict(mlp_layer_types=["dense"] * 3), "mlp_layer_types"),
    (dict(linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [28]}), "1-based"),
    (dict(linear_attn_config={"kda_layers": [1], "full_attn_layers": [2]}), "neither"),
    (dict(linear_attn_config={**KIMI_LINEAR_48B["linear_attn_config"], "gate_lower_bound": 1.0}), "gate_lower_bound"),
])
def test_clear_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        KimiLinearConfig.from_hf_dict(_edit(**changes))
