"""Decode over a state pool with a persistent loop (Triton, forward only).

The serving decode step: N sequences of one token, sequence n's state read from and written back
to pool slot idx[n] (negative: a padding row, nothing read or written, output 0). Same results
as recurrent.recurrent_kernel with POOL and T = 1 (the same token_step); only the schedule differs.

Why a second kernel. The step is bound by the pool traffic (K * V * 4 bytes read and written per
head), and one program per (value block, sequence, head) spends most of its life waiting: it
loads its state tile, then reduces over K, then stores, and too few programs fit on an SM to keep
DRAM busy through those phases (BENCHMARKS.md "Recurrent decode and verify": 69-77% of copy
bandwidth over a V-contiguous pool). Here a fixed grid of programs walks the (value block,
sequence, head) tiles with a stride and keeps the next tiles'
loads in flight while it works on the current one. Two ways (recurrent._decode_launch picks):
- STAGES = 0, K <= 128: the next tile's state is loaded into registers before the current tile
  is worked on (16-column tiles, one warp: the K reduction never leaves the warp).
- STAGES >= 2, K = 256: a [256, 16] tile twice over does not fit one warp's registers, so the
  loop is left to Triton's pipeliner (`tl.range(num_stages=STAGES)`), which issues each tile's
  loads STAGES - 1 tiles ahead into shared memory (cp.async).
The pool may be V-contiguous or K-last (KLAST, recurrent_step.state_offsets); over a K-last pool
recurrent.py takes this kernel only for short grids and KDA's in-kernel gate (_klast_decode_launch).
It also takes rows of several tokens (ROWS) and speculative verify (SPEC: the state after each
token to its own slot) when asked (recurrent_fwd(persistent=True)); for verify it measured
slower than one program per tile at every launch tried (BENCHMARKS.md "Recurrent decode and verify":
75-85% of copy against 88-92%), so it is never the default there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hyla.ops.triton.common import head_gate_params
from hyla.ops.triton.recurrent_step import position_slot, row_span, start_slot, state_offsets, token_step
from hyla.ops.triton.pdl import dependent_launch_prologue


@triton.jit
def _tile_mask(o_k, o_v, slot, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The state tile's load / store mask: the slot's alone when the tile has no ragged edge
    (fewer predicate registers), else also the rows < K and columns < V."""
    if BK == K and V % BV == 0:
        return slot >= 0
    else:
        return (o_k < K)[:, None] & (o_v < V)[None, :] & (slot >= 0)


@triton.jit
def _state_tile(pool, idx, n_acc, tile, n_tiles, NVB: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KLAST: tl.constexpr, IDX_W: tl.constexpr,
                SPEC: tl.constexpr):
    """Tile number -> (its start state [BK, BV] fp32, its slot, row, value head, value columns); a
    tile past the end or of a padding row loads zeros with slot -1. SPEC: a verify row starts from
    idx[n, n_acc[n] - 1] (the slot of the last token accepted), else from idx[n]."""
    in_range = tile < n_tiles
    t = tl.where(in_range, tile, 0)
    i_v = t % NVB
    i_nh = t // NVB
    i_n = i_nh // HV
    i_hv = i_nh % HV
    slot = tl.where(in_range, start_slot(idx, n_acc, i_n, IDX_W, SPEC, False), -1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    off = (tl.maximum(slot, 0) * HV + i_hv) * K * V + state_offsets(o_k, o_v, K, V, KLAST)
    b_s = tl.load(pool + off, mask=_tile_mask(o_k, o_v, slot, K, V, BK, BV), other=0.0)
    return b_s.to(tl.float32), slot, i_n, i_hv, o_v


@triton.jit
def _token(b_s, live, t, i_h, i_hv, o_k, o_v, q, k, v, g, beta, a_log, bias, lower_bound, scale, o, sq, sk, sv,
           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, GATE: tl.constexpr,
           GATE_FN: tl.constexpr, USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """Token row t on one tile: the state after it; its output stored (0 for a padding row)."""
    b_s, b_o = token_step(b_s, q, k, v, g, beta, t, i_h, i_hv, o_k, o_v, a_log, bias, lower_bound, scale,
                          sq, sk, sv, H, HV, K, V, GATE, GATE_FN, USE_L2NORM, BETA_SIGMOID)
    b_o = tl.where(live, b_o, 0.0)
    tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=o_v < V)
    return b_s


@triton.jit
def _steps_and_store(b_s, slot, i_n, i_hv, o_v, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
                     o, pool, idx, cu_seqlens, T, sq, sk, sv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, GATE_FN: tl.constexpr,
                     HAS_BIAS: tl.constexpr, USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
                     KLAST: tl.constexpr, ROWS: tl.constexpr, IS_VARLEN: tl.constexpr, IDX_W: tl.constexpr,
                     SPEC: tl.constexpr):
    """One tile through its row's tokens (ROWS: T each, or cu_seqlens' lengths with IS_VARLEN;
    else the one token of row i_n) and its state written back: after the last token to its own
    slot, or (SPEC) after token j to idx[n, j] where that is >= 0. Nothing is written for a
    padding row (slot -1). The tile's offsets and mask are recomputed here rather than carried
    from the load: carried through the prefetch loop they would hold [BK, BV] int64 offsets and
    predicates in registers."""
    o_k = tl.arange(0, BK)
    i_h = i_hv // (HV // H)
    live = slot >= 0
    a_log, bias = head_gate_params(A_log, dt_bias, i_hv, o_k, K, GATE, GATE_FN, HAS_BIAS)
    if ROWS:
        bos, eos = row_span(cu_seqlens, i_n, T, IS_VARLEN)
        for t in range(bos, eos):
            b_s = _token(b_s, live, t, i_h, i_hv, o_k, o_v, q, k, v, g, beta, a_log, bias, lower_bound, scale, o,
                         sq, sk, sv, H, HV, K, V, GATE, GATE_FN, USE_L2NORM, BETA_SIGMOID)
            if SPEC:
                dst = position_slot(idx, i_n, t - bos, IDX_W)
                off = (tl.maximum(dst, 0) * HV + i_hv) * K * V + state_offsets(o_k, o_v, K, V, KLAST)
                tl.store(pool + off, b_s.to(pool.dtype.element_ty),
                         mask=_tile_mask(o_k, o_v, slot, K, V, BK, BV) & (dst >= 0))
    else:
        b_s = _token(b_s, live, i_n, i_h, i_hv, o_k, o_v, q, k, v, g, beta, a_log, bias, lower_bound, scale, o,
                     sq, sk, sv, H, HV, K, V, GATE, GATE_FN, USE_L2NORM, BETA_SIGMOID)
    if not SPEC:
        off = (tl.maximum(slot, 0) * HV + i_hv) * K * V + state_offsets(o_k, o_v, K, V, KLAST)
        tl.store(pool + off, b_s.to(pool.dtype.element_ty), mask=_tile_mask(o_k, o_v, slot, K, V, BK, BV))


@triton.jit(do_not_specialize=["lower_bound", "scale", "n_tiles", "T"])
def decode_persistent_kernel(
    q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
    o, pool, idx, n_acc, cu_seqlens, n_tiles, T, sq, sk, sv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, GATE_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, STAGES: tl.constexpr, KLAST: tl.constexpr,
    ROWS: tl.constexpr, IS_VARLEN: tl.constexpr, IDX_W: tl.constexpr, SPEC: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid: a fixed number of programs; program p works tiles p, p + grid, ... of the
    n_tiles = N * HV * cdiv(V, BV) (value block fastest, then value head, then row).
    STAGES = 0: the next tile's state is loaded into registers before the current one is worked
    (one tile ahead); STAGES >= 2: Triton's pipeliner keeps STAGES - 1 tiles in flight through
    shared memory. KLAST: the pool is stored K-last (recurrent_step.state_offsets). ROWS: a row
    holds T tokens (cu_seqlens' lengths with IS_VARLEN), else one; SPEC: a speculative verify
    (idx [N, IDX_W], n_acc [N])."""
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    NVB: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    if STAGES == 0:
        cur, slot, i_n, i_hv, o_v = _state_tile(pool, idx, n_acc, pid, n_tiles, NVB, HV, K, V, BK, BV, KLAST,
                                                IDX_W, SPEC)
        for tile in range(pid, n_tiles, step):
            # issue the next tile's state load first: it is in flight while this tile is worked on
            nxt, n_slot, n_n, n_hv, n_v = _state_tile(pool, idx, n_acc, tile + step, n_tiles, NVB, HV, K, V, BK, BV,
                                                      KLAST, IDX_W, SPEC)
            _steps_and_store(cur, slot, i_n, i_hv, o_v, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
                             o, pool, idx, cu_seqlens, T, sq, sk, sv, H, HV, K, V, BK, BV, GATE, GATE_FN, HAS_BIAS,
                             USE_L2NORM, BETA_SIGMOID, KLAST, ROWS, IS_VARLEN, IDX_W, SPEC)
            cur, slot, i_n, i_hv, o_v = nxt, n_slot, n_n, n_hv, n_v
    else:
        for tile in tl.range(pid, n_tiles, step, num_stages=STAGES):
            cur, slot, i_n, i_hv, o_v = _state_tile(pool, idx, n_acc, tile, n_tiles, NVB, HV, K, V, BK, BV, KLAST,
                                                    IDX_W, SPEC)
            _steps_and_store(cur, slot, i_n, i_hv, o_v, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
                             o, pool, idx, cu_seqlens, T, sq, sk, sv, H, HV, K, V, BK, BV, GATE, GATE_FN, HAS_BIAS,
                             USE_L2NORM, BETA_SIGMOID, KLAST, ROWS, IS_VARLEN, IDX_W, SPEC)
