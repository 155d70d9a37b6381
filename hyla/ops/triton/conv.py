"""Triton short-conv update for decode: one launch per layer's conv instead of ~20 small ops.

Same contract as hyla.ops.conv.causal_conv1d_update (x [N, L, D] or [N, D]; the pool
conv_state [num_slots, D, W-1] read and written in place at conv_state_indices; a negative index
is a padding row: zeros out, nothing written). Each program owns one sequence and a block of
channels; it reads the W-1 old inputs of its slot and the L new ones straight from memory, as
positions of the "extended" row [old window | new inputs], computes

    y[t, d] = act(bias[d] + sum_j weight[d, j] * ext[t + j, d])        (fp32, j in order)

and then writes the last W-1 extended positions back as the slot's new window. Reads of a window
column always precede the write that replaces it (column c is written after column c + L was
read), so the update in place is safe within a program, and programs own disjoint slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops import utils
from hyla.ops.conv import _check_activation, _check_weight_bias
from hyla.ops.triton import _interpreter

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1


@triton.jit
def _ext_load(x_row, state_row, pos, o_d, m_d, D, P: tl.constexpr):
    """Position `pos` of the extended row: old window column pos (< P) or new input pos - P."""
    old = tl.load(state_row + o_d * P + pos, mask=m_d & (pos < P), other=0.0).to(tl.float32)
    new = tl.load(x_row + (pos - P) * D + o_d, mask=m_d & (pos >= P), other=0.0).to(tl.float32)
    return tl.where(pos < P, old, new)


@triton.jit
def conv_update_kernel(x, state, weight, bias, idx, y, L, D,
                       P: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    i_n = tl.program_id(0)
    i_d = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    slot = tl.load(idx + i_n).to(tl.int64)
    x_row = x + i_n.to(tl.int64) * L * D
    y_row = y + i_n.to(tl.int64) * L * D
    state_row = state + tl.maximum(slot, 0) * D * P
    live = slot >= 0
    for t in range(0, L):
        w_0 = tl.load(weight + o_d * (P + 1), mask=m_d, other=0.0).to(tl.float32)
        acc = _ext_load(x_row, state_row, t, o_d, m_d, D, P) * w_0
        for j in tl.static_range(1, P + 1):
            w_j = tl.load(weight + o_d * (P + 1) + j, mask=m_d, other=0.0).to(tl.float32)
            acc = acc + _ext_load(x_row, state_row, t + j, o_d, m_d, D, P) * w_j
        if HAS_BIAS:
            acc = acc + tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        acc = tl.where(live, acc, 0.0)
        tl.store(y_row + t * D + o_d, acc.to(y.dtype.element_ty), mask=m_d)
    if live:
        for c in tl.static_range(0, P):
            v = _ext_load(x_row, state_row, L + c, o_d, m_d, D, P)
            tl.store(state_row + o_d * P + c, v.to(state.dtype.element_ty), mask=m_d)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         conv_state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of hyla.ops.conv.causal_conv1d_update (same arguments and result)."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor [N, L, D] or [N, D]")
    squeeze = x.dim() == 2
    x3 = (x.unsqueeze(1) if squeeze else x).contiguous()
    N, L, D = x3.shape
    weight = _check_weight_bias(weight, bias, D)
    _check_activation(activation)
    P = weight.shape[1] - 1
    if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3 or conv_state.shape[1:] != (D, P):
        got = tuple(conv_state.shape) if isinstance(conv_state, torch.Tensor) else conv_state
        raise ValueError(f"conv_state must be [num_slots, D={D}, W-1={P}], got {got}")
    if not conv_state.is_contiguous():
        raise ValueError("conv_state must be contiguous (it is updated in place)")
    if conv_state_indices is None:
        if conv_state.shape[0] < N:
            raise ValueError(f"conv_state has {conv_state.shape[0]} slots, fewer than N={N} rows")
        idx = torch.arange(N, device=x.device)
    else:
        if (not isinstance(conv_state_indices, torch.Tensor) or conv_state_indices.shape != (N,)
                or conv_state_indices.is_floating_point()):
            got = getattr(conv_state_indices, "shape", conv_state_indices)
            raise ValueError(f"conv_state_indices must be an integer tensor [N={N}], got {got}")
        idx = conv_state_indices.contiguous()
        if not utils.is_capturing(idx) and bool((idx >= conv_state.shape[0]).any()):
            raise ValueError(f"conv_state_indices out of range for {conv_state.shape[0]} slots")
    y = torch.empty_like(x3)
    if N and L and D:
        BD = min(128, triton.next_power_of_2(D))
        w = weight.contiguous()  # [D, W], converted to fp32 in the kernel
        b = bias.contiguous() if bias is not None else w
        conv_update_kernel[(N, triton.cdiv(D, BD))](
            x3, conv_state, w, b, idx, y, L, D,
            P=P, BD=BD, HAS_BIAS=bias is not None, SILU=activation is not None)
    return y.squeeze(1) if squeeze else y
