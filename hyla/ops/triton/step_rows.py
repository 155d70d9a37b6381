"""Triton kernel for the next fused MTP step's input rows (contract: hyla.ops.step_rows): one
program per batch row reads the previous step's packed outputs and the host's base row and
writes the verify row, the head row and (rollback "replay") the kept count. One launch instead
of ~15 small torch ops: this runs on the host's critical path once per overlapped step. Its
stop decision is hyla.ops.step_rows.kept_through_stop (the stop rule's device form, stated in
hyla.engine.spec.acceptance), per row: tests/ops/test_step_rows.py checks them bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.step_rows import check_step_rows
from hyla.ops.triton import _interpreter

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1


@triton.jit
def _step_rows_kernel(base, prev, vmeta, emeta, vpad, epad, kept, n, b_sr, p_sr, v_sr, e_sr, S, VW, EW,
                      W: tl.constexpr, BW: tl.constexpr, BV: tl.constexpr, BE: tl.constexpr,
                      REPLAY: tl.constexpr):
    i = tl.program_id(0)
    if i < n:
        i64 = i.to(tl.int64)
        j = tl.arange(0, BW)  # verify rows
        p_row = prev + i64 * p_sr
        acc = tl.load(p_row + W)
        top = tl.load(p_row + j, mask=j < W, other=-2)
        kept_ids = tl.where((j <= acc) & (j < W), top, -2)  # -2: matches no stop id
        first = tl.full([BW], W, tl.int64)  # per row: W, or its index when it is a stop token
        for s in range(S):
            stop = tl.load(base + i64 * b_sr + 2 + s)
            first = tl.where(kept_ids == stop, j.to(tl.int64), first)
        first_stop = tl.min(first, axis=0)
        stopped = first_stop < W
        if REPLAY:
            tl.store(kept + i, tl.where(stopped, first_stop + 1, acc + 1))
        v_row, e_row = vmeta + i64 * v_sr, emeta + i64 * e_sr
        if stopped:  # padding rows: nothing of the request is written in this step
            cv = tl.arange(0, BV)
            ce = tl.arange(0, BE)
            tl.store(v_row + cv, tl.load(vpad + cv, mask=cv < VW), mask=cv < VW)
            tl.store(e_row + ce, tl.load(epad + ce, mask=ce < EW), mask=ce < EW)
        else:
            # vmeta: [context + 1 + acc, slot, a_acc, d'_1 .. d'_k]; emeta: [head rows + 1 + acc, d'_1 ..]
            drafts = (j >= 1) & (j < W)
            d = tl.load(p_row + W + j, mask=drafts)  # d'_j at j = 1 .. k
            tl.store(v_row, tl.load(base + i64 * b_sr) + acc)
            if REPLAY:
                tl.store(v_row + 1, acc * 0 + 1)  # the state is in the row's one slot
            else:
                tl.store(v_row + 1, acc + 1)  # the slot after the kept tokens
            tl.store(v_row + 2, tl.load(p_row + acc))  # the bonus token a_acc
            tl.store(v_row + 2 + j, d, mask=drafts)
            tl.store(e_row, tl.load(base + i64 * b_sr + 1) + acc)
            tl.store(e_row + j, d, mask=drafts)
    else:  # a padding row of the batch: it advances by one in the commit
        if REPLAY:
            tl.store(kept + i, tl.full([], 1, tl.int64))


def derive_step_rows(base: torch.Tensor, prev: torch.Tensor, vmeta: torch.Tensor, emeta: torch.Tensor,
                     vpad: torch.Tensor, epad: torch.Tensor, kept: torch.Tensor | None = None) -> None:
    """The Triton version of hyla.ops.step_rows.derive_step_rows (same arguments; rows of unit
    column stride)."""
    W = check_step_rows(base, prev, vmeta, emeta, vpad, epad, kept)
    if any(t.stride(-1) != 1 for t in (base, prev, vmeta, emeta, vpad, epad)):
        raise ValueError("derive_step_rows' kernel needs rows of unit column stride")
    n = base.shape[0]
    rows = n if kept is None else kept.shape[0]
    if rows == 0:
        return
    VW, EW = vmeta.shape[1], emeta.shape[1]
    _step_rows_kernel[(rows,)](base, prev, vmeta, emeta, vpad, epad, kept if kept is not None else base, n,
                               base.stride(0), prev.stride(0), vmeta.stride(0) if n else VW,
                               emeta.stride(0) if n else EW, base.shape[1] - 2, VW, EW, W=W,
                               BW=triton.next_power_of_2(W), BV=triton.next_power_of_2(VW),
                               BE=triton.next_power_of_2(EW), REPLAY=kept is not None, num_warps=1)
