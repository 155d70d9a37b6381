"""Normalisations over the last dimension, computed in fp32 (fp64 for fp64 input).

Each function rounds once, at the end, back to the input dtype: bf16 callers get the fp32 result
rounded, not a chain of bf16 roundings.

    l2norm(x)                 = x / sqrt(sum(x^2) + eps)                 (fla's q/k norm)
    rms_norm(x, w)            = x / sqrt(mean(x^2) + eps) * w
    gated_rms_norm(x, z, w)   = rms_norm(x, w) * act(z),  act = sigmoid (Kimi-Linear o_norm)
                                                               or silu (Qwen3-Next)
The weight is used as given: models whose checkpoint stores a zero-centred weight (1 + w) pass
``1 + w``.

The modules of hyla.layers.norm round exactly as the transformers checkpoints do, which is not
always "once at the end"; their references (what the fused Triton kernels of
hyla.ops.triton.norm must reproduce, and what the modules compute on the torch path) are:

    rms_norm_rounded(x, w)            = w * round_x(x / sqrt(mean(x^2) + eps))
                                         (Kimi's RMSNorm; result dtype promote(w, x))
    rms_norm_zero_centred(x, w)       = round_x(x / sqrt(mean(x^2) + eps) * (1 + w))
                                         (Qwen3-Next's RMSNorm, weight stored zero-centred)
    add_rms_norm(x, residual, w, ...) = (norm(residual + x), residual + x)   the sum rounded to x.dtype,
                                         norm one of the two above (zero_centred=False | True)
    silu_gated_rms_norm(x, z, w)      = round_x((w * round_x(rms(x))) * silu(z))
                                         (Qwen3-Next's gated output norm)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyla.ops.dtypes import check_up_projection, work_dtype

__all__ = ["l2norm", "rms_norm", "gated_rms_norm", "rms_norm_rounded", "rms_norm_zero_centred",
           "add_rms_norm", "silu_gated_rms_norm"]

_ACTIVATIONS = {"sigmoid": torch.sigmoid, "silu": F.silu, "swish": F.silu}


def _work(x: torch.Tensor) -> torch.Tensor:
    return x.to(work_dtype(x))


def _check_x(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError("x must be a floating-point tensor [..., D]")


def _check_eps(eps: float) -> None:
    if not float(eps) >= 0:  # also rejects NaN
        raise ValueError(f"eps must be >= 0, got {eps!r}")


def _check_weight(weight: torch.Tensor | None, d: int) -> None:
    if weight is not None and (not isinstance(weight, torch.Tensor) or weight.shape != (d,)):
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must have shape [{d}] (the last dim of x), got {got}")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., D] -> x / sqrt(sum(x^2, -1) + eps), same shape and dtype as x."""
    _check_x(x)
    _check_eps(eps)
    xf = _work(x)
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def _rms(xf: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.to(xf.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., D], weight: [D] or None -> [..., D] in x.dtype."""
    _check_x(x)
    _check_weight(weight, x.shape[-1])
    _check_eps(eps)
    return _rms(_work(x), weight, eps).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    activation: str = "sigmoid",
) -> torch.Tensor:
    """x, gate: [..., D] (same shape), weight: [D] or None -> rms_norm(x) * weight * act(gate).

    activation: "sigmoid" (Kimi-Linear) or "silu" / "swish" (Qwen3-Next, fla's default).
    """
    _check_x(x)
    if not isinstance(gate, torch.Tensor) or gate.shape != x.shape:
        got = tuple(gate.shape) if isinstance(gate, torch.Tensor) else type(gate).__name__
        raise ValueError(f"gate must have the shape of x {tuple(x.shape)}, got {got}")
    _check_weight(weight, x.shape[-1])
    _check_eps(eps)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    xf = _work(x)
    act = _ACTIVATIONS[activation](gate.to(xf.dtype))
    return (_rms(xf, weight, eps) * act).to(x.dtype)


def lowrank_gated_rms_norm(x: torch.Tensor, g_in: torch.Tensor, w_up: torch.Tensor, weight: torch.Tensor | None,
                           eps: float = 1e-6, activation: str = "sigmoid") -> torch.Tensor:
    """gated_rms_norm with the gate from a low-rank up-projection (KDA's g_b_proj, its output in
    g_in's dtype as the linear gives it): x [B, T, H, D], g_in [B, T, r], w_up [H * D, r]."""
    _check_x(x)
    if x.dim() != 4:
        raise ValueError(f"x must be [B, T, H, D] for a low-rank gate, got {tuple(x.shape)}")
    check_up_projection("lowrank_gated_rms_norm", g_in, w_up, x.shape[2], x.shape[3])
    gate = F.linear(g_in, w_up).unflatten(-1, x.shape[-2:])
    return gated_rms_norm(x, gate, weight, eps, activation)


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x if x.dtype == torch.float64 else x.float()  # fp64 stays fp64 for exactness tests
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_rounded(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Kimi-Linear's RMSNorm (transformers' KimiLinearRMSNorm): normalise in fp32, round to
    x.dtype, then multiply the weight. x: [..., D], weight: [D] -> [..., D] in promote(w, x)."""
    return weight * _normalised(x, eps).to(x.dtype)


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3-Next's RMSNorm: normalise and multiply (1 + weight) in fp32, round once to x.dtype."""
    xf = _normalised(x, eps)
    return (xf * (1.0 + weight.to(xf.dtype))).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6,
                 zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block's "h = residual + x; y = norm(h)" as one op -> (y, h).

    x, residual: [..., D] (residual None: h = x); h is the sum in x's dtype (as `residual + x`),
    y = rms_norm_zero_centred(h) if zero_centred else rms_norm_rounded(h)."""
    h = x if residual is None else residual + x
    norm = rms_norm_zero_centred if zero_centred else rms_norm_rounded
    return norm(h, weight, eps), h


def silu_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Gated DeltaNet's output norm (transformers' Qwen3NextRMSNormGated): the normalised x is
    rounded to x.dtype before the weight multiply, the gate goes through SiLU in fp32, the product
    is rounded to x.dtype. x, gate: [..., D], weight [D]."""
    work = work_dtype(x)
    y = weight * _normalised(x, eps).to(x.dtype)
    return (y * F.silu(gate.to(work))).to(x.dtype)
