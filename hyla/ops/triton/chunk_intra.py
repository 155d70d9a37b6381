"""Chunk prefill, pass 1 of 2: everything that depends on one 64-token chunk only (Triton).

One program per (chunk, value head). It loads q, k, v, the gate and beta of its 64 tokens as four
16-token sub-blocks, applies the fused pieces (gate activation, beta sigmoid, q/k L2 norm), and
writes what the sequential pass (chunk_scan.py) needs, so that pass is four matmuls per chunk:

    w   = L^-1 Diag(b) (K * e^G)            [64, K]   u   = L^-1 Diag(b) V       [64, V]
    qg  = scale * Q * e^G                    [64, K]   kg  = K * e^(G_C - G)      [64, K]
    aqk = scale * tril(A_qk)                 [64, 64]  gam = e^(G_C)              [K]
    L   = I + Diag(b) strict_tril(A_kk),  A_xk[i, j] = sum_d x_id k_jd e^(G_id - G_jd)

(G = cumulative log-decay from the chunk start, G_C its value at the chunk end; see
hyla/ops/chunk.py for the algebra.) For every requested checkpoint at in-chunk offset r it also
writes kr = K * e^(G_r - G) (rows >= r zeroed) and dr = e^(G_r), the two factors that turn the
chunk-start state and this chunk's u into the state after exactly r tokens.

Numerics. G is never formed as one running sum whose differences are taken later: each 16-token
sub-block a keeps its own inclusive cumsum Gl (relative to the sub-block start) and its total
Tot_a, and every exponent is assembled from same-sign pieces (within-sub-block differences and
whole sub-block totals), so no fp32 cancellation between two large cumulative sums occurs and no
positive exponent is evaluated except in the bounded diagonal fast path below:

  - off-diagonal sub-blocks (row block a > column block b) factor at the start of block a:
    e^(G_i - G_j) = e^(Gl_i) * e^(Rem_j + Btw_ab), Rem_j = Tot_b - Gl_j, Btw_ab = sum of the
    totals strictly between b and a; both factors are <= 1, so the product is a matmul.
  - diagonal sub-blocks, when every channel's sub-block decay |Tot_a| <= 80 (always true for the
    safe gate with lower_bound >= -5): factor at the sub-block midpoint, both factors within
    e^(+-40), a matmul; the masked upper triangle may hold large (finite) values and is dropped.
  - diagonal sub-blocks with a steeper decay (unbounded gates): exact pairwise exponents
    e^(min(Gl_i - Gl_j, 0)), one row at a time.
"""

import triton
import triton.language as tl

from hyla.ops.triton.common import apply_gate, l2norm_rows, sigmoid

BT = tl.constexpr(64)  # chunk
BC = tl.constexpr(16)  # sub-block
# Bounded-diagonal fast path: a sub-block whose per-channel decay stays within e^-80 is
# factored at its midpoint (factors <= e^40; products of masked entries <= e^80 stay finite).
DIAG_FAST_MAX_DECAY = tl.constexpr(80.0)


@triton.jit
def _load_sub_block(q, k, v, g, beta, t_start, eos, i_h, i_hv, a_log, bias, lower_bound,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, GATE_FN: tl.constexpr,
                    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """Sixteen tokens from t_start. Rows at or past eos come back as zeros in every output
    (k = v = g = beta = 0 leaves the state untouched, so padding needs no special case later).
    Returns q, k [16, BK], v [16, BV], g [16, BK] (per channel) or [16, 1], beta [16]; fp32."""
    o_t = t_start + tl.arange(0, BC)  # [16] int64 token rows
    m_t = o_t < eos
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_q = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_v = tl.load(v + (o_t[:, None] * HV + i_hv) * V + o_v[None, :],
                  mask=m_t[:, None] & (o_v < V)[None, :], other=0.0).to(tl.float32)
    if USE_L2NORM:
        b_q = l2norm_rows(b_q)
        b_k = l2norm_rows(b_k)
    if GATE == 2:
        b_g = tl.load(g + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_g = tl.where(m_tk, apply_gate(b_g, a_log, bias, lower_bound, GATE_FN), 0.0)  # [16, BK]
    elif GATE == 1:
        b_g = tl.load(g + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_g = tl.where(m_t, apply_gate(b_g, a_log, bias, lower_bound, GATE_FN), 0.0)[:, None]  # [16, 1]
    else:
        b_g = tl.zeros([BC, 1], dtype=tl.float32)
    b_b = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b_b = tl.where(m_t, sigmoid(b_b), 0.0)
    return b_q, b_k, b_v, b_g, b_b


@triton.jit
def _last_row(x):
    """Row 15 of a [16, N] tile, as [N] (exactly the stored value, unlike a separate sum)."""
    rows = tl.arange(0, BC)
    return tl.sum(tl.where((rows == BC - 1)[:, None], x, 0.0), axis=0)


@triton.jit
def _diag_block(b_q, b_k, b_gl, b_egl, b_erem, b_tot, PREC: tl.constexpr):
    """Decayed Gram matrices inside one sub-block: A_qk (j <= i) and A_kk (j < i), [16, 16] each.
    b_gl: inclusive cumsum [16, GK]; b_egl = e^Gl; b_erem = e^(Tot - Gl); b_tot: Tot [GK]."""
    rows = tl.arange(0, BC)
    if tl.min(b_tot, axis=0) >= -DIAG_FAST_MAX_DECAY:
        # e^(Gl_i - Gl_j) = [e^Gl_i e^(-Tot/2)] * [e^(Tot - Gl_j) e^(-Tot/2)], both <= e^40.
        half = tl.exp(-0.5 * b_tot)[None, :]  # [1, GK]
        rq = b_q * (b_egl * half)
        rk = b_k * (b_egl * half)
        ck = b_k * (b_erem * half)
        a_qk = tl.dot(rq, tl.trans(ck), input_precision=PREC)
        a_kk = tl.dot(rk, tl.trans(ck), input_precision=PREC)
    else:
        # Exact: row i sees e^(Gl_i - Gl_j) for j <= i only; min(., 0) keeps the masked part finite.
        a_qk = tl.zeros([BC, BC], dtype=tl.float32)
        a_kk = tl.zeros([BC, BC], dtype=tl.float32)
        for i in range(BC):
            sel = (rows == i)[:, None]
            gl_i = tl.sum(tl.where(sel, b_gl, 0.0), axis=0)  # [GK]
            q_i = tl.sum(tl.where(sel, b_q, 0.0), axis=0)  # [BK]
            k_i = tl.sum(tl.where(sel, b_k, 0.0), axis=0)
            dec = tl.where((rows <= i)[:, None], tl.exp(tl.minimum(gl_i[None, :] - b_gl, 0.0)), 0.0)
            kd = b_k * dec  # [16(j), BK]
            a_qk = tl.where(sel, tl.sum(kd * q_i[None, :], axis=1)[None, :], a_qk)
            a_kk = tl.where(sel, tl.sum(kd * k_i[None, :], axis=1)[None, :], a_kk)
    a_qk = tl.where(rows[:, None] >= rows[None, :], a_qk, 0.0)
    a_kk = tl.where(rows[:, None] > rows[None, :], a_kk, 0.0)
    return a_qk, a_kk


@triton.jit
def _inv_unit_lower(n):
    """(I + n)^-1 for a strictly lower-triangular [16, 16] n, by forward substitution (fp32)."""
    rows = tl.arange(0, BC)
    li = (rows[:, None] == rows[None, :]).to(tl.float32)
    for i in range(1, BC):
        sel = (rows == i)[:, None]
        n_i = tl.sum(tl.where(sel, n, 0.0), axis=0)  # [16] row i of n (zero for j >= i)
        li = tl.where(sel, li - tl.sum(n_i[:, None] * li, axis=0)[None, :], li)
    return li


@triton.jit
def _store_tile(ptr, x, ROWS: tl.constexpr, COLS: tl.constexpr, STRIDE: tl.constexpr):
    o_r = tl.arange(0, ROWS)
    o_c = tl.arange(0, COLS)
    tl.store(ptr + o_r[:, None] * STRIDE + o_c[None, :], x.to(ptr.dtype.element_ty))


@triton.jit
def _checkpoint_factors(kr, dr, ci, r, b_k0, b_k1, b_k2, b_k3, gl0, gl1, gl2, gl3,
                        er0, er1, er2, er3, tot0, tot1, tot2, tot3, i_hv,
                        HV: tl.constexpr, BK: tl.constexpr):
    """kr[ci] = K * e^(G_r - G) with rows >= r zero, dr[ci] = e^(G_r): the state after r tokens
    of this chunk is dr * S_start + kr^T u (r in 1..64, all runtime)."""
    rows = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    t = r - 1  # last token included
    a_r = t // BC
    sel = (rows == t % BC)[:, None]
    # G_r - (chunk start) = P[a_r] + Gl_t, with Gl_t read from sub-block a_r.
    gl_t = (tl.where(a_r == 0, tl.sum(tl.where(sel, gl0, 0.0), axis=0), 0.0)
            + tl.where(a_r == 1, tl.sum(tl.where(sel, gl1, 0.0), axis=0), 0.0)
            + tl.where(a_r == 2, tl.sum(tl.where(sel, gl2, 0.0), axis=0), 0.0)
            + tl.where(a_r == 3, tl.sum(tl.where(sel, gl3, 0.0), axis=0), 0.0))  # [GK]
    p_r = tl.where(a_r > 0, tot0, 0.0) + tl.where(a_r > 1, tot1, 0.0) + tl.where(a_r > 2, tot2, 0.0)
    base = kr + (ci * HV + i_hv) * BT * BK
    for b in tl.static_range(4):
        if b == 0:
            b_k, gl, er = b_k0, gl0, er0
        elif b == 1:
            b_k, gl, er = b_k1, gl1, er1
        elif b == 2:
            b_k, gl, er = b_k2, gl2, er2
        else:
            b_k, gl, er = b_k3, gl3, er3
        # Earlier sub-block: (Tot_b - Gl_j) + totals strictly between b and a_r + Gl_t, all <= 0.
        btw = tl.zeros_like(tot0)
        if b < 1:
            btw += tl.where(a_r > 1, tot1, 0.0)
        if b < 2:
            btw += tl.where(a_r > 2, tot2, 0.0)
        f_before = er * tl.exp(btw + gl_t)[None, :]
        # Same sub-block: exact pairwise exponent for j <= t.
        f_same = tl.where((rows <= t % BC)[:, None], tl.exp(tl.minimum(gl_t[None, :] - gl, 0.0)), 0.0)
        f = tl.where(b < a_r, f_before, tl.where(b == a_r, f_same, 0.0))
        _store_tile(base + b * BC * BK, b_k * f, BC, BK, BK)
    d = tl.exp(p_r + gl_t)  # [GK]
    tl.store(dr + (ci * HV + i_hv) * BK + o_k, tl.zeros([BK], dtype=tl.float32) + d)


@triton.jit(do_not_specialize=["lower_bound", "scale"])
def chunk_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
    cu_seqlens, chunk_seq, chunk_pos,
    w, u, qg, kg, aqk, gam,
    ck_ptr, ck_pos, kr, dr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, GATE_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, HAS_CKPT: tl.constexpr,
    PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n = tl.load(chunk_seq + i_c)
    c = tl.load(chunk_pos + i_c)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + c.to(tl.int64) * BT
    o_k = tl.arange(0, BK)

    a_log = 0.0
    bias = 0.0
    if GATE_FN > 0:
        a_log = tl.load(A_log + i_hv).to(tl.float32)
        if HAS_BIAS:
            if GATE == 2:
                bias = tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)[None, :]
            else:
                bias = tl.load(dt_bias + i_hv).to(tl.float32)

    # ---- load the four sub-blocks, fused gate / beta / L2 norm -------------------------------
    q0, k0, v0, g0, b0 = _load_sub_block(q, k, v, g, beta, t0, eos, i_h, i_hv, a_log, bias, lower_bound,
                                         H, HV, K, V, BK, BV, GATE, GATE_FN, USE_L2NORM, BETA_SIGMOID)
    q1, k1, v1, g1, b1 = _load_sub_block(q, k, v, g, beta, t0 + BC, eos, i_h, i_hv, a_log, bias, lower_bound,
                                         H, HV, K, V, BK, BV, GATE, GATE_FN, USE_L2NORM, BETA_SIGMOID)
    q2, k2, v2, g2, b2 = _load_sub_block(q, k, v, g, beta, t0 + 2 * BC, eos, i_h, i_hv, a_log, bias,
                                         lower_bound, H, HV, K, V, BK, BV, GATE, GATE_FN, USE_L2NORM,
                                         BETA_SIGMOID)
    q3, k3, v3, g3, b3 = _load_sub_block(q, k, v, g, beta, t0 + 3 * BC, eos, i_h, i_hv, a_log, bias,
                                         lower_bound, H, HV, K, V, BK, BV, GATE, GATE_FN, USE_L2NORM,
                                         BETA_SIGMOID)

    # ---- per-sub-block cumulative decays --------------------------------------------------------
    gl0 = tl.cumsum(g0, axis=0)  # [16, GK], inclusive, relative to the sub-block start
    gl1 = tl.cumsum(g1, axis=0)
    gl2 = tl.cumsum(g2, axis=0)
    gl3 = tl.cumsum(g3, axis=0)
    tot0 = _last_row(gl0)  # [GK], <= 0
    tot1 = _last_row(gl1)
    tot2 = _last_row(gl2)
    tot3 = _last_row(gl3)
    eg0 = tl.exp(gl0)  # decay from the sub-block start to token i (<= 1)
    eg1 = tl.exp(gl1)
    eg2 = tl.exp(gl2)
    eg3 = tl.exp(gl3)
    er0 = tl.exp(tot0[None, :] - gl0)  # decay from token j to the sub-block end (<= 1)
    er1 = tl.exp(tot1[None, :] - gl1)
    er2 = tl.exp(tot2[None, :] - gl2)
    er3 = tl.exp(tot3[None, :] - gl3)

    # ---- decayed Gram matrices, 16x16 blocks [row block][column block] ---------------------------
    qk00, kk00 = _diag_block(q0, k0, gl0, eg0, er0, tot0, PREC)
    qk11, kk11 = _diag_block(q1, k1, gl1, eg1, er1, tot1, PREC)
    qk22, kk22 = _diag_block(q2, k2, gl2, eg2, er2, tot2, PREC)
    qk33, kk33 = _diag_block(q3, k3, gl3, eg3, er3, tot3, PREC)
    # Column factors e^(G_ref(a) - G_j), reference = start of row block a: all <= 1.
    c0 = k0 * er0  # [16, BK], decay to the end of sub-block 0
    c1 = k1 * er1
    c2 = k2 * er2
    c20 = c0 * tl.exp(tot1)[None, :]
    c30 = c0 * tl.exp(tot1 + tot2)[None, :]
    c31 = c1 * tl.exp(tot2)[None, :]
    rq1, rk1 = q1 * eg1, k1 * eg1
    rq2, rk2 = q2 * eg2, k2 * eg2
    rq3, rk3 = q3 * eg3, k3 * eg3
    qk10 = tl.dot(rq1, tl.trans(c0), input_precision=PREC)
    kk10 = tl.dot(rk1, tl.trans(c0), input_precision=PREC)
    qk20 = tl.dot(rq2, tl.trans(c20), input_precision=PREC)
    kk20 = tl.dot(rk2, tl.trans(c20), input_precision=PREC)
    qk21 = tl.dot(rq2, tl.trans(c1), input_precision=PREC)
    kk21 = tl.dot(rk2, tl.trans(c1), input_precision=PREC)
    qk30 = tl.dot(rq3, tl.trans(c30), input_precision=PREC)
    kk30 = tl.dot(rk3, tl.trans(c30), input_precision=PREC)
    qk31 = tl.dot(rq3, tl.trans(c31), input_precision=PREC)
    kk31 = tl.dot(rk3, tl.trans(c31), input_precision=PREC)
    qk32 = tl.dot(rq3, tl.trans(c2), input_precision=PREC)
    kk32 = tl.dot(rk3, tl.trans(c2), input_precision=PREC)

    # ---- L^-1 for L = I + Diag(b) strict_tril(A_kk), block forward substitution (fp32) ---------
    n10 = b1[:, None] * kk10
    n20 = b2[:, None] * kk20
    n21 = b2[:, None] * kk21
    n30 = b3[:, None] * kk30
    n31 = b3[:, None] * kk31
    n32 = b3[:, None] * kk32
    li00 = _inv_unit_lower(b0[:, None] * kk00)
    li11 = _inv_unit_lower(b1[:, None] * kk11)
    li22 = _inv_unit_lower(b2[:, None] * kk22)
    li33 = _inv_unit_lower(b3[:, None] * kk33)
    # (L^-1)_ab = -(L_aa)^-1 sum_{b <= c < a} N_ac (L^-1)_cb
    li10 = -tl.dot(tl.dot(li11, n10, input_precision="ieee"), li00, input_precision="ieee")
    li21 = -tl.dot(tl.dot(li22, n21, input_precision="ieee"), li11, input_precision="ieee")
    li20 = -tl.dot(li22, tl.dot(n20, li00, input_precision="ieee") + tl.dot(n21, li10, input_precision="ieee"),
                   input_precision="ieee")
    li32 = -tl.dot(tl.dot(li33, n32, input_precision="ieee"), li22, input_precision="ieee")
    li31 = -tl.dot(li33, tl.dot(n31, li11, input_precision="ieee") + tl.dot(n32, li21, input_precision="ieee"),
                   input_precision="ieee")
    li30 = -tl.dot(li33, tl.dot(n30, li00, input_precision="ieee") + tl.dot(n31, li10, input_precision="ieee")
                   + tl.dot(n32, li20, input_precision="ieee"), input_precision="ieee")

    # ---- chunk-level decays: prefix P_a (start -> block a), suffix (block b end -> chunk end) ----
    p1 = tot0
    p2 = tot0 + tot1
    p3 = p2 + tot2
    ep1 = tl.exp(p1)[None, :]
    ep2 = tl.exp(p2)[None, :]
    ep3 = tl.exp(p3)[None, :]

    # w = L^-1 Diag(b) (K * e^G), u = L^-1 Diag(b) V
    x0 = b0[:, None] * k0 * eg0
    x1 = b1[:, None] * k1 * eg1 * ep1
    x2 = b2[:, None] * k2 * eg2 * ep2
    x3 = b3[:, None] * k3 * eg3 * ep3
    y0 = b0[:, None] * v0
    y1 = b1[:, None] * v1
    y2 = b2[:, None] * v2
    y3 = b3[:, None] * v3
    w0 = tl.dot(li00, x0, input_precision=PREC)
    w1 = tl.dot(li10, x0, input_precision=PREC) + tl.dot(li11, x1, input_precision=PREC)
    w2 = (tl.dot(li20, x0, input_precision=PREC) + tl.dot(li21, x1, input_precision=PREC)
          + tl.dot(li22, x2, input_precision=PREC))
    w3 = (tl.dot(li30, x0, input_precision=PREC) + tl.dot(li31, x1, input_precision=PREC)
          + tl.dot(li32, x2, input_precision=PREC) + tl.dot(li33, x3, input_precision=PREC))
    u0 = tl.dot(li00, y0, input_precision=PREC)
    u1 = tl.dot(li10, y0, input_precision=PREC) + tl.dot(li11, y1, input_precision=PREC)
    u2 = (tl.dot(li20, y0, input_precision=PREC) + tl.dot(li21, y1, input_precision=PREC)
          + tl.dot(li22, y2, input_precision=PREC))
    u3 = (tl.dot(li30, y0, input_precision=PREC) + tl.dot(li31, y1, input_precision=PREC)
          + tl.dot(li32, y2, input_precision=PREC) + tl.dot(li33, y3, input_precision=PREC))

    # ---- stores (intermediates are [chunk, head, 64, BK|BV] so the scan loads whole tiles) ----
    head = i_c.to(tl.int64) * HV + i_hv
    w_base = w + head * BT * BK
    u_base = u + head * BT * BV
    _store_tile(w_base, w0, BC, BK, BK)
    _store_tile(w_base + BC * BK, w1, BC, BK, BK)
    _store_tile(w_base + 2 * BC * BK, w2, BC, BK, BK)
    _store_tile(w_base + 3 * BC * BK, w3, BC, BK, BK)
    _store_tile(u_base, u0, BC, BV, BV)
    _store_tile(u_base + BC * BV, u1, BC, BV, BV)
    _store_tile(u_base + 2 * BC * BV, u2, BC, BV, BV)
    _store_tile(u_base + 3 * BC * BV, u3, BC, BV, BV)

    q_base = qg + head * BT * BK
    _store_tile(q_base, q0 * eg0 * scale, BC, BK, BK)
    _store_tile(q_base + BC * BK, q1 * eg1 * ep1 * scale, BC, BK, BK)
    _store_tile(q_base + 2 * BC * BK, q2 * eg2 * ep2 * scale, BC, BK, BK)
    _store_tile(q_base + 3 * BC * BK, q3 * eg3 * ep3 * scale, BC, BK, BK)

    k_base = kg + head * BT * BK
    _store_tile(k_base, c0 * tl.exp(tot1 + tot2 + tot3)[None, :], BC, BK, BK)
    _store_tile(k_base + BC * BK, c1 * tl.exp(tot2 + tot3)[None, :], BC, BK, BK)
    _store_tile(k_base + 2 * BC * BK, c2 * tl.exp(tot3)[None, :], BC, BK, BK)
    _store_tile(k_base + 3 * BC * BK, k3 * er3, BC, BK, BK)

    gc = tl.exp(p3 + tot3)  # [GK]
    tl.store(gam + head * BK + o_k, tl.zeros([BK], dtype=tl.float32) + gc)

    zero = tl.zeros([BC, BC], dtype=tl.float32)
    a_base = aqk + head * BT * BT
    _store_tile(a_base, qk00 * scale, BC, BC, BT)
    _store_tile(a_base + BC, zero, BC, BC, BT)
    _store_tile(a_base + 2 * BC, zero, BC, BC, BT)
    _store_tile(a_base + 3 * BC, zero, BC, BC, BT)
    a_base += BC * BT
    _store_tile(a_base, qk10 * scale, BC, BC, BT)
    _store_tile(a_base + BC, qk11 * scale, BC, BC, BT)
    _store_tile(a_base + 2 * BC, zero, BC, BC, BT)
    _store_tile(a_base + 3 * BC, zero, BC, BC, BT)
    a_base += BC * BT
    _store_tile(a_base, qk20 * scale, BC, BC, BT)
    _store_tile(a_base + BC, qk21 * scale, BC, BC, BT)
    _store_tile(a_base + 2 * BC, qk22 * scale, BC, BC, BT)
    _store_tile(a_base + 3 * BC, zero, BC, BC, BT)
    a_base += BC * BT
    _store_tile(a_base, qk30 * scale, BC, BC, BT)
    _store_tile(a_base + BC, qk31 * scale, BC, BC, BT)
    _store_tile(a_base + 2 * BC, qk32 * scale, BC, BC, BT)
    _store_tile(a_base + 3 * BC, qk33 * scale, BC, BC, BT)

    if HAS_CKPT:
        lo = tl.load(ck_ptr + i_c)
        hi = tl.load(ck_ptr + i_c + 1)
        for ci in range(lo, hi):
            r = tl.load(ck_pos + ci)
            _checkpoint_factors(kr, dr, ci, r, k0, k1, k2, k3, gl0, gl1, gl2, gl3,
                                er0, er1, er2, er3, tot0, tot1, tot2, tot3, i_hv, HV, BK)
