"""Tiny random Qwen3.5 checkpoints written by transformers' `save_pretrained` (test oracle).

    path = build_qwen3_5_checkpoint(tmp_path, "moe", "multimodal")  # config.json + model.safetensors
    ref = load_qwen3_5_reference(path)                               # transformers, fp32

Variants (hidden 64, 4 layers, vocab 256, fp32):
    dense  layer_types linear / full / linear / full; GDN with grouped value heads (2 key heads of
           dim 16, 4 value heads of dim 24: value head j reads key head j // 2); attention 4 heads
           over 2 KV heads, head dim 32, rotary 8 of 32, mRoPE sections [2, 1, 1]; dense MLPs 96
    moe    full_attention_interval 4 (3 GDN + 1 attention); GDN 2 / 2 heads of dim 16 / 32;
           attention 2 heads over 1 KV head, head dim 16, rotary 8 of 16, q/k/v/o biases; every
           layer MoE (16 experts, top-4, shared expert of their width 32); tied embeddings
Layouts:
    text        Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (model_type qwen3_5_text / _moe_text)
    multimodal  Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration
                (qwen3_5 / qwen3_5_moe): the same text model under model.language_model, a
                one-block vision tower under model.visual; tie_word_embeddings on the outer config
Gate and norm parameters are randomised away from their init (A_log, dt_bias, every norm
weight, biases), and weights use std 0.1 so that logits are O(1).

`with_tokenizer=True` also writes the small word-level tokenizer of kimi_checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.oracles.kimi_checkpoint import write_tokenizer
from tests.oracles.qwen3_next_checkpoint import _randomise

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, rms_norm_eps=1e-6, initializer_range=0.1,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=4096, linear_conv_kernel_dim=4,
)

VARIANTS = {
    "dense": dict(
        layer_types=["linear_attention", "full_attention"] * 2, intermediate_size=96,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[2, 1, 1], mrope_interleaved=True),
        tie_word_embeddings=False,
    ),
    "moe": dict(
        full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, attention_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=500.0, partial_rotary_factor=0.5,
                             mrope_section=[2, 1, 1], mrope_interleaved=True),
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        tie_word_embeddings=True,
    ),
}
LAYOUTS = ("text", "multimodal")

_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
               num_position_embeddings=16, patch_size=4)


def _classes(variant: str, layout: str):
    """(transformers config class, model class) of a variant and layout."""
    import transformers as tf

    if variant not in VARIANTS or layout not in LAYOUTS:
        raise ValueError(f"unknown variant/layout {variant!r}/{layout!r}; choose from {sorted(VARIANTS)} x {LAYOUTS}")
    moe = variant == "moe"
    if layout == "text":
        return ((tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM) if moe
                else (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM))
    return ((tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration) if moe
            else (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration))


def qwen3_5_config(variant: str, layout: str = "text"):
    config_cls, _ = _classes(variant, layout)
    text = dict(TINY, **VARIANTS[variant])
    if layout == "text":
        return config_cls(**text)
    return config_cls(text_config=text, vision_config=_VISION, tie_word_embeddings=text["tie_word_embeddings"])


def build_qwen3_5_checkpoint(root, variant: str = "moe", layout: str = "text", seed: int = 0,
                             with_tokenizer: bool = False) -> Path:
    """Write a tiny random checkpoint under `root`/qwen3_5-<variant>-<layout>-<seed> and return its
    path (reused if it already exists)."""
    _, model_cls = _classes(variant, layout)
    path = Path(root) / f"qwen3_5-{variant}-{layout}-{seed}"
    if not (path / "config.json").is_file():
        torch.manual_seed(seed)
        model = model_cls(qwen3_5_config(variant, layout)).eval()
        _randomise(model, torch.Generator().manual_seed(seed + 1))
        model.save_pretrained(path)
    if with_tokenizer and not (path / "tokenizer.json").is_file():
        write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def qwen3_5_checkpoint(tmp_path_factory):
    """Factory fixture: qwen3_5_checkpoint(variant="moe", layout="text", seed=0, with_tokenizer=False)
    -> path, built once per session."""
    root = tmp_path_factory.mktemp("qwen3_5")

    def make(variant: str = "moe", layout: str = "text", seed: int = 0, with_tokenizer: bool = False) -> Path:
        return build_qwen3_5_checkpoint(root, variant, layout, seed, with_tokenizer)

    return make


def load_qwen3_5_reference(path):
    """transformers' model for a checkpoint built here (the class its config.json names), fp32."""
    import json

    import transformers

    arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()


def add_mtp_shard(path, seed: int = 7) -> dict[str, torch.Tensor]:
    """Give the checkpoint at `path` (Qwen3.5 or Qwen3-Next) a random one-layer `mtp.*` head in its
    own shard (model-mtp.safetensors, with an index), as released checkpoints store it; returns the
    tensors. The layer's names and shapes are transformers' own full-attention decoder layer's."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    layer_cls = _decoder_layer_class(config)
    idx = text.layer_types.index("full_attention")
    layer = layer_cls(text, idx)
    gen = torch.Generator().manual_seed(seed)
    hid = text.hidden_size
    tensors = {f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items()}
    tensors.update({"mtp.fc.weight": torch.empty(hid, 2 * hid), "mtp.norm.weight": torch.empty(hid),
                    "mtp.pre_fc_norm_embedding.weight": torch.empty(hid),
                    "mtp.pre_fc_norm_hidden.weight": torch.empty(hid)})
    for name, t in tensors.items():
        scale = 0.3 if name.endswith("norm.weight") else 0.1  # zero-centred norms: away from 0
        tensors[name] = (scale * torch.randn(t.shape, generator=gen)).contiguous()
    if "mtp.layers.0.mlp.experts.gate_up_proj" in tensors:  # stored per expert, as the released checkpoints
        for base in ("gate_up_proj", "down_proj"):
            fused = tensors.pop(f"mtp.layers.0.mlp.experts.{base}")
            for e in range(fused.shape[0]):
                if base == "down_proj":
                    tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = fused[e].contiguous()
                else:
                    g, u = fused[e].chunk(2, dim=0)
                    tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = g.contiguous()
                    tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = u.contiguous()
    save_file(tensors, path / "model-mtp.safetensors", metadata={"format": "pt"})
    names = load_file(path / "model.safetensors").keys()
    weight_map = {**{k: "model.safetensors" for k in names}, **{k: "model-mtp.safetensors" for k in tensors}}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def _decoder_layer_class(config):
    """transformers' decoder layer of a Qwen3.5 or Qwen3-Next config."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as dense
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as moe
    import transformers.models.qwen3_next.modeling_qwen3_next as next_

    if config.model_type == "qwen3_next":
        return next_.Qwen3NextDecoderLayer
    return moe.Qwen3_5MoeDecoderLayer if "moe" in config.model_type else dense.Qwen3_5DecoderLayer
