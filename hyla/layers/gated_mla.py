"""NoPE MLA with an output gate (Kimi K3's `mla_use_output_gate`):

    y = o_proj(attn(x) * sigmoid(g_proj(x)))        g_proj: [num_heads * v_head_dim, hidden]

Everything else, the paged latent cache included, is hyla.layers.mla.MLAAttention; the gate is
per token and per output channel, so it applies unchanged to full sequences and engine steps.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.mla import MLAAttention


class GatedMLAAttention(MLAAttention):
    """MLAAttention (same arguments) plus g_proj; x: [..., hidden] -> [..., hidden]."""

    def __init__(self, hidden_size: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, **kwargs):
        super().__init__(hidden_size, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
                         **kwargs)
        self.g_proj = nn.Linear(hidden_size, num_heads * v_head_dim, bias=False)

    output_reads_input = True  # the gate reads x (MLAAttention.step_pre carries it)

    def output(self, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn * torch.sigmoid(self.g_proj(x)))
