"""Triton short conv for prefill: varlen causal depthwise conv with initial and final windows.

Same contract as hyla.ops.conv.causal_conv1d_fn (packed sequences, cu_seqlens, conv state
[N, D, W-1] oldest first). The torch op builds an "extended" stream with each sequence's window
in front and runs W shifted multiply-adds over [D, T] copies: at 8192 tokens x 4096 channels that
is ~1 ms per conv of elementwise passes and index copies. Here each program reads its block of
tokens x channels once per tap (from L2 after the first) and writes y once:

    y[t, d] = act(bias[d] + sum_j weight[d, j] * src(t - (W-1) + j, d))        (fp32, j in order)

where src(s, d) is x[s, d] inside the token's sequence and column W-1 + (s - start) of its
initial window before it (zeros without one). A second small kernel writes each sequence's
final window: its last W-1 inputs, left-filled from the initial window when it is shorter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops import utils
from hyla.ops.triton import _interpreter
from hyla.ops.triton.conv import segment, segment_pointers
from hyla.ops.triton.norm import to_dtype

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1


@triton.jit
def _conv_prefill_kernel(x, s_x, weight, bias, init, seq_of, cu, y, T, D,
                         W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HAS_INIT: tl.constexpr, SILU: tl.constexpr):
    i_t = tl.program_id(0)
    i_d = tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    # A block whose tokens all lie in one sequence, at least W-1 past its start, reads only x:
    # the common case of a long prompt, taken without the per-token sequence bookkeeping.
    t0 = i_t * BT
    n_first = tl.load(seq_of + t0)
    interior = (n_first == tl.load(seq_of + tl.minimum(t0 + BT, T) - 1)) & (t0 - (W - 1) >= tl.load(cu + n_first))
    if interior:
        for j in tl.static_range(W):
            w_j = tl.load(weight + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)  # [BD]
            v = tl.load(x + (o_t - (W - 1) + j).to(tl.int64)[:, None] * s_x + o_d[None, :],
                        mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            acc += v * w_j[None, :]
    else:
        n = tl.load(seq_of + o_t, mask=m_t, other=0)  # [BT] sequence of each token
        start = tl.load(cu + n, mask=m_t, other=0)  # [BT]
        for j in tl.static_range(W):
            s = o_t - (W - 1) + j  # [BT] source position
            w_j = tl.load(weight + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)  # [BD]
            inside = s >= start
            v = tl.load(x + tl.maximum(s, 0).to(tl.int64)[:, None] * s_x + o_d[None, :],
                        mask=(m_t & inside)[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            if HAS_INIT:
                col = (W - 1) + s - start  # [BT] column of the initial window (valid when not inside)
                before = m_t & (s < start)
                v0 = tl.load(init + n.to(tl.int64)[:, None] * D * (W - 1) + o_d[None, :] * (W - 1) + col[:, None],
                             mask=before[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                v = v + v0
            acc += v * w_j[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y + o_t.to(tl.int64)[:, None] * D + o_d[None, :], acc.to(y.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


@triton.jit
def _final_window_kernel(x, s_x, init, cu, final, D, W: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr,
                         HAS_INIT: tl.constexpr):
    n = tl.program_id(0)
    i_d = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_p = tl.arange(0, BP)
    m_p = o_p < W - 1
    start = tl.load(cu + n)
    end = tl.load(cu + n + 1)
    pos = end - (W - 1) + o_p  # [BP] positions of the last W-1 inputs
    inside = pos >= start
    v = tl.load(x + tl.maximum(pos, 0).to(tl.int64)[None, :] * s_x + o_d[:, None],
                mask=m_d[:, None] & (m_p & inside)[None, :], other=0.0)
    v = v.to(final.dtype.element_ty)
    if HAS_INIT:
        col = (W - 1) + pos - start
        v0 = tl.load(init + n.to(tl.int64) * D * (W - 1) + o_d[:, None] * (W - 1) + col[None, :],
                     mask=m_d[:, None] & (m_p & ~inside)[None, :], other=0.0)
        v = tl.where(inside[None, :], v, v0.to(final.dtype.element_ty))
    tl.store(final + n.to(tl.int64) * D * (W - 1) + o_d[:, None] * (W - 1) + o_p[None, :], v,
             mask=m_d[:, None] & m_p[None, :])


def _token_tables(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cu [N+1] int32 -> (cu, the sequence of each of the total tokens [total] int32)."""
    seq_of = torch.searchsorted(cu[1:], torch.arange(total, device=cu.device, dtype=torch.int32), right=True)
    return cu, seq_of.to(torch.int32)


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False,
                     cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [B, T, D]; weight: [D, W] (or [D, 1, W]); bias: [D] | None; activation: None | "silu";
    initial_state: [N, D, W-1] | None; cu_seqlens: [N+1] | None (then N = B). Returns y [B, T, D]
    in x.dtype and the final windows [N, D, W-1] (initial_state's dtype, else x.dtype) or None.
    Arguments are checked as the torch op checks them (hyla.ops.conv)."""
    from hyla.ops.conv import _check_activation, _check_weight_bias

    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor [B, T, D]")
    B, T, D = x.shape
    weight = _check_weight_bias(weight, bias, D).contiguous()
    _check_activation(activation)
    W = weight.shape[1]
    dev = x.device
    total = B * T
    if cu_seqlens is None:
        cu, seq_of = _token_tables(torch.arange(B + 1, device=dev, dtype=torch.int32) * T, total)
    else:
        if B != 1:
            raise ValueError(f"with cu_seqlens, x must have batch size 1 (packed), got B={B}")
        # an engine step's convs (three a KDA layer) share its cu_seqlens: the tables once a step
        cu, seq_of = utils.cached_on(cu_seqlens, f"conv_tables_{dev}_{total}",
                                     lambda: _token_tables(cu_seqlens.to(device=dev, dtype=torch.int32), total))
    N = cu.numel() - 1
    if initial_state is not None and (not isinstance(initial_state, torch.Tensor)
                                      or initial_state.shape != (N, D, W - 1)):
        got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else initial_state
        raise ValueError(f"initial_state must be [N={N}, D={D}, W-1={W - 1}], got {got}")
    xs = x.reshape(B * T, D)  # a view when x is a column block of a wider projection output
    if xs.stride(1) != 1:
        xs = xs.contiguous()
    init = initial_state.contiguous() if initial_state is not None else xs
    y = torch.empty(B * T, D, dtype=x.dtype, device=dev)
    if total:
        BT, BD = 32, 128
        _conv_prefill_kernel[(triton.cdiv(total, BT), triton.cdiv(D, BD))](
            xs, xs.stride(0), weight, bias if bias is not None else weight, init, seq_of, cu, y, total, D, W=W,
            BT=BT, BD=BD, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
            SILU=activation is not None, num_warps=4)
    final = None
    if output_final_state:
        dtype = initial_state.dtype if initial_state is not None else x.dtype
        final = torch.empty(N, D, W - 1, dtype=dtype, device=dev)
        if N and W > 1:
            _final_window_kernel[(N, triton.cdiv(D, 128))](
                xs, xs.stride(0), init, cu, final, D, W=W, BP=triton.next_power_of_2(max(W - 1, 1)), BD=128,
                HAS_INIT=initial_state is not None, num_warps=4)
    return y.view(B, T, D), final


# -- several convs of one projection output, their windows in pools ----------------------------
#
# causal_conv1d_prefill_packed (hyla.ops.conv's contract): an engine step's convs of a KDA layer
# (three pools) or a GDN layer (one pool, three parts) in three launches whatever their number, x
# read in place, the initial windows read from the pools and the final windows written back:
# where a layer ran, per conv, a gather of its initial windows, a mask, the conv, the final-window
# kernel and a scatter into the pool (plus the step tables), ~12 launches and ~40 ops of host.
#   1. _packed_prefill_kernel: the outputs (grid: token blocks x channel blocks x segments);
#   2. _packed_windows_kernel over the checkpoints (windows after p tokens to their own slots);
#   3. the same over every sequence's final window, to its own slot: after 1 and 2, which read
#      the initial windows from those slots.


@triton.jit
def _packed_prefill_kernel(x, s_x, cols, y, slots, ctx, seq_of, cu, s0, s1, s2, w0, w1, w2, T,
                           D0, D1, D2, C0, C1, C2, PC0, PC1, PC2, DP0, DP1, DP2,
                           W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr,
                           HAS_COLS: tl.constexpr, ONE_POOL: tl.constexpr):
    i_t = tl.program_id(0)
    i_d = tl.program_id(1)
    i_s = tl.program_id(2)
    D, c0, pc, dp = segment(i_s, D0, D1, D2, C0, C1, C2, PC0, PC1, PC2, DP0, DP1, DP2)
    state, weight = segment_pointers(i_s, s0, s1, s2, w0, w1, w2, ONE_POOL)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    if HAS_COLS:
        col = tl.load(cols + c0 + o_d, mask=m_d, other=0).to(tl.int64)
    else:
        col = (c0 + o_d).to(tl.int64)
    ch = pc + o_d  # channel in the pool and the weight
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    t0 = i_t * BT
    n_first = tl.load(seq_of + t0)
    interior = (n_first == tl.load(seq_of + tl.minimum(t0 + BT, T) - 1)) & (t0 - (W - 1) >= tl.load(cu + n_first))
    if interior:  # as _conv_prefill_kernel: a block inside one sequence, W-1 past its start
        for j in tl.static_range(W):
            w_j = tl.load(weight + ch * W + j, mask=m_d, other=0.0).to(tl.float32)
            v = tl.load(x + (o_t - (W - 1) + j).to(tl.int64)[:, None] * s_x + col[None, :],
                        mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            acc += v * w_j[None, :]
    else:
        n = tl.load(seq_of + o_t, mask=m_t, other=0)  # [BT]
        start = tl.load(cu + n, mask=m_t, other=0)
        slot = tl.load(slots + n, mask=m_t, other=0).to(tl.int64)
        live = tl.load(ctx + n, mask=m_t, other=0) != 0  # the sequence resumes from its slot's window
        for j in tl.static_range(W):
            s = o_t - (W - 1) + j
            w_j = tl.load(weight + ch * W + j, mask=m_d, other=0.0).to(tl.float32)
            inside = s >= start
            v = tl.load(x + tl.maximum(s, 0).to(tl.int64)[:, None] * s_x + col[None, :],
                        mask=(m_t & inside)[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            before = m_t & (s < start) & live
            v0 = tl.load(state + slot[:, None] * dp * (W - 1) + ch[None, :] * (W - 1) + ((W - 1) + s - start)[:, None],
                         mask=before[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            acc += (v + v0) * w_j[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y + c0.to(tl.int64) * T + o_t.to(tl.int64)[:, None] * D + o_d[None, :], to_dtype(acc, y.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


@triton.jit
def _packed_windows_kernel(x, s_x, cols, slots, ctx, cu, seq, count, dest, s0, s1, s2,
                           D0, D1, D2, C0, C1, C2, PC0, PC1, PC2, DP0, DP1, DP2,
                           W: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, HAS_COLS: tl.constexpr,
                           ONE_POOL: tl.constexpr, FINAL: tl.constexpr):
    """Entry e's window (its sequence's positions p .. p+W-2 of [initial window ++ new tokens]) to
    slot dest[e]; FINAL: entry e is sequence e, p its length, the slot its own."""
    e = tl.program_id(0)
    i_d = tl.program_id(1)
    i_s = tl.program_id(2)
    D, c0, pc, dp = segment(i_s, D0, D1, D2, C0, C1, C2, PC0, PC1, PC2, DP0, DP1, DP2)
    state, _ = segment_pointers(i_s, s0, s1, s2, s0, s1, s2, ONE_POOL)
    if FINAL:
        n = e
        p = tl.load(cu + e + 1) - tl.load(cu + e)
        to = tl.load(slots + e).to(tl.int64)
    else:
        n = tl.load(seq + e)
        p = tl.load(count + e)
        to = tl.load(dest + e).to(tl.int64)
    start = tl.load(cu + n)
    slot = tl.load(slots + n).to(tl.int64)
    live = tl.load(ctx + n) != 0
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    if HAS_COLS:
        col = tl.load(cols + c0 + o_d, mask=m_d, other=0).to(tl.int64)
    else:
        col = (c0 + o_d).to(tl.int64)
    ch = pc + o_d
    o_c = tl.arange(0, BP)
    m_c = o_c < W - 1
    pos = p + o_c  # [BP] columns of the extended row
    from_x = pos >= W - 1
    v = tl.load(x + (start + tl.maximum(pos - (W - 1), 0)).to(tl.int64)[None, :] * s_x + col[:, None],
                mask=m_d[:, None] & (m_c & from_x)[None, :], other=0.0)
    v0 = tl.load(state + slot * dp * (W - 1) + ch[:, None] * (W - 1) + tl.minimum(pos, W - 2)[None, :],
                 mask=m_d[:, None] & (m_c & ~from_x & live)[None, :], other=0.0)
    out = tl.where(from_x[None, :], to_dtype(v.to(tl.float32), state.dtype.element_ty), v0)
    tl.store(state + to * dp * (W - 1) + ch[:, None] * (W - 1) + o_c[None, :], out, mask=m_d[:, None] & m_c[None, :])


def causal_conv1d_prefill_packed(x: torch.Tensor, conv_states, weights, sizes, activation: str | None = None, *,
                                 state_indices: torch.Tensor, has_context: torch.Tensor, cu_seqlens: torch.Tensor,
                                 channels: torch.Tensor | None = None,
                                 checkpoints: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                                 ) -> list[torch.Tensor]:
    """The Triton version of hyla.ops.conv.causal_conv1d_prefill_packed (same arguments and result)."""
    from hyla.ops.conv import _check_activation, _check_prefill_packed_args
    from hyla.ops.triton.conv import _check_contiguous, _launch_groups

    x2, total, N = _check_prefill_packed_args(x, conv_states, weights, sizes, channels, state_indices,
                                              has_context, cu_seqlens, checkpoints)
    _check_activation(activation)
    T, dev = x2.shape[0], x2.device
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    segs, c0 = [], 0  # (pool, weight [D, W], channels, first column, pool channel offset)
    for pool, w, part in zip(conv_states, weights, sizes):
        _check_contiguous(pool)
        w2 = (w.reshape(w.shape[0], w.shape[-1]) if w.dim() == 3 else w).contiguous()
        if w2.shape[0] != pool.shape[1] or w2.shape[1] != pool.shape[2] + 1:
            raise ValueError(f"weight {tuple(w.shape)} does not match conv state {tuple(pool.shape)}")
        pc = 0
        for d in part:
            segs.append((pool, w2, int(d), c0, pc))
            c0, pc = c0 + int(d), pc + int(d)
    W = segs[0][1].shape[1]
    if any(s[1].shape[1] != W for s in segs):
        raise ValueError("the packed convs must share one kernel size")
    cu, seq_of = utils.cached_on(cu_seqlens, f"conv_tables_{dev}_{T}",
                                 lambda: _token_tables(cu_seqlens.to(device=dev, dtype=torch.int32), T))
    cols = channels.to(dev).contiguous() if channels is not None else None
    slots, ctx = state_indices.contiguous(), has_context.contiguous()
    y = torch.empty(T * total, device=dev, dtype=x2.dtype)
    groups = _launch_groups(segs)

    def seg_args(group):
        pad = group + [group[-1]] * (3 - len(group))
        one = all(s[0] is group[0][0] and s[1] is group[0][1] for s in group)
        return pad, one, max(s[2] for s in group)

    for group in groups:  # 1. the outputs
        pad, one, widest = seg_args(group)
        if T:
            BT, BD = 32, min(128, triton.next_power_of_2(widest))
            _packed_prefill_kernel[(triton.cdiv(T, BT), triton.cdiv(widest, BD), len(group))](
                x2, x2.stride(0), cols if cols is not None else slots, y, slots, ctx, seq_of, cu,
                *(s[0] for s in pad), *(s[1] for s in pad), T, *(s[2] for s in pad), *(s[3] for s in pad),
                *(s[4] for s in pad), *(s[0].shape[1] for s in pad),
                W=W, BT=BT, BD=BD, SILU=activation is not None, HAS_COLS=cols is not None, ONE_POOL=one,
                num_warps=4)
    if W > 1:  # 2. checkpoint windows, then 3. final windows (the slots 1 and 2 read the initial windows from)
        for final, entries in ((False, checkpoints), (True, None)):
            count = N if final else (0 if entries is None else entries[0].numel())
            if not count:
                continue
            seq, p, dest = (slots, slots, slots) if final else (t.contiguous() for t in entries)
            for group in groups:
                pad, one, widest = seg_args(group)
                BD = min(128, triton.next_power_of_2(widest))
                _packed_windows_kernel[(count, triton.cdiv(widest, BD), len(group))](
                    x2, x2.stride(0), cols if cols is not None else slots, slots, ctx, cu, seq, p, dest,
                    *(s[0] for s in pad), *(s[2] for s in pad), *(s[3] for s in pad), *(s[4] for s in pad),
                    *(s[0].shape[1] for s in pad),
                    W=W, BP=max(2, triton.next_power_of_2(W - 1)), BD=BD, HAS_COLS=cols is not None, ONE_POOL=one,
                    FINAL=final, num_warps=4)
    out = [y[T * c:T * (c + d)].view(T, d) for _, _, d, c, _ in segs]
    return [t[None] for t in out] if x.dim() == 3 else out
