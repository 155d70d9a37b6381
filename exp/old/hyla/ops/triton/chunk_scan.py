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

BT = tl.constexpr(64)


@triton.jit
def chunk_scan_kernel(
    w, u, qg, kg, aqk, gam,
    h0, ht, o,
    cu_seqlens, chunk_off,
    ck_ptr, kr, dr, ck_out,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, HAS_CKPT: tl.constexpr, PREC: tl.constexpr,
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
    state_off = (i_n.to(tl.int64) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]

    b_s = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    if HAS_H0:
        b_s += tl.load(h0 + state_off, mask=m_kv, other=0.0).to(tl.float32)

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
