"""Numeric range of the chunkwise KDA / GDN form, and safe tile sizes.

Why the textbook chunk form needs a bound
-----------------------------------------
Inside a chunk, let G_i = g_1 + ... + g_i be the cumulative log-decay (every g <= 0, so G is
non-increasing and G_i <= 0). The pairwise decay between a reading token i and a writing token
j <= i is exp(G_i - G_j) <= 1, which is harmless. The textbook way to turn the masked pairwise
product into a single matmul splits it per channel,

    exp(G_i - G_j) = exp(G_i) * exp(-G_j),        i.e.  A = tril((Q * Gamma) @ (K / Gamma)^T),

and K / Gamma multiplies each key by exp(-G_j) >= 1. Over a tile of C tokens whose log-decays
are all >= lower_bound, that factor can reach exp(-lower_bound * C): with lower_bound = -5 and
C = 16 it is exp(80) ~ 5.5e34, close to the float32 / bfloat16 ceiling (~3.4e38 = exp(88.7)).
Anything larger overflows to inf before the causal mask can remove it, and inf * 0 = NaN. Gate
v1 (softplus, unbounded below) has no lower bound at all, so no tile size is safe for it; gate
v2 (``lower_bound * sigmoid(...)``) exists to make one. :func:`max_reciprocal_decay` gives the
largest 1/gamma in a tile and :func:`safe_chunk_size` the largest tile that keeps it finite.

Why hyla's chunk path does not need it
--------------------------------------
hyla never exponentiates a positive cumulative log-decay. Inside 16-token sub-blocks it forms
the masked pairwise differences G_i - G_j only for i >= j (the mask is applied to the exponent,
before ``exp``), and for an off-diagonal sub-block (rows after columns) it splits at a reference
point n at the start of the row sub-block:

    exp(G_i - G_j) = exp(G_i - G_n) * exp(G_n - G_j),     i >= n > j,

where both exponents are <= 0 because G is non-increasing. Every factor is therefore in [0, 1]
whatever the gate, including the unbounded v1 gate; a factor can underflow to 0 only when the
true product is even smaller. These helpers remain useful for kernels that do use the K / Gamma
form and for documenting the bound the v2 gate buys.
"""

from __future__ import annotations

import math

import torch

from hyla.ops.dtypes import check_lower_bound

__all__ = ["max_reciprocal_decay", "safe_chunk_size"]


def max_reciprocal_decay(lower_bound: float, tile: int) -> float:
    """Largest 1/gamma inside a tile of ``tile`` tokens when every log-decay >= ``lower_bound``.

    Returns ``exp(-lower_bound * tile)`` as a Python float (``inf`` when it exceeds the float64
    range). Example: ``max_reciprocal_decay(-5, 16) == exp(80) ~ 5.5406e34``.
    """
    lb = check_lower_bound(lower_bound)
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 0:
        raise ValueError(f"tile must be a non-negative int, got {tile!r}")
    try:
        return math.exp(-lb * tile)
    except OverflowError:
        return math.inf


def safe_chunk_size(lower_bound: float, dtype: torch.dtype) -> int:
    """Largest tile C with ``max_reciprocal_decay(lower_bound, C + 1) <= torch.finfo(dtype).max``.

    The ``+ 1`` keeps one step of headroom (a tile of C tokens whose reference point sits one
    token earlier spans C + 1 decays). Figures: (-5, bf16) -> 16, (-5, fp16) -> 1,
    (-8, bf16) -> 10. Raises ValueError when not even C = 1 is safe.
    """
    lb = check_lower_bound(lower_bound)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    ceiling = torch.finfo(dtype).max

    def fits(c: int) -> bool:
        return max_reciprocal_decay(lb, c + 1) <= ceiling

    # Closed form, then nudge by whole steps so float rounding of the log cannot be off by one.
    c = math.floor(math.log(ceiling) / -lb) - 1
    while c >= 1 and not fits(c):
        c -= 1
    while fits(c + 1):
        c += 1
    if c < 1 or not fits(c):
        raise ValueError(
            f"lower_bound={lb} is too negative for {dtype}: even a 1-token tile overflows "
            f"(exp({-2 * lb:g}) > {ceiling:g})"
        )
    return c
