"""SiTU, the gated activation of Kimi K3's MLPs and experts, dense and routed.

    act(g, u) = beta tanh(g / beta) sigmoid(g) * beta_l tanh(u / beta_l)     (beta 4, beta_l 25 in K3)

A bounded SiLU-like gate times a soft-clipped up projection, computed in fp32 (fp64 stays fp64)
and rounded once to the input dtype. hyla's fused-MoE kernels know only SwiGLU, so the routed
experts run the sorted grouped GEMMs of hyla.ops.moe with SiTU between them (on the device,
no host sync), as hyla.layers.clamped_swiglu does for GLM-5-Next.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.mlp import MLP
from hyla.layers.moe import StackedExperts
from hyla.ops.moe import _check, _grouped, sort_pairs_by_expert
from hyla.ops.utils import work_dtype


def situ_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """gate, up: [..., I] -> [..., I] in gate.dtype. linear_beta None: up is not clipped."""
    work = work_dtype(gate)
    g, u = gate.to(work), up.to(work)
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (act * u).to(gate.dtype)


class SituMLP(MLP):
    """x: [..., hidden] -> [..., hidden]; tensor names gate_proj, up_proj, down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, beta: float, linear_beta: float | None):
        super().__init__(hidden_size, intermediate_size)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_mul(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


def situ_moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """x: [M, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; weights [M, k] fp32;
    ids [M, k] int64 -> [M, H] in x.dtype: sum_j weights[m, j] * expert_{ids[m, j]}(x[m]), each
    expert a SiTU MLP; the k contributions summed in slot order (deterministic)."""
    _check(x, w13, w2, weights, ids)
    M, k = ids.shape
    I = w13.shape[1] // 2
    order, ends = sort_pairs_by_expert(ids, w13.shape[0])
    ids_sorted = ids.reshape(-1)[order]
    gu = _grouped(x[order // k], w13, ends, ids_sorted)  # [P, 2I], pairs sorted by expert
    y = _grouped(situ_mul(gu[:, :I], gu[:, I:], beta, linear_beta), w2, ends, ids_sorted)  # [P, H]
    work = work_dtype(x)
    unsorted = torch.empty_like(y, dtype=work).index_copy_(0, order, y.to(work))
    return (unsorted.view(M, k, -1) * weights.to(work)[:, :, None]).sum(1).to(x.dtype)


class SituExperts(StackedExperts):
    """StackedExperts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) whose experts are SiTU MLPs.
    forward(x [M, H], weights [M, k], ids [M, k]) -> [M, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, beta: float,
                 linear_beta: float | None):
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.beta, self.linear_beta = beta, linear_beta

    def stack_shared(self, shared: nn.Module) -> bool:
        return False  # K3's shared experts are wider than a routed one and see the full hidden state

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: bool = False) -> torch.Tensor:
        return situ_moe_experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.beta, self.linear_beta)
