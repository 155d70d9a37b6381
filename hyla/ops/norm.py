"""Normalisations over the last dimension, computed in fp32 (fp64 for fp64 input).

Each function rounds once, at the end, back to the input dtype: bf16 callers get the fp32 result
rounded, not a chain of bf16 roundings.

    l2norm(x)                 = x / sqrt(sum(x^2) + eps)                 (fla's q/k norm)
    rms_norm(x, w)            = x / sqrt(mean(x^2) + eps) * w
    gated_rms_norm(x, z, w)   = rms_norm(x, w) * act(z),  act = sigmoid (Kimi-Linear o_norm)
                                                               or silu (Qwen3-Next)
The weight is used as given: models whose checkpoint stores a zero-centred weight (1 + w) pass
``1 + w``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["l2norm", "rms_norm", "gated_rms_norm"]

_ACTIVATIONS = {"sigmoid": torch.sigmoid, "silu": F.silu, "swish": F.silu}


def _work(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


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
