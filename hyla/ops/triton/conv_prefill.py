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
