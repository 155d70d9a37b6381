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

causal_conv1d_update_packed (hyla.ops.conv's contract) runs up to three "segments" -- a range of
channels of one conv -- in one launch (grid axis 2 picks the segment): KDA's three convs, or GDN's
one conv as its q / k / v parts. x is read in place (row strides, optional column map) and each
segment's output is written as its own contiguous [N, L, D_s] block of one buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.conv import _check_packed_args, _check_update_args, _check_verify_args
from hyla.ops.triton import _interpreter
from hyla.ops.triton.norm import to_dtype
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

WRITE_NONE, WRITE_FINAL, WRITE_EACH = 0, 1, 2  # the WRITE constexpr


@triton.jit
def _ext(x_row, window, o_p, pos, o_d, m_d, sx_l, P: tl.constexpr):
    """Position `pos` of the extended row: column pos of the old window (registers, pos < P) or
    new input pos - P (memory; x's token rows sx_l elements apart)."""
    old = tl.sum(tl.where(o_p[None, :] == pos, window, 0.0), axis=1)
    new = tl.load(x_row + (pos - P) * sx_l + o_d, mask=m_d & (pos >= P), other=0.0).to(tl.float32)
    return tl.where(pos < P, old, new)


@triton.jit
def conv_kernel(x, state, weight, bias, read_idx, write_idx, y, L, D, sx_n, sx_l,
                P: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
                SILU: tl.constexpr, WRITE: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    i_n = tl.program_id(0)
    i_d = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_p = tl.arange(0, BP)
    slot = tl.load(read_idx + i_n).to(tl.int64)
    live = slot >= 0
    x_row = x + i_n.to(tl.int64) * sx_n
    y_row = y + i_n.to(tl.int64) * L * D
    m_w = m_d[:, None] & (o_p[None, :] < P) & live
    window = tl.load(state + tl.maximum(slot, 0) * D * P + o_d[:, None] * P + o_p[None, :], mask=m_w,
                     other=0.0).to(tl.float32)  # [BD, BP] the old window, in registers
    for t in range(0, L):
        w_0 = tl.load(weight + o_d * (P + 1), mask=m_d, other=0.0).to(tl.float32)
        acc = _ext(x_row, window, o_p, t, o_d, m_d, sx_l, P) * w_0
        for j in tl.static_range(1, P + 1):
            w_j = tl.load(weight + o_d * (P + 1) + j, mask=m_d, other=0.0).to(tl.float32)
            acc = acc + _ext(x_row, window, o_p, t + j, o_d, m_d, sx_l, P) * w_j
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
                    v = _ext(x_row, window, o_p, t + 1 + c, o_d, m_d, sx_l, P)
                    tl.store(state + dst * D * P + o_d * P + c, v.to(state.dtype.element_ty), mask=m_d)
    if WRITE == 1:
        if live:  # the window after the last token back to the row's slot
            for c in tl.static_range(0, P):
                v = _ext(x_row, window, o_p, L + c, o_d, m_d, sx_l, P)
                tl.store(state + slot * D * P + o_d * P + c, v.to(state.dtype.element_ty), mask=m_d)


def _launch(x3, conv_state, weight, bias, activation, read_idx, write_idx, write: int) -> torch.Tensor:
    """x3 [N, L, D] with contiguous channels (its rows may be strided: read in place) -> y [N, L, D]
    contiguous."""
    if x3.stride(2) != 1:
        x3 = x3.contiguous()
    N, L, D = x3.shape
    P = weight.shape[1] - 1
    y = torch.empty(N, L, D, device=x3.device, dtype=x3.dtype)
    if N and L and D:
        BD = min(128, triton.next_power_of_2(D))
        w = weight.contiguous()  # [D, W], converted to fp32 in the kernel
        conv_kernel[(N, triton.cdiv(D, BD))](
            x3, conv_state, w, bias.contiguous() if bias is not None else w, read_idx,
            write_idx if write_idx is not None else read_idx, y, L, D, x3.stride(0), x3.stride(1),
            P=P, BP=max(2, triton.next_power_of_2(max(P, 1))), BD=BD, HAS_BIAS=bias is not None,
            SILU=activation is not None, WRITE=write if P > 0 else WRITE_NONE, **pdl_launch(x3.device))
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
    y = _launch(x3, conv_state, weight, bias, activation, idx.contiguous(), None, WRITE_FINAL)
    return y.squeeze(1) if squeeze else y


def causal_conv1d_verify(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None, *,
                         read_indices: torch.Tensor, write_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of hyla.ops.conv.causal_conv1d_verify (same arguments and result for
    rows whose read index is >= 0; a padding row (< 0) outputs zeros)."""
    weight = _check_verify_args(x, conv_state, weight, bias, activation, read_indices, write_indices)
    _check_contiguous(conv_state)
    return _launch(x, conv_state, weight, bias, activation, read_indices.contiguous(),
                   None if write_indices is None else write_indices.contiguous(),
                   WRITE_NONE if write_indices is None else WRITE_EACH)


@triton.jit
def _ext_cols(x_row, window, o_p, pos, col, m_d, sx_l, P: tl.constexpr):
    """_ext with x's channels at columns `col` of rows sx_l apart."""
    old = tl.sum(tl.where(o_p[None, :] == pos, window, 0.0), axis=1)
    new = tl.load(x_row + (pos - P) * sx_l + col, mask=m_d & (pos >= P), other=0.0).to(tl.float32)
    return tl.where(pos < P, old, new)


@triton.jit
def segment(i_s, D0, D1, D2, C0, C1, C2, PC0, PC1, PC2, DP0, DP1, DP2):
    """(channels, first column of x / of the output, channel offset in its pool, pool channels) of
    segment i_s of a packed conv launch (one conv of the layer's up to three)."""
    z = i_s * 0  # "+ z" keeps every branch's ints tensors (Triton turns an int argument of 1 into a constexpr)
    if i_s == 0:
        return D0 + z, C0 + z, PC0 + z, DP0 + z
    elif i_s == 1:
        return D1 + z, C1 + z, PC1 + z, DP1 + z
    else:
        return D2 + z, C2 + z, PC2 + z, DP2 + z


@triton.jit
def segment_pointers(i_s, s0, s1, s2, w0, w1, w2, ONE_POOL: tl.constexpr):
    """(pool, weight) of segment i_s: the first ones when every segment shares them (ONE_POOL)."""
    state = s0
    weight = w0
    if not ONE_POOL:  # the segments' pools (and weights) differ: pick this one's pointers
        if i_s == 1:
            state = s1
            weight = w1
        elif i_s == 2:
            state = s2
            weight = w2
    return state, weight


@triton.jit
def packed_conv_kernel(x, cols, y, idx, s0, s1, s2, w0, w1, w2, N, L, sx_n, sx_l,
                       D0, D1, D2, C0, C1, C2, PC0, PC1, PC2, DP0, DP1, DP2,
                       P: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr,
                       HAS_COLS: tl.constexpr, ONE_POOL: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    i_n = tl.program_id(0)
    i_d = tl.program_id(1)
    i_s = tl.program_id(2)
    D, c0, pc, dp = segment(i_s, D0, D1, D2, C0, C1, C2, PC0, PC1, PC2, DP0, DP1, DP2)
    state, weight = segment_pointers(i_s, s0, s1, s2, w0, w1, w2, ONE_POOL)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    if HAS_COLS:
        col = tl.load(cols + c0 + o_d, mask=m_d, other=0).to(tl.int64)
    else:
        col = (c0 + o_d).to(tl.int64)
    o_p = tl.arange(0, BP)
    slot = tl.load(idx + i_n).to(tl.int64)
    live = slot >= 0
    x_row = x + i_n.to(tl.int64) * sx_n
    y_row = y + c0.to(tl.int64) * N * L + i_n.to(tl.int64) * L * D  # N, L may be constexpr 1
    ch = pc + o_d  # channel in the pool / weight
    st_row = state + tl.maximum(slot, 0) * dp * P
    m_w = m_d[:, None] & (o_p[None, :] < P) & live
    window = tl.load(st_row + ch[:, None] * P + o_p[None, :], mask=m_w, other=0.0).to(tl.float32)
    for t in range(0, L):
        w_0 = tl.load(weight + ch * (P + 1), mask=m_d, other=0.0).to(tl.float32)
        acc = _ext_cols(x_row, window, o_p, t, col, m_d, sx_l, P) * w_0
        for j in tl.static_range(1, P + 1):
            w_j = tl.load(weight + ch * (P + 1) + j, mask=m_d, other=0.0).to(tl.float32)
            acc = acc + _ext_cols(x_row, window, o_p, t + j, col, m_d, sx_l, P) * w_j
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        acc = tl.where(live, acc, 0.0)
        tl.store(y_row + t * D + o_d, to_dtype(acc, y.dtype.element_ty), mask=m_d)
    if live:  # the window after the last token back to the row's slot
        for c in tl.static_range(0, P):
            v = _ext_cols(x_row, window, o_p, L + c, col, m_d, sx_l, P)
            tl.store(st_row + ch * P + c, to_dtype(v, state.dtype.element_ty), mask=m_d)


def _launch_groups(segs: list[tuple]) -> list[list[tuple]]:
    """The segments of causal_conv1d_update_packed in launches of up to three. A launch picks its
    pool and weight pointers per program, which compiles when they are one pointer type: the
    segments of one launch share the pools' dtype and the weights' dtype (always so for a model,
    whose conv pools and weights each have one dtype: one launch per three segments); segments of
    other dtypes get launches of their own."""
    kinds: dict[tuple, list[tuple]] = {}
    for s in segs:
        kinds.setdefault((s[0].dtype, s[1].dtype), []).append(s)
    return [mine[g:g + 3] for mine in kinds.values() for g in range(0, len(mine), 3)]


def _launch_packed(x3, cols, y, idx, group, N, L, P, activation) -> None:
    """One launch over up to three segments (pool, weight, size, first column, pool offset)."""
    pad = group + [group[-1]] * (3 - len(group))
    widest = max(s[2] for s in group)
    BD = min(128, triton.next_power_of_2(widest))
    packed_conv_kernel[(N, triton.cdiv(widest, BD), len(group))](
        x3, cols if cols is not None else idx, y, idx, *(s[0] for s in pad), *(s[1] for s in pad),
        N, L, x3.stride(0), x3.stride(1), *(s[2] for s in pad), *(s[3] for s in pad),
        *(s[4] for s in pad), *(s[0].shape[1] for s in pad),
        P=P, BP=max(2, triton.next_power_of_2(max(P, 1))), BD=BD, SILU=activation is not None,
        HAS_COLS=cols is not None, ONE_POOL=all(s[0] is group[0][0] and s[1] is group[0][1] for s in group), **pdl_launch(x3.device))


def causal_conv1d_update_packed(x: torch.Tensor, conv_states, weights, sizes, activation: str | None = None,
                                conv_state_indices: torch.Tensor | None = None,
                                channels: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The Triton version of hyla.ops.conv.causal_conv1d_update_packed (same arguments and
    result): the segments three to a launch, x read in place."""
    x3, squeeze, total = _check_packed_args(x, conv_states, weights, sizes, channels)
    N, L = x3.shape[:2]
    segs, c0 = [], 0  # segs: (pool, weight [D, W], size, first column, pool channel offset)
    for st, w, part in zip(conv_states, weights, sizes):
        d = sum(part)
        fake = x3.as_strided((N, L, d), (x3.stride(0), x3.stride(1), 0))  # shape-only stand-in for the checks
        _, _, w2, idx = _check_update_args(fake, st, w, None, activation, conv_state_indices)
        _check_contiguous(st)
        w2 = w2.contiguous()
        pc = 0
        for dd in part:
            segs.append((st, w2, int(dd), c0, pc))
            c0, pc = c0 + int(dd), pc + int(dd)
    P = segs[0][1].shape[1] - 1
    if any(s[1].shape[1] - 1 != P for s in segs):
        raise ValueError("the packed convs must share one kernel size")
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    # the column indices as the layer keeps them (int64, on the device, made once): the kernel
    # loads either width, and a cast here was one more launch per layer and step
    cols = channels.to(x.device).contiguous() if channels is not None else None
    y = torch.empty(N * L * total, device=x.device, dtype=x.dtype)
    idx = idx.contiguous()
    if N and L:
        for group in _launch_groups(segs):
            _launch_packed(x3, cols, y, idx, group, N, L, P, activation)
    out = [y[N * L * c:N * L * (c + d)].view(N, L, d) for _, _, d, c, _ in segs]
    return [t.squeeze(1) for t in out] if squeeze else out
