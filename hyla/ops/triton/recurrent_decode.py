"""Decode over a state pool with a persistent, prefetching loop (Triton, forward only).

The serving decode step: N sequences of one token, sequence n's state read from and written back
to pool slot idx[n] (negative: a padding row, nothing read or written, output 0). Same results
as recurrent.recurrent_kernel with POOL and T = 1 (the same token_step); only the schedule differs.

Why a second kernel. The step is bound by the pool traffic (K * V * 4 bytes read and written per
head), and one program per (value block, sequence, head) spends most of its life waiting: it
loads its state tile, then reduces over K across warps, then stores, and at 120-170 registers
per thread too few programs fit on an SM to keep DRAM busy through those phases (BENCHMARKS.md:
67-74% of copy bandwidth). Here a fixed grid of programs walks the (value block, sequence, head)
tiles with a stride, and each loads the *next* tile's state before it works on the current one,
so a tile's DRAM latency overlaps the previous tile's reduction and store.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hyla.ops.triton.common import head_gate_params
from hyla.ops.triton.recurrent_step import token_step


@triton.jit
def _state_tile(pool, idx, tile, n_tiles, NVB: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Tile number -> (its state [BK, BV] fp32, slot, sequence, value head, value columns); a tile
    past the end or of a padding row loads zeros with slot -1."""
    in_range = tile < n_tiles
    t = tl.where(in_range, tile, 0)
    i_v = t % NVB
    i_nh = t // NVB
    i_n = i_nh // HV
    i_hv = i_nh % HV
    slot = tl.load(idx + i_n).to(tl.int64)
    slot = tl.where(in_range, slot, -1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :] & (slot >= 0)
    off = (tl.maximum(slot, 0) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    return tl.load(pool + off, mask=m_kv, other=0.0).to(tl.float32), slot, i_n, i_hv, o_v


@triton.jit(do_not_specialize=["lower_bound", "scale", "n_tiles"])
def decode_persistent_kernel(
    q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
    o, pool, idx, n_tiles, sq, sk, sv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, GATE_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
):
    NVB: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    cur, slot, i_n, i_hv, o_v = _state_tile(pool, idx, pid, n_tiles, NVB, HV, K, V, BK, BV)
    for tile in range(pid, n_tiles, step):
        # issue the next tile's state load first: it is in flight while this tile is worked on
        nxt, n_slot, n_n, n_hv, n_v = _state_tile(pool, idx, tile + step, n_tiles, NVB, HV, K, V, BK, BV)
        i_h = i_hv // (HV // H)
        m_v = o_v < V
        live = slot >= 0
        a_log, bias = head_gate_params(A_log, dt_bias, i_hv, o_k, K, GATE, GATE_FN, HAS_BIAS)
        b_s, b_o = token_step(cur, q, k, v, g, beta, i_n, i_h, i_hv, o_k, o_v, a_log, bias, lower_bound, scale,
                              sq, sk, sv, H, HV, K, V, GATE, GATE_FN, USE_L2NORM, BETA_SIGMOID)
        b_o = tl.where(live, b_o, 0.0)
        tl.store(o + (i_n * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        off = (tl.maximum(slot, 0) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(pool + off, b_s.to(pool.dtype.element_ty), mask=m_k[:, None] & m_v[None, :] & live)
        cur, slot, i_n, i_hv, o_v = nxt, n_slot, n_n, n_hv, n_v
