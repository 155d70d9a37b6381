"""RMSNorms as the checkpoints define them: Kimi-Linear's (T5 style, RMSNorm / GatedRMSNorm) and
Qwen3-Next's (zero-centred weight, ZeroCentredRMSNorm; SiLU-gated output norm, SiLUGatedRMSNorm).

Kimi's normalisation runs in fp32 and is rounded back to the input dtype *before* the weight
multiply, exactly as transformers' KimiLinearRMSNorm (hyla.ops.rms_norm multiplies the weight in
fp32 and rounds once; the two agree in fp32 and differ by one bf16 rounding otherwise, so the
model uses this one to stay equal to the reference).

Each module computes through hyla.ops.dispatch: one fused Triton launch on CUDA without grad
(hyla.ops.triton.norm), the torch reference of hyla.ops.norm otherwise (the same ops as
transformers, bit-equal to it). RMSNorm / ZeroCentredRMSNorm also have `add_forward(x, residual)`
-> (norm(residual + x), residual + x): the pre-norm block's residual add fused into the norm.

`fp8_output` (every module here; False unless hyla.models.fp8_loading.mark_fp8_producers sets it,
when the module's output feeds block-FP8 weights): on the Triton path the norm's kernel also writes
its output's block-FP8 form, which the FP8 GEMMs read instead of quantising it again
(hyla.ops.fp8_activation). The output itself is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.ops import dispatch


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)).  x: [..., D] -> [..., D] (dtype of x times weight)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fp8_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 normalisation (fp64 stays fp64 for exactness tests), rounded before the weight
        return dispatch.rms_norm_rounded(x, self.weight, self.eps, self.fp8_output)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(residual + x), residual + x); residual None: (self(x), x)."""
        return dispatch.add_rms_norm(x, residual, self.weight, self.eps, zero_centred=False,
                                     fp8_output=self.fp8_output)

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
        self.fp8_output = False

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """gate: x's shape, or (Triton path) a view with x's rows in order."""
        return dispatch.gated_rms_norm(x, gate, self.weight, eps=self.eps, activation=self.activation,
                                       fp8_output=self.fp8_output)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, activation={self.activation}"


class ZeroCentredRMSNorm(nn.Module):
    """Qwen3-Next's RMSNorm: y = (x / sqrt(mean(x^2) + eps)) * (1 + weight), stored weight
    zero-centred (initialised to 0). Normalisation and weight multiply in fp32, rounded once to
    the input dtype, as transformers' Qwen3NextRMSNorm (fp64 input stays fp64).

    x: [..., D] -> [..., D] in x.dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.fp8_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.rms_norm_zero_centred(x, self.weight, self.eps, self.fp8_output)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(residual + x), residual + x); residual None: (self(x), x)."""
        return dispatch.add_rms_norm(x, residual, self.weight, self.eps, zero_centred=True,
                                     fp8_output=self.fp8_output)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class SiLUGatedRMSNorm(nn.Module):
    """Gated DeltaNet's output norm (transformers' Qwen3NextRMSNormGated): the weight is stored
    as is (initialised to 1, *not* zero-centred) and the gate goes through SiLU.

        y = (weight * rms_norm(x).to(x.dtype)) * silu(gate)   -> x.dtype

    Same order of roundings as transformers: the normalised x is rounded to x.dtype before the
    weight multiply, the gate is activated in fp32 (they agree with hyla.ops.gated_rms_norm in
    fp32). x, gate: [..., D] (one weight [D] shared by every head)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fp8_output = False

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """gate: x's shape, or (Triton path) a view with x's rows in order (see
        hyla.ops.dispatch.silu_gated_rms_norm)."""
        return dispatch.silu_gated_rms_norm(x, gate, self.weight, self.eps, self.fp8_output)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
