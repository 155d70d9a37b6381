"""Leaf helpers shared by every op module (imports nothing from hyla): the compute dtype of an
input and the check of a gate's log-decay bound.

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
