"""Triton gates for a decode step: the log-decay g and the write strength beta in one launch.

Same contracts as hyla.ops.gate.kda_gate_beta / gdn_gate_beta:

    KDA:  g = -exp(A_log) * softplus(f + dt_bias)  (v1)  or  lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
          per channel [H, K];  beta = sigmoid(b) per head
    GDN:  g = -exp(A_log) * softplus(a + dt_bias)  per value head;  beta = sigmoid(b)

g is fp32, beta is rounded to b's dtype (as torch.sigmoid(b)). One program handles one token
row. The per-head inputs (b, GDN's a) may be strided views [rows, H, r] -- e.g. cut out of
in_proj_ba's head-interleaved output -- and are read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.triton import _interpreter
from hyla.ops.triton.common import apply_gate, sigmoid
from hyla.ops.triton.norm import to_dtype
from hyla.ops.triton.params import token_rows

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1


@triton.jit
def gate_beta_kernel(f, b, A_log, dt_bias, g, beta, lower_bound,
                     f_s0, f_s1, f_s2, F_R, b_s0, b_s1, b_s2, B_R,
                     HV: tl.constexpr, KD: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr,
                     GATE_FN: tl.constexpr, HAS_BIAS: tl.constexpr):
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


def _head_levels(t: torch.Tensor, lead: int):
    """t: [B, T, heads...] with `lead` = 2 leading dims -> (t, row stride, per-head (s1, s2, r))
    for heads as [HV] or [H, r]; copies t when its B, T dims cannot share one stride."""
    t, s0 = token_rows(t)
    if t.dim() == lead + 1:
        return t, s0, (t.stride(-1), 0, 1)
    return t, s0, (t.stride(-2), t.stride(-1), t.shape[-1])


def _launch(x, b, A_log, dt_bias, lower_bound, *, kd: int, hv: int, x_levels, gate_fn: int):
    B, T = x.shape[:2]
    R = B * T
    dev = x.device
    g = torch.empty(B, T, hv, kd, device=dev, dtype=torch.float32)
    beta = torch.empty(B, T, hv, device=dev, dtype=b.dtype)
    b, b_s0, (b_s1, b_s2, b_r) = _head_levels(b, 2)
    x, f_s0, (f_s1, f_s2, f_r) = x_levels
    a_log = A_log.reshape(-1)
    dtb = dt_bias.reshape(-1) if dt_bias is not None else None
    if R and hv:
        gate_beta_kernel[(R,)](
            x, b, a_log, dtb if dtb is not None else a_log, g, beta, float(lower_bound or 0.0),
            f_s0, f_s1, f_s2, f_r, b_s0, b_s1, b_s2, b_r,
            HV=hv, KD=kd, BC=triton.next_power_of_2(hv * kd), BH=max(2, triton.next_power_of_2(hv)),
            GATE_FN=gate_fn, HAS_BIAS=dtb is not None, num_warps=4)
    return g, beta


def kda_gate_beta(f: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None,
                  lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton version of hyla.ops.gate.kda_gate_beta. f: [B, T, H, K]; b: [B, T, H] (any strides)."""
    H, K = f.shape[2:]
    f, s0 = token_rows(f if f.stride(-1) == 1 else f.contiguous())
    levels = (f, s0, (f.stride(-2), 0, 1))
    return _launch(f, b, A_log, dt_bias, lower_bound, kd=K, hv=H, x_levels=levels,
                   gate_fn=1 if lower_bound is None else 2)


def gdn_gate_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton version of hyla.ops.gate.gdn_gate_beta. a, b: [B, T, HV] or [B, T, H, r] (any strides)."""
    hv = a.shape[2] if a.dim() == 3 else a.shape[2] * a.shape[3]
    g, beta = _launch(a, b, A_log, dt_bias, None, kd=1, hv=hv, x_levels=_head_levels(a, 2), gate_fn=1)
    return g[..., 0], beta
