"""Leaf helpers shared by every op module (imports nothing from hyla): the compute dtype of an
input, the check of a gate's log-decay bound and of a low-rank up-projection's arguments.

fp64 inputs compute in fp64 (the exactness reference of every test); fp32, bf16 and fp16 inputs
compute in fp32 and round once at the end, as the kernels do.
"""

from __future__ import annotations

import math

import torch

__all__ = ["work_dtype", "check_lower_bound"]


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs; fp32 for everything else (fp32, bf16, fp16)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_lower_bound(lower_bound) -> float:
    """A gate's log-decay bound as a float: it must be finite and strictly negative (0 would
    allow no decay at all, a positive value would be a growth factor the recurrence forbids).
    Raises ValueError naming the value otherwise."""
    try:
        lb = float(lower_bound)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"lower_bound must be a finite negative number, got {lower_bound!r}") from err
    if not math.isfinite(lb) or lb >= 0:
        raise ValueError(f"lower_bound must be a finite negative number, got {lower_bound!r}")
    return lb


def check_up_projection(name: str, inp: torch.Tensor, w_up: torch.Tensor, heads: int, head_dim: int) -> None:
    """A low-rank up-projection's arguments (KDA's f_b_proj / g_b_proj): inp [B, T, r] and w_up
    [heads * head_dim, r], both floating point; ValueError naming `name` otherwise."""
    if not isinstance(inp, torch.Tensor) or not inp.is_floating_point() or inp.dim() != 3:
        got = tuple(inp.shape) if isinstance(inp, torch.Tensor) else type(inp).__name__
        raise ValueError(f"{name}: the low-rank input must be a floating-point tensor [B, T, r], got {got}")
    want = (heads * head_dim, inp.shape[2])
    if not isinstance(w_up, torch.Tensor) or not w_up.is_floating_point() or tuple(w_up.shape) != want:
        got = tuple(w_up.shape) if isinstance(w_up, torch.Tensor) else type(w_up).__name__
        raise ValueError(f"{name}: the up-projection weight must be a floating-point tensor {list(want)}, got {got}")
