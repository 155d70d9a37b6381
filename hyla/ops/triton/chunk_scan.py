"""Chunk prefill, pass 2 of 2: the sequential scan over chunks, outputs and checkpoints (Triton).

One program per (value block of BV columns, sequence, value head) holds the fp32 state
S [K, BV] in registers and walks its sequence's chunks in order. With the per-chunk factors of
pass 1 (chunk_intra.py) a chunk costs four matmuls:

    u'  = u - w S                      [64, BV]   the delta-rule writes of the 64 tokens
    o   = qg S + aqk u'                [64, BV]   inter-chunk + intra-chunk output
    S  <- Diag(gam) S + kg^T u'        [K, BV]

The output is produced here rather than by a third chunk-parallel kernel: that would need every
chunk-start state written to memory and read back (K * V per chunk, about as many bytes as q, k
and v together), while here the state is already in registers.

A checkpoint at in-chunk offset r is exported from the same pass: S_r = Diag(dr) S + kr^T u'
(kr, dr from pass 1), so the state after any token count costs one extra matmul, not a split.
"""

import triton
import triton.language as tl

from hyla.ops.triton.chunk_intra import _chunk_start
from hyla.ops.triton.recurrent_step import state_offsets

BT = tl.constexpr(64)


@triton.jit
def _state_tile(state_idx, has_init, i_n, i_hv, o_k, o_v, m_kv, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, POOL: tl.constexpr, KLAST: tl.constexpr, MASK_H0: tl.constexpr):
    """(element offsets [BK, BV] of this program's tile of sequence i_n's start and final state,
    the start state's load mask). Without POOL the states are rows n of [N, HV, K, V] tensors
    (contiguous); with POOL both are slot state_idx[n] of one pool, read and written in place,
    V-contiguous or K-last (KLAST), and with MASK_H0 the start state is read only where
    has_init[n] (else zeros: a sequence without context)."""
    if POOL:
        row = tl.load(state_idx + i_n).to(tl.int64)
        off = (row * HV + i_hv) * K * V + state_offsets(o_k, o_v, K, V, KLAST)
    else:
        off = (i_n.to(tl.int64) * HV + i_hv) * K * V + state_offsets(o_k, o_v, K, V, False)
    m_h0 = m_kv
    if MASK_H0:
        m_h0 = m_kv & (tl.load(has_init + i_n) != 0)
    return off, m_h0


@triton.jit
def chunk_scan_kernel(
    w, u, qg, kg, aqk, gam,
    h0, ht, o,
    cu_seqlens, chunk_off,
    ck_ptr, kr, dr, ck_out,
    state_idx, has_init,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, HAS_CKPT: tl.constexpr, PREC: tl.constexpr,
    POOL: tl.constexpr, KLAST: tl.constexpr, MASK_H0: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c_lo = tl.load(chunk_off + i_n)
    c_hi = tl.load(chunk_off + i_n + 1)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    state_off, m_h0 = _state_tile(state_idx, has_init, i_n, i_hv, o_k, o_v, m_kv, HV, K, V, POOL, KLAST, MASK_H0)

    b_s = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    if HAS_H0:
        b_s += tl.load(h0 + state_off, mask=m_h0, other=0.0).to(tl.float32)

    for cid in range(c_lo, c_hi):
        head = tl.cast(cid, tl.int64) * HV + i_hv
        b_w = tl.load(w + head * BT * BK + o_t[:, None] * BK + o_k[None, :])  # [BT, BK]
        b_u = tl.load(u + head * BT * BVF + o_t[:, None] * BVF + o_v[None, :]).to(tl.float32)  # [BT, BV]
        b_q = tl.load(qg + head * BT * BK + o_t[:, None] * BK + o_k[None, :])  # [BT, BK]
        b_a = tl.load(aqk + head * BT * BT + o_t[:, None] * BT + o_t[None, :])  # [BT, BT]
        b_kg = tl.load(kg + head * BT * BK + o_t[:, None] * BK + o_k[None, :])  # [BT, BK]
        b_gam = tl.load(gam + head * BK + o_k)  # [BK] fp32

        s_mm = b_s.to(b_w.dtype)
        b_vn = b_u - tl.dot(b_w, s_mm, input_precision=PREC)  # [BT, BV]
        vn_mm = b_vn.to(b_w.dtype)
        b_o = tl.dot(b_q, s_mm, input_precision=PREC) + tl.dot(b_a, vn_mm, input_precision=PREC)
        tok = bos + tl.cast(cid - c_lo, tl.int64) * BT + o_t
        p_o = o + (tok[:, None] * HV + i_hv) * V + o_v[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=(tok < eos)[:, None] & (o_v < V)[None, :])

        if HAS_CKPT:
            for ci in range(tl.load(ck_ptr + cid), tl.load(ck_ptr + cid + 1)):
                ck_head = tl.cast(ci, tl.int64) * HV + i_hv
                b_kr = tl.load(kr + ck_head * BT * BK + o_t[:, None] * BK + o_k[None, :])  # [BT, BK] fp32
                b_dr = tl.load(dr + ck_head * BK + o_k)  # [BK]
                b_sr = b_dr[:, None] * b_s + tl.dot(tl.trans(b_kr), b_vn, input_precision=PREC)
                p_ck = ck_out + ck_head * K * V + o_k[:, None] * V + o_v[None, :]
                tl.store(p_ck, b_sr.to(ck_out.dtype.element_ty), mask=m_kv)

        b_s = b_gam[:, None] * b_s + tl.dot(tl.trans(b_kg), vn_mm, input_precision=PREC)

    if STORE_HT:
        tl.store(ht + state_off, b_s.to(ht.dtype.element_ty), mask=m_kv)


@triton.jit
def _row_writes(b_k, s_mm, b_v, b_l, r_w, r_b, PREC: tl.constexpr):
    """The chunk's delta-rule writes from raw keys: u' = L^-1 (Diag(b) V - Diag(rw) (K S)) [BT, BV]
    (b_k [BT, BK] and s_mm [BK, BV] in the matmul dtype, b_v fp32, L^-1 fp32 or bf16 / fp16).
    One definition for the scan and the checkpoint kernel, so a checkpoint sees the scan's u'."""
    b_x = r_b[:, None] * b_v - r_w[:, None] * tl.dot(b_k, s_mm, input_precision=PREC)  # [BT, BV]
    if b_l.dtype == tl.float32:
        return tl.dot(b_l, b_x, input_precision=PREC)
    return tl.dot(b_l, b_x.to(b_l.dtype))


@triton.jit
def chunk_scan_rows_kernel(
    q, k, kd, v, li, aqk, rows, gam,
    h0, ht, o,
    cu_seqlens, chunk_off,
    ck_slot, ck_start,
    state_idx, has_init,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, HAS_CKPT: tl.constexpr, PREC: tl.constexpr,
    PER_CHANNEL: tl.constexpr, POOL: tl.constexpr, KLAST: tl.constexpr, MASK_H0: tl.constexpr,
):
    """chunk_scan_kernel without pass 1's factor tiles. With one decay per token, w, u, qg and kg
    are the inputs with their rows scaled (the row scales rq, rk, rw, b of chunk_gram_kernel's
    ROW_FORM), so the scales move onto the products:

        u'  = L^-1 (Diag(b) V - Diag(rw) (K S))
        o   = Diag(rq) (Q S) + aqk u'
        S  <- gam S + K^T (Diag(rk) u')

    PER_CHANNEL (KDA): q, k are the Gram kernel's Q e^G and K e^G, kd its K e^(G_C - G) (which
    takes K's place in the state update), gam is per channel and the row scales carry only the
    norms and beta; the same four equations hold with those operands.

    q, k [T, H, K] and v [T, HV, V] are read where they are (no factor kernel writes four
    [64, K] tiles per chunk for this pass to read back), at the price of one more [64, 64]
    product per chunk. The matmul operands stay as loaded, so the loop keeps its pipelined
    loads (scaling q and k elementwise here instead was measured 33% slower, BENCHMARKS.md
    "Chunk prefill vs fla").

    Checkpoints: this loop only stores the start state of each chunk that holds one
    (ck_slot[chunk] >= 0: ck_start[slot, HV, K, V]); chunk_checkpoint_rows_kernel exports them.
    A checkpoint loop with its products inside this loop (as chunk_scan_kernel has) was
    miscompiled by Triton 3.6 on an H200: wrong outputs, or shared-memory reads past the end
    of the block's allocation (compute-sanitizer), with any pipelining depth."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c_lo = tl.load(chunk_off + i_n)
    c_hi = tl.load(chunk_off + i_n + 1)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    state_off, m_h0 = _state_tile(state_idx, has_init, i_n, i_hv, o_k, o_v, m_kv, HV, K, V, POOL, KLAST, MASK_H0)
    mm = aqk.dtype.element_ty  # the matmul operand dtype (bf16 / fp16, or fp32)

    b_s = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    if HAS_H0:
        b_s += tl.load(h0 + state_off, mask=m_h0, other=0.0).to(tl.float32)

    for cid in range(c_lo, c_hi):
        head = tl.cast(cid, tl.int64) * HV + i_hv
        tok = bos + tl.cast(cid - c_lo, tl.int64) * BT + o_t
        m_t = tok < eos
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_qk = (tok[:, None] * H + i_h) * K + o_k[None, :]
        b_k = tl.load(k + p_qk, mask=m_tk, other=0.0).to(mm)  # [BT, BK]
        b_q = tl.load(q + p_qk, mask=m_tk, other=0.0).to(mm)  # [BT, BK]
        if PER_CHANNEL:  # the keys decayed to the chunk end, K e^(G_C - G) (chunk_gram_kernel's)
            b_kd = tl.load(kd + p_qk, mask=m_tk, other=0.0).to(mm)  # [BT, BK]
        else:
            b_kd = b_k
        b_v = tl.load(v + (tok[:, None] * HV + i_hv) * V + o_v[None, :],
                      mask=m_t[:, None] & (o_v < V)[None, :], other=0.0).to(tl.float32)  # [BT, BV]
        b_l = tl.load(li + head * BT * BT + o_t[:, None] * BT + o_t[None, :])  # [BT, BT] L^-1
        b_a = tl.load(aqk + head * BT * BT + o_t[:, None] * BT + o_t[None, :])  # [BT, BT]
        r_q = tl.load(rows + head * 4 * BT + o_t)
        r_k = tl.load(rows + head * 4 * BT + BT + o_t)
        r_w = tl.load(rows + head * 4 * BT + 2 * BT + o_t)
        r_b = tl.load(rows + head * 4 * BT + 3 * BT + o_t)
        b_gam = tl.load(gam + head * BK + o_k)  # [BK] fp32 (one value)

        s_mm = b_s.to(mm)
        b_vn = _row_writes(b_k, s_mm, b_v, b_l, r_w, r_b, PREC)  # [BT, BV]
        vn_mm = b_vn.to(mm)
        b_o = r_q[:, None] * tl.dot(b_q, s_mm, input_precision=PREC) + tl.dot(b_a, vn_mm, input_precision=PREC)
        p_o = o + (tok[:, None] * HV + i_hv) * V + o_v[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & (o_v < V)[None, :])

        if HAS_CKPT:  # a masked store, no branch: slot -1 writes nothing
            slot = tl.load(ck_slot + cid)
            p_st = ck_start + (tl.maximum(slot, 0).to(tl.int64) * HV + i_hv) * K * V
            tl.store(p_st + o_k[:, None] * V + o_v[None, :], b_s, mask=m_kv & (slot >= 0))

        b_s = b_gam[:, None] * b_s + tl.dot(tl.trans(b_kd), (r_k[:, None] * b_vn).to(mm), input_precision=PREC)

    if STORE_HT:
        tl.store(ht + state_off, b_s.to(ht.dtype.element_ty), mask=m_kv)


@triton.jit
def chunk_checkpoint_rows_kernel(
    k, v, li, aqk, rows, ck_start, ck_slot, ck_chunk, kr, dr, ck_out,
    cu_seqlens, chunk_seq, chunk_pos,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, PREC: tl.constexpr,
):
    """One checkpoint of chunk_scan_rows_kernel's scan, per (value block, checkpoint, value head):
    from the state S at the start of its chunk (ck_start, stored by the scan) it recomputes the
    chunk's delta-rule writes exactly as the scan does, u' = L^-1 (Diag(b) V - Diag(rw) (K S)),
    and writes S_r = dr S + K^T (Diag(kr) u') to ck_out[checkpoint, HV, K, V]
    (kr [64] = e^(G_r - G_j) / |k_j|, 0 from row r on; dr = e^(G_r); chunk_gram_kernel's)."""
    i_v = tl.program_id(0)
    ci = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    cid = tl.load(ck_chunk + ci)
    slot = tl.load(ck_slot + cid).to(tl.int64)
    t0, eos = _chunk_start(chunk_seq, chunk_pos, cu_seqlens, cid)
    head = tl.cast(cid, tl.int64) * HV + i_hv
    ck_head = tl.cast(ci, tl.int64) * HV + i_hv

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    mm = aqk.dtype.element_ty
    tok = t0 + o_t
    m_t = tok < eos
    b_s = tl.load(ck_start + (slot * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
    b_k = tl.load(k + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :],
                  other=0.0).to(mm)  # [BT, BK]
    b_v = tl.load(v + (tok[:, None] * HV + i_hv) * V + o_v[None, :],
                  mask=m_t[:, None] & (o_v < V)[None, :], other=0.0).to(tl.float32)  # [BT, BV]
    b_l = tl.load(li + head * BT * BT + o_t[:, None] * BT + o_t[None, :])  # [BT, BT] L^-1
    r_w = tl.load(rows + head * 4 * BT + 2 * BT + o_t)
    r_b = tl.load(rows + head * 4 * BT + 3 * BT + o_t)
    b_kr = tl.load(kr + ck_head * BT + o_t)  # [BT] fp32
    b_dr = tl.load(dr + ck_head * BK + o_k)  # [BK]

    b_vn = _row_writes(b_k, b_s.to(mm), b_v, b_l, r_w, r_b, PREC)  # [BT, BV]
    b_sr = b_dr[:, None] * b_s + tl.dot(tl.trans(b_k), (b_kr[:, None] * b_vn).to(mm), input_precision=PREC)
    tl.store(ck_out + ck_head * K * V + o_k[:, None] * V + o_v[None, :], b_sr.to(ck_out.dtype.element_ty), mask=m_kv)
