"""The memory report asks each family's config (layer_sizes, parameter_counts): no family branch."""

from dataclasses import dataclass

import torch

from hyla.models import KimiLinearConfig, Qwen3NextConfig, memory_report
from hyla.models.config import FULL, LINEAR, LayerSizes
from hyla.models.memory import kv_bytes_per_token, state_bytes_per_slot
from tests.models.test_kimi_config import KIMI_LINEAR_48B
from tests.models.test_qwen3_next_config import QWEN3_NEXT_80B


def test_both_families_answer_layer_sizes():
    kimi = KimiLinearConfig.from_hf_dict(KIMI_LINEAR_48B).layer_sizes()
    assert kimi == LayerSizes(linear_kind="KDA", attention_kind="MLA", state_per_slot=32 * 128 * 128,
                              conv_per_slot=3 * 32 * 128 * 3, kv_per_token=512 + 64, kv_contents="MLA latents",
                              kv_scales_per_token=2)  # FP8 pages: a scale for c and one for k_pe
    qwen = Qwen3NextConfig.from_hf_dict(QWEN3_NEXT_80B).layer_sizes()
    assert qwen == LayerSizes(linear_kind="GDN", attention_kind="GQA", state_per_slot=32 * 128 * 128,
                              conv_per_slot=(2 * 16 * 128 + 32 * 128) * 3, kv_per_token=2 * 2 * 256,
                              kv_contents="keys + values", kv_scales_per_token=2 * 2)  # per KV head, k and v


def test_report_is_layer_counts_times_layer_sizes():
    for config in (KimiLinearConfig.from_hf_dict(KIMI_LINEAR_48B), Qwen3NextConfig.from_hf_dict(QWEN3_NEXT_80B)):
        sizes = config.layer_sizes()
        n_lin, n_att = config.layer_types.count(LINEAR), config.layer_types.count(FULL)
        r = memory_report(config, torch.bfloat16, torch.float32)
        assert (r.num_linear_layers, r.num_attention_layers) == (n_lin, n_att)
        assert r.recurrent_state_bytes_per_request == n_lin * sizes.state_per_slot * 4
        assert r.conv_state_bytes_per_request == n_lin * sizes.conv_per_slot * 2
        assert r.kv_bytes_per_token == kv_bytes_per_token(config) == n_att * sizes.kv_per_token * 2
        fp8 = memory_report(config, torch.bfloat16, torch.float32, kv_cache_dtype="fp8")
        assert fp8.kv_bytes_per_token == kv_bytes_per_token(config, torch.bfloat16, "fp8_e4m3") \
            == n_att * (sizes.kv_per_token + 4 * sizes.kv_scales_per_token)
        assert "fp8 e4m3 + fp32 scales" in str(fp8) and "fp8" not in str(r)
        assert r.state_bytes_per_request == state_bytes_per_slot(config, torch.float32, torch.bfloat16)
        assert r.num_parameters == sum(config.parameter_counts())
        assert f"{n_lin} {sizes.linear_kind} + {n_att} {sizes.attention_kind}" in str(r)
        assert sizes.kv_contents in str(r)


@dataclass
class _NewFamilyConfig:
    """A family memory.py has never heard of: only the hooks."""

    layer_types: tuple = (LINEAR, LINEAR, FULL)

    def layer_sizes(self) -> LayerSizes:
        return LayerSizes(linear_kind="Mamba2", attention_kind="SWA", state_per_slot=10, conv_per_slot=3,
                          kv_per_token=7, kv_contents="window keys + values")

    def parameter_counts(self) -> tuple[int, int]:
        return 1000, 10


def test_a_new_family_needs_no_change_to_the_report():
    r = memory_report(_NewFamilyConfig(), torch.bfloat16, torch.float32)
    assert (r.recurrent_state_bytes_per_request, r.conv_state_bytes_per_request, r.kv_bytes_per_token) == (80, 12, 14)
    assert r.weight_bytes == 1000 * 2 + 10 * 4 and r.num_parameters == 1010
    assert "2 Mamba2 + 1 SWA" in str(r) and "window keys + values" in str(r)
