"""RMSNorm as the Kimi-Linear checkpoints define it (T5 style).

The normalisation runs in fp32 and is rounded back to the input dtype *before* the weight
multiply, exactly as transformers' KimiLinearRMSNorm (hyla.ops.rms_norm multiplies the weight in
fp32 and rounds once; the two agree in fp32 and differ by one bf16 rounding otherwise, so the
model uses this one to stay equal to the reference).
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.ops.norm import gated_rms_norm


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)).  x: [..., D] -> [..., D] (dtype of x times weight)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype == torch.float64 else x.float()  # fp64 stays fp64 for exactness tests
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """Head-wise output norm of KDA: rms_norm(o) * weight * sigmoid(gate), all in fp32, rounded once.

    o, gate: [..., K] (K = head dim; one weight [K] shared by every head) -> [..., K] in o.dtype.
    Same order of operations as transformers' KimiLinearRMSNormGated.
    """

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "sigmoid"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, eps=self.eps, activation=self.activation)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, activation={self.activation}"
