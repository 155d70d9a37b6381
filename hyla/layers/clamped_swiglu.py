"""SwiGLU with clamped pre-activations (GLM-5-Next's `swiglu_limit`), dense and routed.

    gate = min(x W_g^T, limit);  up = clamp(x W_u^T, -limit, limit);  y = down(silu(gate) * up)

The clamp keeps rare huge activations from dominating; transformers applies it in the shared
expert, the dense first layers and every routed expert. hyla's fused-MoE kernels have no clamp,
so the routed experts here run the sorted grouped GEMMs of hyla.ops.moe with the clamp between
them (on the device, no host sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyla.layers.mlp import MLP
from hyla.ops.moe import _check, _grouped, sort_pairs_by_expert
from hyla.ops.utils import work_dtype


def clamped_silu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); limit None: plain SwiGLU."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


class ClampedMLP(MLP):
    """x: [..., hidden] -> [..., hidden]; tensor names gate_proj, up_proj, down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None):
        super().__init__(hidden_size, intermediate_size)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_silu_mul(self.gate_proj(x), self.up_proj(x), self.limit))


def clamped_moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, limit: float | None) -> torch.Tensor:
    """x: [M, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; weights [M, k] fp32;
    ids [M, k] int64 -> [M, H] in x.dtype: sum_j weights[m, j] * expert_{ids[m, j]}(x[m]), each
    expert a clamped SwiGLU. The k contributions are summed in slot order (deterministic)."""
    _check(x, w13, w2, weights, ids)
    M, k = ids.shape
    I = w13.shape[1] // 2
    order, ends = sort_pairs_by_expert(ids, w13.shape[0])
    ids_sorted = ids.reshape(-1)[order]
    xs = x[order // k]  # [P, H] the token of each sorted pair
    gu = _grouped(xs, w13, ends, ids_sorted)  # [P, 2I]
    h = clamped_silu_mul(gu[:, :I], gu[:, I:], limit)
    y = _grouped(h, w2, ends, ids_sorted)  # [P, H]
    work = work_dtype(x)
    unsorted = torch.empty_like(y, dtype=work).index_copy_(0, order, y.to(work))
    return (unsorted.view(M, k, -1) * weights.to(work)[:, :, None]).sum(1).to(x.dtype)
