"""Triton SwiGLU activation for a decode step: silu(gate) * up in one launch instead of two.

Same contract (and the same roundings) as hyla.ops.gated_act's `silu` kind, i.e. torch's
`F.silu(gate) * up` in the input dtype:

    silu_mul(g, u)    round_x(round_x(g / (1 + exp(-g))) * u)      dense MLPs, shared experts

computed in fp32, with the silu rounded to the input dtype before the product, as torch's two
kernels round it (in fp32 both roundings are no-ops). gate and up are [..., I] with unit column
stride and any row stride: the column views of a packed gate / up GEMM output [T, 2I]
(hyla.layers.delta_rule.PackedLinears) are read in place, without a copy. Each program handles
a tile of BR rows by BI columns (a decode step has only a few rows, so the columns are split too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.triton import _interpreter
from hyla.ops.triton.norm import to_dtype
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

_TILE = 2048  # elements per program
_MAX_BI = 1024  # columns per program


@triton.jit
def silu_mul_kernel(gate, up, out, R, I, g_sr, u_sr, BR: tl.constexpr, BI: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)  # [BR] rows
    c = tl.program_id(1).to(tl.int64) * BI + tl.arange(0, BI).to(tl.int64)  # [BI] columns
    m = (r < R)[:, None] & (c < I)[None, :]
    gv = tl.load(gate + r[:, None] * g_sr + c[None, :], mask=m, other=0.0)
    g = gv.to(tl.float32)
    u = tl.load(up + r[:, None] * u_sr + c[None, :], mask=m, other=0.0).to(tl.float32)
    s = to_dtype(g / (1.0 + tl.exp(-g)), gv.dtype).to(tl.float32)  # F.silu's output, in gate's dtype
    tl.store(out + r[:, None] * I + c[None, :], to_dtype(s * u, out.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor, I: int) -> tuple[torch.Tensor, int]:
    """t: [..., I] -> ([R, I] with unit column stride, a view when possible; its row stride)."""
    try:
        t2 = t.view(-1, I)
    except RuntimeError:  # leading dims that do not merge into one stride
        t2 = t.reshape(-1, I)
    if t2.stride(-1) != 1 and I > 1:
        t2 = t2.contiguous()
    return t2, (t2.stride(0) if t2.shape[0] > 1 else I)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Triton version of hyla.ops.gated_act.SILU: gate, up [..., I] of one shape and dtype
    (unit column stride, any row stride) -> silu(gate) * up, contiguous [..., I] in gate.dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul needs gate and up of one shape and dtype, got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    I = gate.shape[-1]
    R = gate.numel() // I if I else 0
    out = torch.empty(R, I, device=gate.device, dtype=gate.dtype)
    if R and I:
        g2, g_sr = _rows(gate, I)
        u2, u_sr = _rows(up, I)
        BI = min(triton.next_power_of_2(I), _MAX_BI)
        BR = max(1, min(16, _TILE // BI))
        BR = min(BR, triton.next_power_of_2(R))
        warps = max(1, min(8, BR * BI // 256))
        silu_mul_kernel[(triton.cdiv(R, BR), triton.cdiv(I, BI))](
            g2, u2, out, R, I, g_sr, u_sr, BR=BR, BI=BI, num_warps=warps, **pdl_launch(g2.device))
    return out.view(gate.shape)
