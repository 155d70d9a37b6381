"""SiTU, the gated activation of Kimi K3's MLPs and experts, dense and routed.

    act(g, u) = beta tanh(g / beta) sigmoid(g) * beta_l tanh(u / beta_l)     (beta 4, beta_l 25 in K3)

A bounded SiLU-like gate times a soft-clipped up projection, computed in fp32 (fp64 stays fp64)
and rounded once to the input dtype (hyla.ops.gated_act). The routed experts run hyla.ops.moe's
experts with SiTU as their activation: the fused-MoE kernel's epilogue on CUDA, the sorted
grouped GEMMs elsewhere (on the device, no host sync).
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.mlp import MLP
from hyla.layers.moe import StackedExperts
from hyla.ops.gated_act import GatedActivation
from hyla.ops.moe import moe_experts


def situ_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """gate, up: [..., I] -> [..., I] in gate.dtype. linear_beta None: up is not clipped."""
    return GatedActivation("situ", beta=beta, linear_beta=linear_beta)(gate, up)


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
    return moe_experts(x, w13, w2, weights, ids, GatedActivation("situ", beta=beta, linear_beta=linear_beta))


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
