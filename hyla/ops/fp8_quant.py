"""The e4m3 rounding and the per-token group quantiser of hyla's FP8 (the definitions; re-exported
by hyla.ops.fp8, whose module docstring describes the format). Kept apart from hyla.ops.fp8, which
dispatches to the kernels, so that the torch ops hyla.ops.dispatch routes (the FP8 KV pages of
hyla.ops.kv_fp8 in hyla.ops.mla / hyla.ops.paged_attention) can quantise without an import cycle.
Imports nothing from hyla but the shape contract (hyla.ops.fp8_checks)."""

from __future__ import annotations

import torch

from hyla.ops.fp8_checks import BLOCK, FP8_DTYPE, cdiv

FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
ACT_EPS = 1e-10  # an activation group's amax floor: an all-zero group gets a tiny scale, not 0 / 0

__all__ = ["FP8_MAX", "ACT_EPS", "to_e4m3", "fp8_scale", "per_token_group_quant"]


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax (fp32, any shape) -> amax / 448 correctly rounded, on every device. A tensor divisor:
    torch on CUDA divides by a Python scalar as a multiplication by its rounded reciprocal, an ulp
    off for about 60% of amaxes (an H100: 1,217 of 2,048 groups), and an ulp on the scale moves the
    codes of x / s that sit on a rounding tie, which bf16 inputs often do."""
    return amax / torch.full_like(amax, FP8_MAX)


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 values within +-448 (up to rounding) -> e4m3, round to nearest even (torch's cast);
    clamped first since the cast to e4m3fn turns overflow into NaN."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def per_token_group_quant(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, s [M, ceil(K/group)] fp32): each row's groups of `group`
    columns (the last one partial) scaled by s = max(amax, 1e-10) / 448, q = x / s rounded to
    nearest even. The Triton kernels quantise bit for bit the same (hyla.ops.triton.fp8_gemm)."""
    M, K = x.shape
    g = cdiv(K, group)
    x32 = x.float()
    amax = torch.nn.functional.pad(x32.abs(), (0, g * group - K)).view(M, g, group).amax(-1)
    s = fp8_scale(amax.clamp(min=ACT_EPS))
    q = to_e4m3(x32 / s.repeat_interleave(group, dim=-1)[:, :K])
    return q, s
