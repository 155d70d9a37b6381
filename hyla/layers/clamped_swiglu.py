"""SwiGLU with clamped pre-activations (GLM-5-Next's `swiglu_limit`), dense and routed.

    gate = min(x W_g^T, limit);  up = clamp(x W_u^T, -limit, limit);  y = down(silu(gate) * up)

The clamp keeps rare huge activations from dominating; transformers applies it in the shared
expert, the dense first layers and every routed expert. The routed experts run hyla.ops.moe's
experts with the clamped activation (hyla.ops.gated_act): the fused-MoE kernel's epilogue on
CUDA, the sorted grouped GEMMs elsewhere (on the device, no host sync).
"""

from __future__ import annotations

import torch

from hyla.layers.mlp import MLP
from hyla.ops.gated_act import SILU, GatedActivation
from hyla.ops.moe import moe_experts


def clamped_silu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); limit None: plain SwiGLU."""
    return _activation(limit)(gate, up)


def _activation(limit: float | None) -> GatedActivation:
    return SILU if limit is None else GatedActivation("clamped_silu", limit=limit)


class ClampedMLP(MLP):
    """x: [..., hidden] -> [..., hidden]; tensor names gate_proj, up_proj, down_proj. MLP's
    `fp8_output` does nothing here: the clamped activation has no kernel that writes FP8."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None):
        super().__init__(hidden_size, intermediate_size)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_silu_mul(*self.gate_up(x), self.limit))


def clamped_moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, limit: float | None) -> torch.Tensor:
    """x: [M, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; weights [M, k] fp32;
    ids [M, k] int64 -> [M, H] in x.dtype: sum_j weights[m, j] * expert_{ids[m, j]}(x[m]), each
    expert a clamped SwiGLU. The k contributions are summed in slot order (deterministic)."""
    return moe_experts(x, w13, w2, weights, ids, _activation(limit))
