"""FP8 activations written by their producers (hyla.ops.fp8_activation), in whole models: the loader
marks the norms and MLP activations whose outputs feed block-FP8 weights
(hyla.models.fp8_loading.mark_fp8_producers), and on the Triton path (the interpreter here) a
forward then launches no activation quantiser at all in a KDA / GDN layer with a dense MLP or a MoE
(routed experts, an unstacked shared expert), and computes bit for bit the logits of the same model
with no producer marked.

The models: 2 layers (a linear-attention layer with a dense MLP, then one with a MoE whose shared
expert is wider than the routed ones, so it runs on its own after them: the post-attention norm's
output has three FP8 consumers), hidden 256, head dims 128 (whole 128-column groups everywhere),
random weights (load_format "dummy") in bf16, block-FP8 as the config's quantization_config says;
Kimi's low-rank gate up-projections f_b_proj / g_b_proj stay bf16 (their input is a column slice of
the packed projection, which no producer writes; the fused gate kernels read them).
"""

import json

import pytest
import torch

from hyla.models import load_model
from tests.models.test_fp8 import GOOD
from tests.ops.helpers import use_backend
from tests.ops.test_fp8_activation import quantiser_calls  # noqa: F401 (fixture)
from tests.ops.triton_env import triton_module

IDS = torch.tensor([[1, 17]])


def _kimi_config():
    from transformers import KimiLinearConfig

    from tests.oracles.kimi_checkpoint import TINY, VARIANTS

    return KimiLinearConfig(**{**TINY, **VARIANTS["moe"], **dict(
        hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=2,
        linear_attn_config=dict(head_dim=128, num_heads=1, short_conv_kernel_size=4, kda_layers=[1, 2],
                                full_attn_layers=[]))})


def _qwen3_next_config():
    from transformers import Qwen3NextConfig

    from tests.oracles.qwen3_next_checkpoint import TINY, VARIANTS

    return Qwen3NextConfig(**{**TINY, **VARIANTS["moe"], **dict(
        hidden_size=256, intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=256,
        num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, linear_key_head_dim=64,
        linear_value_head_dim=128, linear_num_value_heads=2)})


# family -> (config, modules_to_not_convert, the producers marked, quantiser launches left unmarked)
FAMILIES = {
    "kimi": (_kimi_config, ["lm_head", "f_b_proj", "g_b_proj"], {
        "model.layers.0.input_layernorm", "model.layers.0.self_attn.o_norm", "model.layers.0.post_attention_layernorm",
        "model.layers.0.mlp", "model.layers.1.input_layernorm", "model.layers.1.self_attn.o_norm",
        "model.layers.1.post_attention_layernorm", "model.layers.1.block_sparse_moe.shared_experts"}, 9),
    "qwen3_next": (_qwen3_next_config, ["lm_head"], {
        "model.layers.0.input_layernorm", "model.layers.0.linear_attn.norm", "model.layers.0.post_attention_layernorm",
        "model.layers.0.mlp", "model.layers.1.input_layernorm", "model.layers.1.linear_attn.norm",
        "model.layers.1.post_attention_layernorm", "model.layers.1.mlp.shared_expert"}, 10),
}


@pytest.fixture(scope="module")
def fp8_config_dir(tmp_path_factory):
    """family -> a directory with the family's config.json (quantization_config: block FP8)."""
    def make(family: str):
        path = tmp_path_factory.mktemp(family)
        config, skip, _, _ = FAMILIES[family]
        config().save_pretrained(path)
        data = json.loads((path / "config.json").read_text())
        data["quantization_config"] = dict(GOOD, modules_to_not_convert=skip)
        (path / "config.json").write_text(json.dumps(data))
        return path

    return make


def unmark(model) -> None:
    """Every producer back to writing its output alone (as a model with no FP8 weights)."""
    for m in model.modules():
        if hasattr(m, "fp8_output"):
            m.fp8_output = False


@pytest.mark.parametrize("family", ["kimi", "qwen3_next"])
def test_marked_producers_replace_every_quantiser_launch(fp8_config_dir, family, monkeypatch, quantiser_calls):
    """Every FP8 GEMM and fused MoE input of these layers comes from a marked producer: no
    quantiser launch; unmarked, one per FP8 input (the routed experts and the shared expert's
    gate/up each quantise the same tensor). Bit for bit the same logits either way."""
    gemm, _ = triton_module("fp8_gemm")
    _, _, marked, unmarked_launches = FAMILIES[family]
    model = load_model(fp8_config_dir(family), random_weights=True, fp8_weights="fp8", dtype=torch.bfloat16)
    assert {n for n, m in model.named_modules() if getattr(m, "fp8_output", False)} == marked
    use_backend(monkeypatch, "triton")
    # 128-column GEMM tiles: the interpreter runs one program at a time, and the default tiles for
    # a few rows (16 columns) made the GEMMs most of this test's time; tiles change no bit here
    monkeypatch.setattr(gemm, "gemm_config", lambda M, N: dict(BM=16, BN=128, GM=1, num_warps=4, num_stages=1))
    with torch.no_grad():
        got = model(IDS)
        assert quantiser_calls == []
        unmark(model)
        want = model(IDS)
    assert len(quantiser_calls) == unmarked_launches, quantiser_calls
    assert torch.equal(got, want)


def test_models_without_fp8_weights_mark_nothing(fp8_config_dir):
    path = fp8_config_dir("kimi")
    model = load_model(path, random_weights=True, fp8_weights="dequantized")
    assert not any(getattr(m, "fp8_output", False) for m in model.modules())
