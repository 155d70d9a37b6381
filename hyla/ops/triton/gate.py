"""Triton gates for a decode step: the log-decay g and the write strength beta in one launch.

Same contracts as hyla.ops.gate.kda_gate_beta / gdn_gate_beta:

    KDA:  g = -exp(A_log) * softplus(f + dt_bias)  (v1)  or  lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
          per channel [H, K];  beta = sigmoid(b) per head
    GDN:  g = -exp(A_log) * softplus(a + dt_bias)  per value head;  beta = sigmoid(b)

g is fp32, beta is rounded to b's dtype (as torch.sigmoid(b)). One program handles one token
row. The per-head inputs (b, GDN's a) may be strided views [rows, H, r] -- e.g. cut out of
in_proj_ba's head-interleaved output -- and are read in place.

A decode step's KDA gate can also take the forget gate's low-rank input fa [rows, r] and the
up-projection weight (f_b_proj, [H * K, r]) instead of f (`kda_lowrank_gate_beta`): one program per
(token, head) computes its head's K values of f = fa @ w_up^T in fp32, rounds them to fa's dtype
(the linear's output), and applies the gate: one launch where the GEMV and the gate were two.

GDN's gate likewise takes x and the weights of b and a where a checkpoint keeps those projections
in the model dtype apart from the FP8 GEMM of the others (`gdn_projected_gate_beta`): one program
per (token, block of BH value heads) reads its token's x once, chunk by chunk, for the b and a
rows of its heads (fp32 sums, rounded to x's dtype as the linear's output), and applies the gate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.triton import _interpreter
from hyla.ops.triton.common import LOWRANK_ONE_LOAD_RANK, apply_gate, head_up_projection, sigmoid
from hyla.ops.triton.norm import to_dtype
from hyla.ops.triton.params import token_rows
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1


@triton.jit
def gate_beta_kernel(f, b, A_log, dt_bias, g, beta, lower_bound,
                     f_s0, f_s1, f_s2, F_R, b_s0, b_s1, b_s2, B_R,
                     HV: tl.constexpr, KD: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr,
                     GATE_FN: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    n = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BC)  # channel of g: head c // KD, channel c % KD
    m = c < HV * KD
    j = c // KD
    x = tl.load(f + n * f_s0 + (j // F_R) * f_s1 + (j % F_R) * f_s2 + c % KD, mask=m, other=0.0).to(tl.float32)
    a_log = tl.load(A_log + j, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(dt_bias + c, mask=m, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BC], tl.float32)
    tl.store(g + n * HV * KD + c, apply_gate(x, a_log, bias, lower_bound, GATE_FN), mask=m)
    h = tl.arange(0, BH)
    mh = h < HV
    bv = tl.load(b + n * b_s0 + (h // B_R) * b_s1 + (h % B_R) * b_s2, mask=mh, other=0.0).to(tl.float32)
    tl.store(beta + n * HV + h, to_dtype(sigmoid(bv), beta.dtype.element_ty), mask=mh)


@triton.jit
def lowrank_gate_beta_kernel(fa, w, b, A_log, dt_bias, g, beta, lower_bound, r, fa_s0, w_s0,
                             b_s0, b_s1, b_s2, B_R, HV, KD: tl.constexpr, BK: tl.constexpr, BRK: tl.constexpr,
                             GATE_FN: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):
    """One (token, head, BK-row chunk of the head's KD gate rows) per program: a decode step's few
    tokens still spread over many programs, each reading its BK x r slice of w_up in one load."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # head
    c = tl.program_id(2)  # row chunk
    o_k = c * BK + tl.arange(0, BK)
    m_k = o_k < KD
    rows = (j * KD + o_k).to(tl.int64)
    acc = head_up_projection(fa, n, fa_s0, w, w_s0, rows, m_k, r, BK, BRK)
    x = to_dtype(acc, fa.dtype.element_ty).to(tl.float32)  # f as the up-projection's output
    a_log = tl.load(A_log + j).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(dt_bias + rows, mask=m_k, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BK], tl.float32)
    tl.store(g + (n * HV + j) * KD + o_k, apply_gate(x, a_log, bias, lower_bound, GATE_FN), mask=m_k)
    if c == 0:
        bv = tl.load(b + n * b_s0 + (j // B_R) * b_s1 + (j % B_R) * b_s2).to(tl.float32)
        tl.store(beta + n * HV + j, to_dtype(sigmoid(bv), beta.dtype.element_ty))


# A decode step's low-rank gate (one token: 32 heads) as 32 x 4 programs of 32 gate rows each
LOWRANK_GATE_ROWS = 32


@triton.jit
def projected_gate_beta_kernel(x, w_b, w_a, A_log, dt_bias, g, beta, hidden, x_s0,
                               wb_s1, wb_s2, WB_R, wa_s1, wa_s2, WA_R, HV,
                               BH: tl.constexpr, BX: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BH + tl.arange(0, BH)  # value heads
    m_j = j < HV
    # row j of a weight seen as [H, r, hidden]: (j // r) * s1 + (j % r) * s2 (r = 1, s2 = 0 for [HV, hidden])
    jl = j.to(tl.int64)
    b_rows = (jl // WB_R) * wb_s1 + (jl % WB_R) * wb_s2
    a_rows = (jl // WA_R) * wa_s1 + (jl % WA_R) * wa_s2
    b_acc = tl.zeros([BH], tl.float32)
    a_acc = tl.zeros([BH], tl.float32)
    for c0 in range(0, hidden, BX):
        o_c = c0 + tl.arange(0, BX)
        m_c = o_c < hidden
        xc = tl.load(x + n * x_s0 + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]  # [1, BX], for b and a
        m = m_j[:, None] & m_c[None, :]
        wb = tl.load(w_b + b_rows[:, None] + o_c[None, :], mask=m, other=0.0)
        wa = tl.load(w_a + a_rows[:, None] + o_c[None, :], mask=m, other=0.0)
        b_acc += tl.sum(wb.to(tl.float32) * xc, 1)
        a_acc += tl.sum(wa.to(tl.float32) * xc, 1)
    b_val = to_dtype(b_acc, x.dtype.element_ty).to(tl.float32)  # b and a as their linear's output
    a_val = to_dtype(a_acc, x.dtype.element_ty).to(tl.float32)
    a_log = tl.load(A_log + j, mask=m_j, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(dt_bias + j, mask=m_j, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BH], tl.float32)
    g_val = apply_gate(a_val, a_log, bias, 0.0, 1)  # GATE_FN 1: -exp(A_log) * softplus(a + dt_bias)
    tl.store(g + n * HV + j, g_val, mask=m_j)
    tl.store(beta + n * HV + j, to_dtype(sigmoid(b_val), beta.dtype.element_ty), mask=m_j)


def _head_levels(t: torch.Tensor, lead: int):
    """t: [B, T, heads...] with `lead` = 2 leading dims -> (t, row stride, per-head (s1, s2, r))
    for heads as [HV] or [H, r]; copies t when its B, T dims cannot share one stride."""
    t, s0 = token_rows(t)
    if t.dim() == lead + 1:
        return t, s0, (t.stride(-1), 0, 1)
    return t, s0, (t.stride(-2), t.stride(-1), t.shape[-1])


def _gate_args(B: int, T: int, hv: int, kd: int, b, A_log, dt_bias, device):
    """What both gate kernels take besides their gate input: the outputs g [B, T, hv, kd] fp32 and
    beta [B, T, hv], b with its head levels, A_log and dt_bias flat (A_log stands in for a missing
    dt_bias), and whether dt_bias is there."""
    g = torch.empty(B, T, hv, kd, device=device, dtype=torch.float32)
    beta = torch.empty(B, T, hv, device=device, dtype=b.dtype)
    b, b_s0, (b_s1, b_s2, b_r) = _head_levels(b, 2)
    a_log = A_log.reshape(-1)
    dtb = dt_bias.reshape(-1) if dt_bias is not None else a_log
    return g, beta, (b, b_s0, b_s1, b_s2, b_r), a_log, dtb, dt_bias is not None


def _launch(x, b, A_log, dt_bias, lower_bound, *, kd: int, hv: int, x_levels, gate_fn: int):
    B, T = x.shape[:2]
    g, beta, b_args, a_log, dtb, has_bias = _gate_args(B, T, hv, kd, b, A_log, dt_bias, x.device)
    x, f_s0, (f_s1, f_s2, f_r) = x_levels
    b, b_s0, b_s1, b_s2, b_r = b_args
    if B * T and hv:
        gate_beta_kernel[(B * T,)](
            x, b, a_log, dtb, g, beta, float(lower_bound or 0.0),
            f_s0, f_s1, f_s2, f_r, b_s0, b_s1, b_s2, b_r,
            HV=hv, KD=kd, BC=triton.next_power_of_2(hv * kd), BH=max(2, triton.next_power_of_2(hv)),
            GATE_FN=gate_fn, HAS_BIAS=has_bias, num_warps=4, **pdl_launch(x.device))
    return g, beta


def kda_gate_beta(f: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None,
                  lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton version of hyla.ops.gate.kda_gate_beta. f: [B, T, H, K]; b: [B, T, H] (any strides)."""
    H, K = f.shape[2:]
    f, s0 = token_rows(f if f.stride(-1) == 1 else f.contiguous())
    levels = (f, s0, (f.stride(-2), 0, 1))
    return _launch(f, b, A_log, dt_bias, lower_bound, kd=K, hv=H, x_levels=levels,
                   gate_fn=1 if lower_bound is None else 2)


def kda_lowrank_gate_beta(fa: torch.Tensor, w_up: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                          dt_bias: torch.Tensor | None = None,
                          lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton version of hyla.ops.gate.kda_lowrank_gate_beta. fa: [B, T, r] (unit column stride,
    any row stride); w_up: [H * K, r]; b: [B, T, H] (any strides)."""
    B, T, r = fa.shape
    H = b.shape[2]
    K = w_up.shape[0] // H
    fa, fa_s0 = token_rows(fa if fa.stride(-1) == 1 else fa.contiguous())
    w_up = w_up if w_up.stride(-1) == 1 else w_up.contiguous()
    g, beta, (b, b_s0, b_s1, b_s2, b_r), a_log, dtb, has_bias = _gate_args(B, T, H, K, b, A_log, dt_bias, fa.device)
    if B * T and H:
        bk = min(LOWRANK_GATE_ROWS, triton.next_power_of_2(K))
        lowrank_gate_beta_kernel[(B * T, H, triton.cdiv(K, bk))](
            fa, w_up, b, a_log, dtb, g, beta, float(lower_bound or 0.0), r, fa_s0,
            w_up.stride(0), b_s0, b_s1, b_s2, b_r, H, KD=K, BK=bk,
            BRK=min(LOWRANK_ONE_LOAD_RANK, triton.next_power_of_2(r)), GATE_FN=1 if lower_bound is None else 2,
            HAS_BIAS=has_bias, num_warps=4, **pdl_launch(fa.device))
    return g, beta


def gdn_gate_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton version of hyla.ops.gate.gdn_gate_beta. a, b: [B, T, HV] or [B, T, H, r] (any strides)."""
    hv = a.shape[2] if a.dim() == 3 else a.shape[2] * a.shape[3]
    g, beta = _launch(a, b, A_log, dt_bias, None, kd=1, hv=hv, x_levels=_head_levels(a, 2), gate_fn=1)
    return g[..., 0], beta


# Value heads a program of gdn_projected_gate_beta projects, and the hidden columns it reads at a
# time: a decode step of one token spreads over HV / 2 programs (16 at Qwen3-Next-80B's HV = 32),
# each reading hidden 2,048 in one chunk.
PROJECTED_GATE_HEADS = 2
PROJECTED_GATE_COLUMNS = 2048


def _value_head_rows(w: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """w [HV, hidden] or [H, r, hidden] -> (w with unit column stride, s1, s2, r): row j = h * r + i
    starts at (j // r) * s1 + (j % r) * s2."""
    w = w if w.stride(-1) == 1 else w.contiguous()
    if w.dim() == 2:
        return w, w.stride(0), 0, 1
    return w, w.stride(0), w.stride(1), w.shape[1]


def gdn_projected_gate_beta(x: torch.Tensor, w_b: torch.Tensor, w_a: torch.Tensor, A_log: torch.Tensor,
                            dt_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton version of hyla.ops.gate.gdn_projected_gate_beta. x: [B, T, hidden] (any row
    stride); w_b, w_a: [HV, hidden] or [H, r, hidden] (any row strides, e.g. views of in_proj_ba's
    head-interleaved rows), in x's dtype -> (g fp32 [B, T, HV], beta [B, T, HV] in x's dtype)."""
    B, T, hidden = x.shape
    hv = w_b.shape[:-1].numel()
    x, x_s0 = token_rows(x if x.stride(-1) == 1 else x.contiguous())
    w_b, wb_s1, wb_s2, wb_r = _value_head_rows(w_b)
    w_a, wa_s1, wa_s2, wa_r = _value_head_rows(w_a)
    a_log = A_log.reshape(-1)
    dtb = dt_bias.reshape(-1) if dt_bias is not None else a_log  # A_log stands in for a missing dt_bias
    g = torch.empty(B, T, hv, device=x.device, dtype=torch.float32)
    beta = torch.empty(B, T, hv, device=x.device, dtype=x.dtype)
    if B * T and hv:
        projected_gate_beta_kernel[(B * T, triton.cdiv(hv, PROJECTED_GATE_HEADS))](
            x, w_b, w_a, a_log, dtb, g, beta, hidden, x_s0, wb_s1, wb_s2, wb_r, wa_s1, wa_s2, wa_r, hv,
            BH=PROJECTED_GATE_HEADS, BX=min(PROJECTED_GATE_COLUMNS, triton.next_power_of_2(hidden)),
            HAS_BIAS=dt_bias is not None, num_warps=4, **pdl_launch(x.device))
    return g, beta
