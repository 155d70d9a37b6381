"""Triton SwiGLU activation for a decode step: silu(gate) * up in one launch instead of two.

Same contract (and the same roundings) as hyla.ops.gated_act's `silu` kind, i.e. torch's
`F.silu(gate) * up` in the input dtype:

    silu_mul(g, u)    round_x(round_x(g / (1 + exp(-g))) * u)      dense MLPs, shared experts

computed in fp32, with the silu rounded to the input dtype before the product, as torch's two
kernels round it (in fp32 both roundings are no-ops). gate and up are [..., I] with unit column
stride and any row stride: the column views of a packed gate / up GEMM output [T, 2I]
(hyla.layers.delta_rule.PackedLinears) are read in place, without a copy. Each program handles
a tile of BR rows by BI columns (a decode step has only a few rows, so the columns are split too).

fp8_output=True (the activation feeds a block-FP8 down_proj; I a multiple of 128, else it is
ignored): each program also quantises the tile it stores per group of 128 columns (BI is a power
of two >= 128, so its tiles hold whole groups), as hyla.ops.triton.norm's producers do, and the
result carries the codes and scales to the FP8 GEMM (hyla.ops.fp8_activation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops import fp8_activation
from hyla.ops.triton import _interpreter
from hyla.ops.triton.fp8_gemm import store_group_quant
from hyla.ops.triton.norm import to_dtype
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

_TILE = 2048  # elements per program
_MAX_BI = 1024  # columns per program


@triton.jit
def silu_mul_kernel(gate, up, out, out_q, out_s, R, I, g_sr, u_sr, BR: tl.constexpr, BI: tl.constexpr,
                    FP8: tl.constexpr = False, PDL: tl.constexpr = False):
    """out [R, I] = silu(gate) * up for BR rows x BI columns; FP8: also out's block-FP8 form, codes
    out_q [R, I] and scales out_s [R, I / 128] (I % 128 == 0)."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)  # [BR] rows
    c = tl.program_id(1).to(tl.int64) * BI + tl.arange(0, BI).to(tl.int64)  # [BI] columns
    m = (r < R)[:, None] & (c < I)[None, :]
    gv = tl.load(gate + r[:, None] * g_sr + c[None, :], mask=m, other=0.0)
    g = gv.to(tl.float32)
    u = tl.load(up + r[:, None] * u_sr + c[None, :], mask=m, other=0.0).to(tl.float32)
    s = to_dtype(g / (1.0 + tl.exp(-g)), gv.dtype).to(tl.float32)  # F.silu's output, in gate's dtype
    ov = to_dtype(s * u, out.dtype.element_ty)
    tl.store(out + r[:, None] * I + c[None, :], ov, mask=m)
    if FP8:  # the values just stored, as per_token_group_quant(out) reads them
        store_group_quant(out_q, out_s, ov.to(tl.float32), r, r < R, tl.program_id(1) * BI, I, BR, BI)


def _rows(t: torch.Tensor, I: int) -> tuple[torch.Tensor, int]:
    """t: [..., I] -> ([R, I] with unit column stride, a view when possible; its row stride)."""
    try:
        t2 = t.view(-1, I)
    except RuntimeError:  # leading dims that do not merge into one stride
        t2 = t.reshape(-1, I)
    if t2.stride(-1) != 1 and I > 1:
        t2 = t2.contiguous()
    return t2, (t2.stride(0) if t2.shape[0] > 1 else I)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, fp8_output: bool = False) -> torch.Tensor:
    """The Triton version of hyla.ops.gated_act.SILU: gate, up [..., I] of one shape and dtype
    (unit column stride, any row stride) -> silu(gate) * up, contiguous [..., I] in gate.dtype;
    fp8_output: see the module docstring."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul needs gate and up of one shape and dtype, got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    I = gate.shape[-1]
    R = gate.numel() // I if I else 0
    out, out_q, out_s = fp8_activation.producer_buffers(R, I, gate.dtype, gate.device, fp8_output)
    if R and I:
        g2, g_sr = _rows(gate, I)
        u2, u_sr = _rows(up, I)
        BI = min(triton.next_power_of_2(I), _MAX_BI)
        BR = max(1, min(16, _TILE // BI))
        BR = min(BR, triton.next_power_of_2(R))
        warps = max(1, min(8, BR * BI // 256))
        silu_mul_kernel[(triton.cdiv(R, BR), triton.cdiv(I, BI))](
            g2, u2, out, out if out_q is None else out_q, out if out_s is None else out_s, R, I, g_sr, u_sr,
            BR=BR, BI=BI, FP8=out_q is not None, num_warps=warps, **pdl_launch(g2.device))
    return fp8_activation.carry_produced(out.view(gate.shape), out_q, out_s)
