"""The gated activations of SwiGLU-style MLPs and experts: act(gate, up) -> h, one spec for every
implementation (torch here, the fused-MoE kernel's epilogue in hyla.ops.triton.fused_moe).

    silu           silu(g) * u                                              (Kimi, Qwen)
    clamped_silu   silu(min(g, limit)) * clamp(u, -limit, limit)            (GLM-5-Next's swiglu_limit)
    situ           beta tanh(g / beta) sigmoid(g) * lbeta tanh(u / lbeta)   (Kimi K3; lbeta None: * u)

The torch versions keep each family's reference arithmetic: silu and clamped_silu in the input
dtype (as transformers computes them), situ in fp32 (fp64 stays fp64) rounded once to the input
dtype. The kernel epilogue computes all three in fp32 and rounds once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyla.ops.utils import work_dtype

KINDS = ("silu", "clamped_silu", "situ")


@dataclass(frozen=True)
class GatedActivation:
    kind: str = "silu"
    limit: float | None = None  # clamped_silu
    beta: float | None = None  # situ: the gate's tanh scale
    linear_beta: float | None = None  # situ: the up projection's tanh scale (None: not clipped)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown gated activation {self.kind!r}; use one of {KINDS}")
        if self.kind == "clamped_silu" and not (self.limit is not None and self.limit > 0):
            raise ValueError(f"clamped_silu needs a positive limit, got {self.limit!r}")
        if self.kind == "situ" and not (self.beta is not None and self.beta > 0):
            raise ValueError(f"situ needs a positive beta, got {self.beta!r}")
        if self.linear_beta is not None and not self.linear_beta > 0:
            raise ValueError(f"linear_beta must be positive, got {self.linear_beta!r}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up: [..., I] -> [..., I] in gate.dtype."""
        if self.kind == "silu":
            return F.silu(gate) * up
        if self.kind == "clamped_silu":
            return F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)
        work = work_dtype(gate)
        g, u = gate.to(work), up.to(work)
        act = self.beta * torch.tanh(g / self.beta) * torch.sigmoid(g)
        if self.linear_beta is not None:
            u = self.linear_beta * torch.tanh(u / self.linear_beta)
        return (act * u).to(gate.dtype)


SILU = GatedActivation()
