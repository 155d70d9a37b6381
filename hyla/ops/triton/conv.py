"""Triton short conv for decode and speculative verify: one launch per conv instead of ~20 ops.

Same contracts as hyla.ops.conv.causal_conv1d_update (decode: the pool conv_state
[num_slots, D, W-1] read and written in place at conv_state_indices; a negative index is a
padding row: zeros out, nothing written) and hyla.ops.conv.causal_conv1d_verify (L tokens per
row from the window in read_indices[n]; the window after token j written to write_indices[n, j]
when that is >= 0).

Each program owns one sequence and a block of channels. It loads the old window of its row into
registers first, then reads the L new inputs from memory as positions P.. of the "extended" row
[old window | new inputs] and computes

    y[t, d] = act(bias[d] + sum_j weight[d, j] * ext[t + j, d])        (fp32, j in order)

Because the old window is held in registers, any slot may be written while the row runs (the
verify's slot of position j can be the slot it started from), and programs own disjoint slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.conv import _check_update_args, _check_verify_args
from hyla.ops.triton import _interpreter

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

WRITE_NONE, WRITE_FINAL, WRITE_EACH = 0, 1, 2  # the WRITE constexpr


@triton.jit
def _ext(x_row, window, o_p, pos, o_d, m_d, D, P: tl.constexpr):
    """Position `pos` of the extended row: column pos of the old window (registers, pos < P) or
    new input pos - P (memory)."""
    old = tl.sum(tl.where(o_p[None, :] == pos, window, 0.0), axis=1)
    new = tl.load(x_row + (pos - P) * D + o_d, mask=m_d & (pos >= P), other=0.0).to(tl.float32)
    return tl.where(pos < P, old, new)


@triton.jit
def conv_kernel(x, state, weight, bias, read_idx, write_idx, y, L, D,
                P: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
                SILU: tl.constexpr, WRITE: tl.constexpr):
    i_n = tl.program_id(0)
    i_d = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_p = tl.arange(0, BP)
    slot = tl.load(read_idx + i_n).to(tl.int64)
    live = slot >= 0
    x_row = x + i_n.to(tl.int64) * L * D
    y_row = y + i_n.to(tl.int64) * L * D
    m_w = m_d[:, None] & (o_p[None, :] < P) & live
    window = tl.load(state + tl.maximum(slot, 0) * D * P + o_d[:, None] * P + o_p[None, :], mask=m_w,
                     other=0.0).to(tl.float32)  # [BD, BP] the old window, in registers
    for t in range(0, L):
        w_0 = tl.load(weight + o_d * (P + 1), mask=m_d, other=0.0).to(tl.float32)
        acc = _ext(x_row, window, o_p, t, o_d, m_d, D, P) * w_0
        for j in tl.static_range(1, P + 1):
            w_j = tl.load(weight + o_d * (P + 1) + j, mask=m_d, other=0.0).to(tl.float32)
            acc = acc + _ext(x_row, window, o_p, t + j, o_d, m_d, D, P) * w_j
        if HAS_BIAS:
            acc = acc + tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        acc = tl.where(live, acc, 0.0)
        tl.store(y_row + t * D + o_d, acc.to(y.dtype.element_ty), mask=m_d)
        if WRITE == 2:  # the window after token t (positions t+1 .. t+P) to its own slot
            dst = tl.load(write_idx + i_n.to(tl.int64) * L + t).to(tl.int64)
            if dst >= 0:
                for c in tl.static_range(0, P):
                    v = _ext(x_row, window, o_p, t + 1 + c, o_d, m_d, D, P)
                    tl.store(state + dst * D * P + o_d * P + c, v.to(state.dtype.element_ty), mask=m_d)
    if WRITE == 1:
        if live:  # the window after the last token back to the row's slot
            for c in tl.static_range(0, P):
                v = _ext(x_row, window, o_p, L + c, o_d, m_d, D, P)
                tl.store(state + slot * D * P + o_d * P + c, v.to(state.dtype.element_ty), mask=m_d)


def _launch(x3, conv_state, weight, bias, activation, read_idx, write_idx, write: int) -> torch.Tensor:
    N, L, D = x3.shape
    P = weight.shape[1] - 1
    y = torch.empty_like(x3)
    if N and L and D:
        BD = min(128, triton.next_power_of_2(D))
        w = weight.contiguous()  # [D, W], converted to fp32 in the kernel
        conv_kernel[(N, triton.cdiv(D, BD))](
            x3, conv_state, w, bias.contiguous() if bias is not None else w, read_idx,
            write_idx if write_idx is not None else read_idx, y, L, D,
            P=P, BP=max(2, triton.next_power_of_2(max(P, 1))), BD=BD, HAS_BIAS=bias is not None,
            SILU=activation is not None, WRITE=write if P > 0 else WRITE_NONE)
    return y


def _check_contiguous(conv_state) -> None:
    if not conv_state.is_contiguous():
        raise ValueError("conv_state must be contiguous (it is updated in place)")


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         conv_state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of hyla.ops.conv.causal_conv1d_update (same arguments and result)."""
    x3, squeeze, weight, idx = _check_update_args(x, conv_state, weight, bias, activation, conv_state_indices)
    _check_contiguous(conv_state)
    y = _launch(x3.contiguous(), conv_state, weight, bias, activation, idx.contiguous(), None, WRITE_FINAL)
    return y.squeeze(1) if squeeze else y


def causal_conv1d_verify(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None, *,
                         read_indices: torch.Tensor, write_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of hyla.ops.conv.causal_conv1d_verify (same arguments and result for
    rows whose read index is >= 0; a padding row (< 0) outputs zeros)."""
    weight = _check_verify_args(x, conv_state, weight, bias, activation, read_indices, write_indices)
    _check_contiguous(conv_state)
    return _launch(x.contiguous(), conv_state, weight, bias, activation, read_indices.contiguous(),
                   None if write_indices is None else write_indices.contiguous(),
                   WRITE_NONE if write_indices is None else WRITE_EACH)
