"""Int8 recurrent-state checkpoints: one scale per row, restored to the running dtype.

A state slot of a linear layer is [HV, K, V]; a row is one value column's K entries (state[h, :, v],
contiguous in the K-last pools of hyla.contract.cache.state_pool). Each row is stored as int8 with
its own fp32 scale, amax(|row|) / 127:

    q = round(x / scale) in [-127, 127],   x' = q * scale,   |x - x'| <= scale / 2 = amax(|row|) / 254

so the restore error of every entry is at most 1/254 of the largest magnitude in its row (0.39%),
and a row of zeros comes back as zeros. Per-row scales (rather than one per head or per slot) keep
the bound local: the delta rule's state has columns of very different magnitudes, and one large
column must not flatten the others. The conv windows (a few KiB per layer) are not quantised.

Bytes: an fp32 state shrinks to 1/4 + 4/K of its size (K = 128: 0.28), a bf16 one to 1/2 + 2/K:
a prefix cache of int8 checkpoints holds ~3.6x (fp32 state) or ~1.9x (bf16) as many in the
same memory.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def rows_of(state: torch.Tensor) -> torch.Tensor:
    """state [..., K, V] -> a view [..., V, K]: one row per value column, K entries each."""
    return state.transpose(-1, -2)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., K] (any float dtype) -> (q [..., K] int8, scale [...] fp32), per row:
    scale = amax(|row|) / 127, q = round(row / scale). A zero row gets scale 0 and q 0."""
    x = rows.float() if rows.dtype != torch.float64 else rows
    scale = x.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.float()


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Write q [..., K] int8 * scale [...] into out [..., K] (its dtype: the running state's)."""
    compute = torch.float64 if out.dtype == torch.float64 else torch.float32
    out.copy_(q.to(compute) * scale.to(compute).unsqueeze(-1))


def restore_error_bound(state: torch.Tensor) -> torch.Tensor:
    """The largest restore error per row the format allows: amax(|row|) / 254, shape [..., V]."""
    return rows_of(state).abs().amax(dim=-1) / (2 * INT8_MAX)
