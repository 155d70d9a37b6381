"""What every simulated cache pays: bytes per KV token, bytes per state checkpoint, prefill FLOPs.

All figures come from one reference model, Kimi-Linear-48B-A3B (the released config.json,
TP = 1, weights / KV / conv windows in bf16, recurrent states in fp32), through
`hyla.models.memory`; every policy is charged the same figures, so a policy that keeps more
checkpoints pays for them.

    KV per token      7 MLA layers x (512 + 64) x 2 B                      =      8,064 B
    state checkpoint  20 KDA layers x (32 x 128 x 128 x 4 B + 3 x 4096 x 3 x 2 B) = 43,417,600 B
                      (one checkpoint costs as much as 5,384 tokens of KV)

vLLM's attention block size comes from its page-unification rule (one state must fit in one
attention page of one layer, kernel block alignment 128 for MLA hybrids):

    block = 128 * cdiv(state bytes per KDA layer, 128 * KV bytes per token per MLA layer)
          = 128 * cdiv(2,170,880, 128 * 1,152) = 1,920 tokens
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hyla.models.config import SPARSE, KimiLinearConfig
from hyla.models.memory import memory_report, parameter_counts
from hyla.models.presets import KIMI_LINEAR_48B  # noqa: F401  (re-exported: the traces price this shape)

def vllm_block_size(kv_bytes_per_token_per_layer: int, state_bytes_per_layer: int, alignment: int = 128) -> int:
    """vLLM's hybrid attention block size (`_align_hybrid_block_size`): the smallest multiple of
    `alignment` tokens whose per-layer KV page holds one linear layer's state."""
    return alignment * math.ceil(state_bytes_per_layer / (alignment * kv_bytes_per_token_per_layer))


@dataclass(frozen=True)
class Costs:
    """kv_bytes_per_token, state_bytes: charged to every policy. linear_flops_per_token (2 x
    active parameters + the KDA state update) and attn_flops_per_pair (QK^T and AV per
    (query, key) pair over the MLA layers) price a prefill for Marconi's FLOP-aware eviction.
    vllm_block_size: vLLM's page-unified attention block."""

    name: str
    kv_bytes_per_token: int
    state_bytes: int
    linear_flops_per_token: float
    attn_flops_per_pair: float
    vllm_block_size: int

    def prefill_flops(self, n: int) -> float:
        """FLOPs to prefill n tokens from scratch (causal attention: n(n+1)/2 pairs)."""
        return n * self.linear_flops_per_token + self.attn_flops_per_pair * n * (n + 1) / 2

    def describe(self) -> list[str]:
        return [
            f"reference model  {self.name}",
            f"KV per token     {self.kv_bytes_per_token:,} B",
            f"state checkpoint {self.state_bytes:,} B "
            f"(= {self.state_bytes / self.kv_bytes_per_token:,.0f} tokens of KV)",
            f"vLLM block size  {self.vllm_block_size} tokens (page-unification rule)",
        ]


def _active_parameters(c: KimiLinearConfig) -> int:
    """Parameters one token multiplies through (routed experts counted top-k), embeddings excluded."""
    main, fp32 = parameter_counts(c)
    total = main + fp32 - c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    idle = c.num_experts - c.num_experts_per_token
    moe_layers = sum(1 for kind in c.mlp_layer_types if kind == SPARSE)
    return total - moe_layers * idle * 3 * c.hidden_size * c.moe_intermediate_size + c.vocab_size * c.hidden_size


def costs_for(config: KimiLinearConfig, name: str, state_dtype=torch.float32, dtype=torch.bfloat16) -> Costs:
    report = memory_report(config, dtype, state_dtype)
    n_lin, n_mla = report.num_kda_layers, report.num_mla_layers
    kda_update = 4 * config.linear_num_heads * config.linear_head_dim ** 2  # decay, predict, write, read
    mla_pair = 2 * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    return Costs(
        name=name,
        kv_bytes_per_token=report.kv_bytes_per_token,
        state_bytes=report.state_bytes_per_request,
        linear_flops_per_token=2.0 * _active_parameters(config) + n_lin * kda_update,
        attn_flops_per_pair=float(n_mla * mla_pair),
        vllm_block_size=vllm_block_size(report.kv_bytes_per_token // max(n_mla, 1),
                                        report.state_bytes_per_request // max(n_lin, 1)),
    )


def reference_costs() -> Costs:
    config = KimiLinearConfig.from_hf_dict(KIMI_LINEAR_48B)
    return costs_for(config, "Kimi-Linear-48B-A3B (TP=1, bf16 KV, fp32 states)")
