"""Triton RMSNorms for a decode step: one launch per norm instead of ~8-12 element-wise ops.

Same contracts (and the same order of roundings) as the torch references in hyla.ops.norm:

    rms_norm_rounded(x, w)         w * round_x(rms(x))             Kimi's RMSNorm
    rms_norm_zero_centred(x, w)    round_x(rms(x) * (1 + w))       Qwen3-Next's RMSNorm
    add_rms_norm(x, r, w)          (norm(r + x), r + x)            residual add fused in
    gated_rms_norm(x, z, w, act)   round_x(rms(x) * w * act(z))    KDA's output norm (all fp32)
    lowrank_gated_rms_norm         the same with z = g_in @ w_up^T computed per head in the kernel
                                   (KDA's g_b_proj at a decode step: one launch, not a GEMV + a norm)
    silu_gated_rms_norm(x, z, w)   round_x(round(w * round_x(rms(x))) * silu(z))   GDN's output norm

with rms(x) = x / sqrt(mean(x^2) + eps) in fp32. One program normalises one row of D elements,
or several short rows (D <= MAX_D). The gate z may be a strided view whose rows are addressed through up to three
(size, stride) levels, so a gate cut out of a fused projection (GDN's z inside in_proj_qkvz's
head-interleaved output) is read in place, without a copy.

fp8_output=True (a norm feeding block-FP8 projections or experts; D a multiple of 128, else it is
ignored): the kernel also quantises the rows it stores, per group of 128 columns
(hyla.ops.triton.fp8_gemm.store_group_quant: its bf16 / fp32 output re-read as fp32, so the codes
and scales are bit for bit per_token_group_quant(y)), and the result carries them
(hyla.ops.fp8_activation) to the FP8 GEMMs, which then launch no quantiser of their own.
The head-wise gated output norms (sigmoid- and SiLU-gated, and the low-rank one) emit only for rows
of at most GATED_FP8_MAX_D: the released families' head dims (128, 256), where the compiled kernels
were checked bit for bit on CUDA. On an H100 a 2,048-wide sigmoid-gated row with the FP8 store
compiled to another reduction order (one bit of the output moved) and a 2,304-wide low-rank one
did not finish compiling: wider head-wise rows leave the quantisation to the consumer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops import fp8_activation
from hyla.ops.triton import _interpreter
from hyla.ops.triton.common import LOWRANK_ONE_LOAD_RANK, head_up_projection
from hyla.ops.triton.fp8_gemm import store_group_quant
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

ROUNDED, ZERO_CENTRED, GATED, SILU_ROUNDED = 0, 1, 2, 3  # the STYLE constexpr
ACT_SIGMOID, ACT_SILU = 0, 1  # the ACT constexpr (GATED)
MAX_D = 16384
GATED_FP8_MAX_D = 256  # widest head-wise gated row that writes its FP8 form (module docstring)


def _head_wise_fp8(fp8_output: bool, D: int) -> bool:
    """Whether a head-wise gated norm of D-wide rows writes its FP8 form when asked (module docstring)."""
    return fp8_output and D <= GATED_FP8_MAX_D


@triton.jit
def round_bf16(x):
    """fp32 -> fp32 holding x rounded to bf16, to nearest even (finite x). Done in integer
    arithmetic because Triton's CPU interpreter truncates in `.to(tl.bfloat16)`; on the GPU it
    is the same rounding the conversion does, and the later `.to` is then exact."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_dtype(x, dtype: tl.constexpr):
    """fp32 x -> dtype, rounded to nearest even (also under the interpreter)."""
    if dtype == tl.bfloat16:
        x = round_bf16(x)
    return x.to(dtype)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gate_act(z, ACT: tl.constexpr):
    """The gated norms' activation of an fp32 gate tile: sigmoid (ACT_SIGMOID) or silu."""
    if ACT == 0:
        return _sigmoid(z)
    return z * _sigmoid(z)


@triton.jit
def rms_norm_kernel(x, res, w, gate, y, h_out, y_q, y_s, R, D, sr, eps,
                    x_s0, x_s1, x_s2, X1, X2, g_s0, g_s1, g_s2, G1, G2,
                    BR: tl.constexpr, BD: tl.constexpr, STYLE: tl.constexpr, ACT: tl.constexpr,
                    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, ROUND_MID: tl.constexpr, FP8: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """BR rows of D elements per program (BR > 1 for short rows: a KDA output norm has 128-wide
    rows, one per head and token, and one row per program left most of each program idle).
    FP8: also y's block-FP8 form, codes y_q [R, D] and scales y_s [R, D / 128] (D % 128 == 0)."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    i = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)  # [BR] rows
    o = tl.arange(0, BD)
    m = (i < R)[:, None] & (o < D)[None, :]  # [BR, BD]
    x_row = (i // (X1 * X2)) * x_s0 + ((i // X2) % X1) * x_s1 + (i % X2) * x_s2
    xv = tl.load(x + x_row[:, None] + o[None, :], mask=m, other=0.0)
    if HAS_RES:  # h = residual + x, rounded to x's dtype as torch's add
        hv = to_dtype(tl.load(res + i[:, None] * sr + o[None, :], mask=m, other=0.0).to(tl.float32)
                      + xv.to(tl.float32), xv.dtype)
        tl.store(h_out + i[:, None] * D + o[None, :], hv, mask=m)
        xv = hv
    xf = xv.to(tl.float32)
    n = xf * tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
    if HAS_W:
        wf = tl.load(w + o, mask=o < D, other=0.0).to(tl.float32)[None, :]
    else:
        wf = tl.full([1, BD], 1.0, tl.float32)
    if STYLE == 0:  # w * round_x(n), stored in y's dtype (promote(w, x))
        out = wf * to_dtype(n, xv.dtype).to(tl.float32)
    elif STYLE == 1:
        out = n * (1.0 + wf)
    else:
        g_row = (i // (G1 * G2)) * g_s0 + ((i // G2) % G1) * g_s1 + (i % G2) * g_s2
        zf = tl.load(gate + g_row[:, None] + o[None, :], mask=m, other=0.0).to(tl.float32)
        if STYLE == 2:
            out = (n * wf) * _gate_act(zf, ACT)
        else:  # silu-gated, Qwen3-Next's roundings
            mid = wf * to_dtype(n, xv.dtype).to(tl.float32)
            if ROUND_MID:
                mid = to_dtype(mid, xv.dtype).to(tl.float32)
            out = mid * (zf / (1.0 + tl.exp(-zf)))
    yv = to_dtype(out, y.dtype.element_ty)
    tl.store(y + i[:, None] * D + o[None, :], yv, mask=m)
    if FP8:  # the values just stored, as per_token_group_quant(y) reads them
        store_group_quant(y_q, y_s, yv.to(tl.float32), i, i < R, 0, D, BR, BD)


@triton.jit
def lowrank_gated_norm_kernel(x, g_in, w_up, w, y, y_q, y_s, r, H, eps, x_s0, x_s1, g_s0, wu_s0,
                              D: tl.constexpr, BD: tl.constexpr, BRK: tl.constexpr, ACT: tl.constexpr,
                              HAS_W: tl.constexpr, FP8: tl.constexpr = False, PDL: tl.constexpr = False):
    """One (token, head) per program: z = g_in[n] @ w_up[head rows]^T in fp32, rounded to g_in's
    dtype (the up-projection's output), then y = round_x(rms(x) * w * act(z)) as STYLE GATED.
    FP8: also y's block-FP8 form, codes y_q [N * H, D] and scales y_s [N * H, D / 128] (D % 128 == 0)."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    o = tl.arange(0, BD)
    m = o < D
    rows = (j * D + o).to(tl.int64)
    acc = head_up_projection(g_in, n, g_s0, w_up, wu_s0, rows, m, r, BD, BRK)
    zf = to_dtype(acc, g_in.dtype.element_ty).to(tl.float32)  # the gate as the up-projection's output
    xv = tl.load(x + n * x_s0 + j * x_s1 + o, mask=m, other=0.0)
    xf = xv.to(tl.float32)
    nrm = xf * tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    if HAS_W:
        nrm = nrm * tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    yv = to_dtype(nrm * _gate_act(zf, ACT), y.dtype.element_ty)
    row = n * H + j
    tl.store(y + row * D + o, yv, mask=m)
    if FP8:  # the one row just stored, as per_token_group_quant(y) reads it
        store_group_quant(y_q, y_s, yv.to(tl.float32)[None, :], tl.full([1], row, tl.int64), tl.full([1], 1, tl.int1),
                          0, D, 1, BD)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t: [..., D] -> [R, D] with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def _row_levels(t: torch.Tensor, d: int):
    """The rows of t (leading dims, row-major) as three (size, stride) levels, outermost first,
    or None when they need more than three (the caller copies). Unit column stride required."""
    if t.stride(-1) != 1 and d > 1:
        return None
    dims = [(s, st) for s, st in zip(t.shape[:-1], t.stride()[:-1]) if s != 1]
    merged = []
    for s, st in dims:
        if merged and merged[-1][1] == s * st:
            merged[-1] = (merged[-1][0] * s, st)
        else:
            merged.append((s, st))
    if len(merged) > 3:
        return None
    while len(merged) < 3:
        merged.insert(0, (1, 0))
    return merged


def _block(D: int) -> tuple[int, int, int]:
    """(rows per program, padded row width, warps): ~2K elements per program for short rows."""
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 2048 // BD))
    return BR, BD, max(1, min(16, BR * BD // 512))


def _launch(x, weight, eps, style, *, residual=None, gate=None, act=ACT_SIGMOID, out_dtype=None,
            round_mid=False, fp8_output=False):
    D = x.shape[-1]
    if D > MAX_D:
        raise ValueError(f"the Triton RMSNorm supports D <= {MAX_D}, got {D}")
    R = x.numel() // D if D else 0
    x_levels = _row_levels(x, D)
    if x_levels is None:
        x = x.contiguous()
        x_levels = [(1, 0), (1, 0), (R, D)]
    (_, x_s0), (X1, x_s1), (X2, x_s2) = x_levels
    y, y_q, y_s = fp8_activation.producer_buffers(R, D, out_dtype or x.dtype, x.device, fp8_output)
    h = torch.empty(R, D, device=x.device, dtype=x.dtype) if residual is not None else None
    r2 = _rows(residual) if residual is not None else None
    levels = [(1, 0), (1, 0), (R, D)]
    if gate is not None:
        levels = _row_levels(gate, D)
        if levels is None:
            gate = gate.contiguous()
            levels = [(1, 0), (1, 0), (R, D)]
    (_, g_s0), (G1, g_s1), (G2, g_s2) = levels
    if R and D:
        BR, BD, warps = _block(D)
        rms_norm_kernel[(triton.cdiv(R, BR),)](
            x, r2 if r2 is not None else x, weight if weight is not None else x,
            gate if gate is not None else x, y, h if h is not None else y, y if y_q is None else y_q,
            y if y_s is None else y_s, R, D, r2.stride(0) if r2 is not None else 0, float(eps),
            x_s0, x_s1, x_s2, X1, X2, g_s0, g_s1, g_s2, G1, G2,
            BR=BR, BD=BD, STYLE=style, ACT=act, HAS_RES=residual is not None, HAS_W=weight is not None,
            ROUND_MID=bool(round_mid), FP8=y_q is not None, num_warps=warps, **pdl_launch(x.device))
    y = fp8_activation.carry_produced(y.view(x.shape), y_q, y_s)
    return y if h is None else (y, h.view(x.shape))  # both contiguous


def rms_norm_rounded(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                     fp8_output: bool = False) -> torch.Tensor:
    """The Triton version of hyla.ops.norm.rms_norm_rounded (result dtype promote(w, x));
    fp8_output: see the module docstring (also for the functions below)."""
    return _launch(x, weight.contiguous(), eps, ROUNDED, out_dtype=torch.promote_types(weight.dtype, x.dtype),
                   fp8_output=fp8_output)


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                          fp8_output: bool = False) -> torch.Tensor:
    """The Triton version of hyla.ops.norm.rms_norm_zero_centred."""
    return _launch(x, weight.contiguous(), eps, ZERO_CENTRED, fp8_output=fp8_output)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6,
                 zero_centred: bool = False, fp8_output: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton version of hyla.ops.norm.add_rms_norm -> (normed, residual + x); fp8_output: the
    normed output's block-FP8 form."""
    if residual is None:
        y = (rms_norm_zero_centred if zero_centred else rms_norm_rounded)(x, weight, eps, fp8_output)
        return y, x
    style = ZERO_CENTRED if zero_centred else ROUNDED
    out_dtype = x.dtype if zero_centred else torch.promote_types(weight.dtype, x.dtype)
    return _launch(x, weight.contiguous(), eps, style, residual=residual, out_dtype=out_dtype, fp8_output=fp8_output)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6,
                   activation: str = "sigmoid", fp8_output: bool = False) -> torch.Tensor:
    """The Triton version of hyla.ops.norm.gated_rms_norm. gate: x's element count with rows in
    x's order (its leading dims may be split differently, strides arbitrary)."""
    act = ACT_SIGMOID if activation == "sigmoid" else ACT_SILU
    return _launch(x, None if weight is None else weight.contiguous(), eps, GATED, gate=gate, act=act,
                   fp8_output=_head_wise_fp8(fp8_output, x.shape[-1]))


def silu_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                        fp8_output: bool = False) -> torch.Tensor:
    """The Triton version of hyla.ops.norm.silu_gated_rms_norm (gate as in gated_rms_norm)."""
    mid = torch.promote_types(weight.dtype, x.dtype)
    return _launch(x, weight.contiguous(), eps, SILU_ROUNDED, gate=gate, round_mid=mid != torch.float32,
                   fp8_output=_head_wise_fp8(fp8_output, x.shape[-1]))


def lowrank_gated_rms_norm(x: torch.Tensor, g_in: torch.Tensor, w_up: torch.Tensor, weight: torch.Tensor | None,
                           eps: float = 1e-6, activation: str = "sigmoid", fp8_output: bool = False) -> torch.Tensor:
    """The Triton version of hyla.ops.norm.lowrank_gated_rms_norm. x: [B, T, H, D] (unit stride in
    D); g_in: [B, T, r] (unit column stride, any row stride); w_up: [H * D, r]."""
    B, T, H, D = x.shape
    if D > MAX_D:
        raise ValueError(f"the Triton RMSNorm supports D <= {MAX_D}, got {D}")
    x = x.reshape(B * T, H, D)
    if x.stride(-1) != 1:
        x = x.contiguous()
    g2 = g_in.reshape(B * T, g_in.shape[-1])
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    w_up = w_up if w_up.stride(-1) == 1 else w_up.contiguous()
    y, y_q, y_s = fp8_activation.producer_buffers(B * T * H, D, x.dtype, x.device,  # (token, head) rows
                                                  _head_wise_fp8(fp8_output, D))
    r = g2.shape[1]
    if B * T and H and D:
        lowrank_gated_norm_kernel[(B * T, H)](
            x, g2, w_up, weight.contiguous() if weight is not None else x, y, y if y_q is None else y_q,
            y if y_s is None else y_s, r, H, float(eps), x.stride(0), x.stride(1), g2.stride(0), w_up.stride(0), D=D,
            BD=triton.next_power_of_2(D), BRK=min(LOWRANK_ONE_LOAD_RANK, triton.next_power_of_2(r)),
            ACT=ACT_SIGMOID if activation == "sigmoid" else ACT_SILU, HAS_W=weight is not None, FP8=y_q is not None,
            num_warps=8, **pdl_launch(x.device))
    return fp8_activation.carry_produced(y.view(B, T, H, D), y_q, y_s)
