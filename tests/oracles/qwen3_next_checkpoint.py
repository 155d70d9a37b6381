"""Tiny random Qwen3-Next checkpoints written by transformers' `save_pretrained` (test oracle).

    path = build_qwen3_next_checkpoint(tmp_path, variant="moe")   # config.json + model.safetensors
    ref = load_qwen3_next_reference(path)                          # transformers Qwen3NextForCausalLM

Variants (all: hidden 64, 4 layers, vocab 256, fp32):
    moe     layer types from full_attention_interval 4 (3 GDN + 1 attention); GDN with grouped
            value heads (2 key heads of dim 16, 4 value heads of dim 24); attention 4 heads over
            2 KV heads, head dim 32, rotary 8 of 32 (partial_rotary_factor 0.25); layer 0 dense
            (mlp_only_layers), MoE after (16 experts, top-4, shared expert of their width 32)
    dense   every MLP dense (mlp_only_layers = all), attention at layers 1 and 3
            (full_attention_interval 2); 2 key / 2 value heads of dim 16 / 32; attention 2 heads
            over 1 KV head, head dim 16, rotary 8 of 16, q/k/v/o biases; tied embeddings
Gate and norm parameters are randomised away from their init (A_log, dt_bias, every norm
weight), and weights use std 0.1 so that logits are O(1).

`with_tokenizer=True` also writes the small word-level tokenizer of kimi_checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.oracles.kimi_checkpoint import write_tokenizer

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, rms_norm_eps=1e-6,
    initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=4096,
)

VARIANTS = {
    "moe": dict(
        full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_conv_kernel_dim=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
    ),
    "dense": dict(
        full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=500.0, partial_rotary_factor=0.5),
        attention_bias=True, num_experts=4, mlp_only_layers=[0, 1, 2, 3], tie_word_embeddings=True,
    ),
}


def _randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Move gate / norm parameters away from their init so a wrong formula shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.5, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) - 1.0)
            elif name.endswith("linear_attn.norm.weight"):  # stored as is (init 1)
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):  # zero-centred (init 0)
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def qwen3_next_config(variant: str):
    from transformers import Qwen3NextConfig

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {sorted(VARIANTS)}")
    return Qwen3NextConfig(**TINY, **VARIANTS[variant])


def build_qwen3_next_checkpoint(root, variant: str = "moe", seed: int = 0, with_tokenizer: bool = False) -> Path:
    """Write a tiny random checkpoint under `root`/qwen3next-<variant>-<seed> and return its path
    (reused if it already exists)."""
    from transformers import Qwen3NextForCausalLM

    path = Path(root) / f"qwen3next-{variant}-{seed}"
    if not (path / "config.json").is_file():
        torch.manual_seed(seed)
        model = Qwen3NextForCausalLM(qwen3_next_config(variant)).eval()
        _randomise(model, torch.Generator().manual_seed(seed + 1))
        model.save_pretrained(path)
    if with_tokenizer and not (path / "tokenizer.json").is_file():
        write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def qwen3_next_checkpoint(tmp_path_factory):
    """Factory fixture: qwen3_next_checkpoint(variant="moe", seed=0, with_tokenizer=False) -> path,
    built once per session."""
    root = tmp_path_factory.mktemp("qwen3next")

    def make(variant: str = "moe", seed: int = 0, with_tokenizer: bool = False) -> Path:
        return build_qwen3_next_checkpoint(root, variant, seed, with_tokenizer)

    return make


def load_qwen3_next_reference(path):
    """transformers' model for a checkpoint built here, fp32."""
    from transformers import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
