"""Chunk prefill, pass 1 of 2: everything that depends on one 64-token chunk only (Triton).

One program per (chunk, value head). It reads q, k, v, the gate and beta of its 64 tokens as four
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

Registers. Four sub-blocks of q, k and the decays at K = 128 are far more than a thread's 255
registers, so the channel axis is walked in slices of BKS columns, three times:
  1. accumulate the 20 [16, 16] Gram blocks (and the q/k row norms; the L2 norm is applied to
     the finished Gram blocks, which are bilinear in q and k), then invert L;
  2. recompute the slice's decays and write qg, kg, w = L^-1 x (and checkpoint factors);
  3. walk V in slices and write u = L^-1 Diag(b) V.
Re-reading a slice hits L1/L2 (one chunk is ~80 KB); recomputing its decays costs a few exp per
element, far cheaper than spilling.
"""

import triton
import triton.language as tl

from hyla.ops.triton.common import apply_gate, sigmoid

BT = tl.constexpr(64)  # chunk
BC = tl.constexpr(16)  # sub-block
# Bounded-diagonal fast path: a sub-block whose per-channel decay stays within e^-80 is
# factored at its midpoint (factors <= e^40; products of masked entries <= e^80 stay finite).
DIAG_FAST_MAX_DECAY = tl.constexpr(80.0)


@triton.jit
def _load_qkg(q, k, g, t_start, eos, i_h, i_hv, o_k, a_log, bias, lower_bound,
              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr, GATE_FN: tl.constexpr):
    """Raw q, k [16, BKS] of one sub-block and channel slice o_k, and its log-decay: [16, BKS]
    per channel (GATE 2) or [16] per head. Rows at or past eos are 0 (g = 0: no decay)."""
    o_t = t_start + tl.arange(0, BC)  # [16] int64 token rows
    m_t = o_t < eos
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_q = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    if GATE == 2:
        b_g = tl.load(g + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_g = tl.where(m_tk, apply_gate(b_g, a_log, bias, lower_bound, GATE_FN), 0.0)
    elif GATE == 1:
        b_g = tl.load(g + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_g = tl.where(m_t, apply_gate(b_g, a_log, bias, lower_bound, GATE_FN), 0.0)
    else:
        b_g = tl.zeros([BC], dtype=tl.float32)
    return b_q, b_k, b_g


@triton.jit
def _load_rows(x, t_start, eos, i_h, o_k, H: tl.constexpr, K: tl.constexpr):
    """[16, BKS] slice of q or k (fp32), zero past eos."""
    o_t = t_start + tl.arange(0, BC)
    m = (o_t < eos)[:, None] & (o_k < K)[None, :]
    return tl.load(x + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _slice_bias(dt_bias, bias, i_hv, o_k, K: tl.constexpr, GATE: tl.constexpr, GATE_FN: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """dt_bias for this channel slice ([1, BKS], per-channel gates) or the per-head scalar."""
    if GATE == 2 and GATE_FN > 0 and HAS_BIAS:
        return tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)[None, :]
    else:
        return bias


@triton.jit
def _load_beta(beta, t_start, eos, i_hv, HV: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    o_t = t_start + tl.arange(0, BC)
    b = tl.load(beta + o_t * HV + i_hv, mask=o_t < eos, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b = tl.where(o_t < eos, sigmoid(b), 0.0)
    return b  # [16]


@triton.jit
def _last_row(x):
    """Row 15 of a [16, N] tile, as [N] (exactly the stored value, unlike a separate sum)."""
    rows = tl.arange(0, BC)
    return tl.sum(tl.where((rows == BC - 1)[:, None], x, 0.0), axis=0)


@triton.jit
def _decays(b_g, GATE: tl.constexpr):
    """gl: inclusive cumsum inside the sub-block [16, GK] (GK = BKS or 1), tot = gl[15] [GK],
    eg = e^gl (start -> token), er = e^(tot - gl) (token -> end); all exponents <= 0."""
    gl = tl.cumsum(b_g, axis=0)
    if GATE != 2:
        gl = gl[:, None]
    tot = _last_row(gl)
    return gl, tot, tl.exp(gl), tl.exp(tot[None, :] - gl)


@triton.jit
def _diag_block(b_q, b_k, b_gl, b_egl, b_erem, b_tot, PREC: tl.constexpr):
    """Decayed Gram matrices inside one sub-block over one channel slice: A_qk (j <= i) and
    A_kk (j < i), [16, 16] each. b_gl: inclusive cumsum [16, GK]; b_egl = e^Gl;
    b_erem = e^(Tot - Gl); b_tot: Tot [GK]."""
    rows = tl.arange(0, BC)
    if tl.min(b_tot, axis=0) >= -DIAG_FAST_MAX_DECAY:
        # e^(Gl_i - Gl_j) = [e^Gl_i e^(-Tot/2)] * [e^(Tot - Gl_j) e^(-Tot/2)], both <= e^40.
        half = tl.exp(-0.5 * b_tot)[None, :]  # [1, GK]
        ck = b_k * (b_erem * half)
        a_qk = tl.dot(b_q * (b_egl * half), tl.trans(ck), input_precision=PREC)
        a_kk = tl.dot(b_k * (b_egl * half), tl.trans(ck), input_precision=PREC)
    else:
        # Exact: row i sees e^(Gl_i - Gl_j) for j <= i only; min(., 0) keeps the masked part finite.
        a_qk = tl.zeros([BC, BC], dtype=tl.float32)
        a_kk = tl.zeros([BC, BC], dtype=tl.float32)
        for i in range(BC):
            sel = (rows == i)[:, None]
            gl_i = tl.sum(tl.where(sel, b_gl, 0.0), axis=0)  # [GK]
            q_i = tl.sum(tl.where(sel, b_q, 0.0), axis=0)  # [BKS]
            k_i = tl.sum(tl.where(sel, b_k, 0.0), axis=0)
            dec = tl.where((rows <= i)[:, None], tl.exp(tl.minimum(gl_i[None, :] - b_gl, 0.0)), 0.0)
            kd = b_k * dec  # [16(j), BKS]
            a_qk = tl.where(sel, tl.sum(kd * q_i[None, :], axis=1)[None, :], a_qk)
            a_kk = tl.where(sel, tl.sum(kd * k_i[None, :], axis=1)[None, :], a_kk)
    a_qk = tl.where(rows[:, None] >= rows[None, :], a_qk, 0.0)
    a_kk = tl.where(rows[:, None] > rows[None, :], a_kk, 0.0)
    return a_qk, a_kk


@triton.jit
def _diag_sub_block(q, k, g, t_a, eos, i_h, i_hv, a_log, dt_bias, bias, lower_bound, nq, nk, b, scale,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
                    GATE: tl.constexpr, GATE_FN: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr):
    """Sub-block starting at token t_a: its scaled A_qk diagonal block and (I + Diag(b) A_kk)^-1.
    nq, nk: row L2-norm factors [16]; b: beta [16]."""
    a_qk = tl.zeros([BC, BC], dtype=tl.float32)
    a_kk = tl.zeros([BC, BC], dtype=tl.float32)
    for ks in range(0, BK, BKS):
        o_k = ks + tl.arange(0, BKS)
        bias_s = _slice_bias(dt_bias, bias, i_hv, o_k, K, GATE, GATE_FN, HAS_BIAS)
        b_q, b_k, b_g = _load_qkg(q, k, g, t_a, eos, i_h, i_hv, o_k, a_log, bias_s, lower_bound,
                                  H, HV, K, GATE, GATE_FN)
        gl, tot, eg, er = _decays(b_g, GATE)
        d_qk, d_kk = _diag_block(b_q * nq[:, None], b_k * nk[:, None], gl, eg, er, tot, PREC)
        a_qk += d_qk
        a_kk += d_kk
    return a_qk * scale, _inv_unit_lower(b[:, None] * a_kk)


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
def _tril_apply(li00, li10, li11, li20, li21, li22, li30, li31, li32, li33, x0, x1, x2, x3,
                base, STRIDE: tl.constexpr, PREC: tl.constexpr):
    """Store L^-1 [x0; x1; x2; x3] (four [16, N] row blocks) at base (row stride STRIDE)."""
    N: tl.constexpr = x0.shape[1]
    _store_tile(base, tl.dot(li00, x0, input_precision=PREC), BC, N, STRIDE)
    y = tl.dot(li10, x0, input_precision=PREC)
    _store_tile(base + BC * STRIDE, tl.dot(li11, x1, y, input_precision=PREC), BC, N, STRIDE)
    y = tl.dot(li20, x0, input_precision=PREC)
    y = tl.dot(li21, x1, y, input_precision=PREC)
    _store_tile(base + 2 * BC * STRIDE, tl.dot(li22, x2, y, input_precision=PREC), BC, N, STRIDE)
    y = tl.dot(li30, x0, input_precision=PREC)
    y = tl.dot(li31, x1, y, input_precision=PREC)
    y = tl.dot(li32, x2, y, input_precision=PREC)
    _store_tile(base + 3 * BC * STRIDE, tl.dot(li33, x3, y, input_precision=PREC), BC, N, STRIDE)


@triton.jit
def _checkpoint_factors(kr_base, dr_base, r, k0, k1, k2, k3, gl0, gl1, gl2, gl3,
                        er0, er1, er2, er3, tot0, tot1, tot2, tot3, BK: tl.constexpr):
    """One channel slice of kr = K * e^(G_r - G) (rows >= r zero) and dr = e^(G_r): the state
    after r tokens of this chunk is Diag(dr) S_start + kr^T u (r in 1..64, a runtime value).
    k*: normalised keys of the slice; kr_base / dr_base already point at the slice."""
    rows = tl.arange(0, BC)
    t = r - 1  # last token included
    a_r = t // BC
    sel = (rows == t % BC)[:, None]
    # G_r - (chunk start) = P[a_r] + Gl_t, with Gl_t read from sub-block a_r.
    gl_t = (tl.where(a_r == 0, tl.sum(tl.where(sel, gl0, 0.0), axis=0), 0.0)
            + tl.where(a_r == 1, tl.sum(tl.where(sel, gl1, 0.0), axis=0), 0.0)
            + tl.where(a_r == 2, tl.sum(tl.where(sel, gl2, 0.0), axis=0), 0.0)
            + tl.where(a_r == 3, tl.sum(tl.where(sel, gl3, 0.0), axis=0), 0.0))  # [GK]
    p_r = tl.where(a_r > 0, tot0, 0.0) + tl.where(a_r > 1, tot1, 0.0) + tl.where(a_r > 2, tot2, 0.0)
    for b in tl.static_range(4):
        if b == 0:
            b_k, gl, er = k0, gl0, er0
        elif b == 1:
            b_k, gl, er = k1, gl1, er1
        elif b == 2:
            b_k, gl, er = k2, gl2, er2
        else:
            b_k, gl, er = k3, gl3, er3
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
        _store_tile(kr_base + b * BC * BK, b_k * f, BC, b_k.shape[1], BK)
    d = tl.exp(p_r + gl_t)  # [GK]
    o_c = tl.arange(0, k0.shape[1])
    tl.store(dr_base + o_c, tl.zeros([k0.shape[1]], dtype=tl.float32) + d)


@triton.jit(do_not_specialize=["lower_bound", "scale"])
def chunk_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
    cu_seqlens, chunk_seq, chunk_pos,
    w, u, qg, kg, aqk, gam,
    ck_ptr, ck_pos, kr, dr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BKS: tl.constexpr, BVS: tl.constexpr,
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
    t1 = t0 + BC
    t2 = t0 + 2 * BC
    t3 = t0 + 3 * BC
    rows = tl.arange(0, BC)

    a_log = 0.0
    bias = 0.0
    if GATE_FN > 0:
        a_log = tl.load(A_log + i_hv).to(tl.float32)
        if HAS_BIAS:
            if GATE == 1:
                bias = tl.load(dt_bias + i_hv).to(tl.float32)

    # ---- pass 0: q/k row norms (their first read; later passes hit L1/L2) ----------------------
    if USE_L2NORM:
        sq0 = tl.zeros([BC], dtype=tl.float32)
        sq1, sq2, sq3 = tl.zeros_like(sq0), tl.zeros_like(sq0), tl.zeros_like(sq0)
        sk0, sk1, sk2, sk3 = tl.zeros_like(sq0), tl.zeros_like(sq0), tl.zeros_like(sq0), tl.zeros_like(sq0)
        for ks in range(0, BK, BKS):
            o_k = ks + tl.arange(0, BKS)
            x = _load_rows(q, t0, eos, i_h, o_k, H, K)
            sq0 += tl.sum(x * x, axis=1)
            x = _load_rows(q, t1, eos, i_h, o_k, H, K)
            sq1 += tl.sum(x * x, axis=1)
            x = _load_rows(q, t2, eos, i_h, o_k, H, K)
            sq2 += tl.sum(x * x, axis=1)
            x = _load_rows(q, t3, eos, i_h, o_k, H, K)
            sq3 += tl.sum(x * x, axis=1)
            x = _load_rows(k, t0, eos, i_h, o_k, H, K)
            sk0 += tl.sum(x * x, axis=1)
            x = _load_rows(k, t1, eos, i_h, o_k, H, K)
            sk1 += tl.sum(x * x, axis=1)
            x = _load_rows(k, t2, eos, i_h, o_k, H, K)
            sk2 += tl.sum(x * x, axis=1)
            x = _load_rows(k, t3, eos, i_h, o_k, H, K)
            sk3 += tl.sum(x * x, axis=1)
        nq0, nq1, nq2, nq3 = (1.0 / tl.sqrt(sq0 + 1e-6), 1.0 / tl.sqrt(sq1 + 1e-6),
                              1.0 / tl.sqrt(sq2 + 1e-6), 1.0 / tl.sqrt(sq3 + 1e-6))
        nk0, nk1, nk2, nk3 = (1.0 / tl.sqrt(sk0 + 1e-6), 1.0 / tl.sqrt(sk1 + 1e-6),
                              1.0 / tl.sqrt(sk2 + 1e-6), 1.0 / tl.sqrt(sk3 + 1e-6))
    else:
        nq0 = tl.full([BC], 1.0, dtype=tl.float32)
        nq1, nq2, nq3, nk0, nk1, nk2, nk3 = nq0, nq0, nq0, nq0, nq0, nq0, nq0

    # beta (fused sigmoid; 0 on padding rows so they write nothing)
    b0 = _load_beta(beta, t0, eos, i_hv, HV, BETA_SIGMOID)
    b1 = _load_beta(beta, t1, eos, i_hv, HV, BETA_SIGMOID)
    b2 = _load_beta(beta, t2, eos, i_hv, HV, BETA_SIGMOID)
    b3 = _load_beta(beta, t3, eos, i_hv, HV, BETA_SIGMOID)

    # ---- pass 1a: diagonal blocks, one sub-block at a time (few registers live) ---------------
    head = i_c.to(tl.int64) * HV + i_hv
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    a_base = aqk + head * BT * BT
    qk00, li00 = _diag_sub_block(q, k, g, t0, eos, i_h, i_hv, a_log, dt_bias, bias, lower_bound, nq0, nk0, b0,
                                 scale, H, HV, K, BK, BKS, GATE, GATE_FN, HAS_BIAS, PREC)
    _store_tile(a_base, qk00, BC, BC, BT)
    qk11, li11 = _diag_sub_block(q, k, g, t1, eos, i_h, i_hv, a_log, dt_bias, bias, lower_bound, nq1, nk1, b1,
                                 scale, H, HV, K, BK, BKS, GATE, GATE_FN, HAS_BIAS, PREC)
    _store_tile(a_base + BC * BT + BC, qk11, BC, BC, BT)
    qk22, li22 = _diag_sub_block(q, k, g, t2, eos, i_h, i_hv, a_log, dt_bias, bias, lower_bound, nq2, nk2, b2,
                                 scale, H, HV, K, BK, BKS, GATE, GATE_FN, HAS_BIAS, PREC)
    _store_tile(a_base + 2 * BC * BT + 2 * BC, qk22, BC, BC, BT)
    qk33, li33 = _diag_sub_block(q, k, g, t3, eos, i_h, i_hv, a_log, dt_bias, bias, lower_bound, nq3, nk3, b3,
                                 scale, H, HV, K, BK, BKS, GATE, GATE_FN, HAS_BIAS, PREC)
    _store_tile(a_base + 3 * BC * BT + 3 * BC, qk33, BC, BC, BT)
    # upper triangle of A_qk
    _store_tile(a_base + BC, zero, BC, BC, BT)
    _store_tile(a_base + 2 * BC, zero, BC, BC, BT)
    _store_tile(a_base + 3 * BC, zero, BC, BC, BT)
    _store_tile(a_base + BC * BT + 2 * BC, zero, BC, BC, BT)
    _store_tile(a_base + BC * BT + 3 * BC, zero, BC, BC, BT)
    _store_tile(a_base + 2 * BC * BT + 3 * BC, zero, BC, BC, BT)

    # ---- pass 1b: off-diagonal blocks [row block][column block], summed over channel slices -----
    qk10 = tl.zeros([BC, BC], dtype=tl.float32)
    qk20, qk21 = tl.zeros_like(qk10), tl.zeros_like(qk10)
    qk30, qk31, qk32 = tl.zeros_like(qk10), tl.zeros_like(qk10), tl.zeros_like(qk10)
    kk10 = tl.zeros_like(qk10)
    kk20, kk21 = tl.zeros_like(qk10), tl.zeros_like(qk10)
    kk30, kk31, kk32 = tl.zeros_like(qk10), tl.zeros_like(qk10), tl.zeros_like(qk10)
    for ks in range(0, BK, BKS):
        o_k = ks + tl.arange(0, BKS)
        bias_s = _slice_bias(dt_bias, bias, i_hv, o_k, K, GATE, GATE_FN, HAS_BIAS)
        q0, k0, g0 = _load_qkg(q, k, g, t0, eos, i_h, i_hv, o_k, a_log, bias_s, lower_bound, H, HV, K, GATE, GATE_FN)
        q1, k1, g1 = _load_qkg(q, k, g, t1, eos, i_h, i_hv, o_k, a_log, bias_s, lower_bound, H, HV, K, GATE, GATE_FN)
        q2, k2, g2 = _load_qkg(q, k, g, t2, eos, i_h, i_hv, o_k, a_log, bias_s, lower_bound, H, HV, K, GATE, GATE_FN)
        q3, k3, g3 = _load_qkg(q, k, g, t3, eos, i_h, i_hv, o_k, a_log, bias_s, lower_bound, H, HV, K, GATE, GATE_FN)
        gl0, tot0, eg0, er0 = _decays(g0, GATE)
        gl1, tot1, eg1, er1 = _decays(g1, GATE)
        gl2, tot2, eg2, er2 = _decays(g2, GATE)
        gl3, tot3, eg3, er3 = _decays(g3, GATE)
        # Reference = start of row block a, so both factors are <= 1.
        c0 = k0 * (nk0[:, None] * er0)  # [16, BKS] key decayed to the end of sub-block 0
        c1 = k1 * (nk1[:, None] * er1)
        c2 = k2 * (nk2[:, None] * er2)
        rq1, rk1 = q1 * (nq1[:, None] * eg1), k1 * (nk1[:, None] * eg1)  # decayed from its sub-block start
        rq2, rk2 = q2 * (nq2[:, None] * eg2), k2 * (nk2[:, None] * eg2)
        rq3, rk3 = q3 * (nq3[:, None] * eg3), k3 * (nk3[:, None] * eg3)
        qk10 = tl.dot(rq1, tl.trans(c0), qk10, input_precision=PREC)
        kk10 = tl.dot(rk1, tl.trans(c0), kk10, input_precision=PREC)
        qk21 = tl.dot(rq2, tl.trans(c1), qk21, input_precision=PREC)
        kk21 = tl.dot(rk2, tl.trans(c1), kk21, input_precision=PREC)
        qk32 = tl.dot(rq3, tl.trans(c2), qk32, input_precision=PREC)
        kk32 = tl.dot(rk3, tl.trans(c2), kk32, input_precision=PREC)
        c0 = c0 * tl.exp(tot1)[None, :]  # now decayed to the end of sub-block 1
        qk20 = tl.dot(rq2, tl.trans(c0), qk20, input_precision=PREC)
        kk20 = tl.dot(rk2, tl.trans(c0), kk20, input_precision=PREC)
        c0 = c0 * tl.exp(tot2)[None, :]  # ... of sub-block 2
        c1 = c1 * tl.exp(tot2)[None, :]
        qk30 = tl.dot(rq3, tl.trans(c0), qk30, input_precision=PREC)
        kk30 = tl.dot(rk3, tl.trans(c0), kk30, input_precision=PREC)
        qk31 = tl.dot(rq3, tl.trans(c1), qk31, input_precision=PREC)
        kk31 = tl.dot(rk3, tl.trans(c1), kk31, input_precision=PREC)

    _store_tile(a_base + BC * BT, qk10 * scale, BC, BC, BT)
    _store_tile(a_base + 2 * BC * BT, qk20 * scale, BC, BC, BT)
    _store_tile(a_base + 2 * BC * BT + BC, qk21 * scale, BC, BC, BT)
    _store_tile(a_base + 3 * BC * BT, qk30 * scale, BC, BC, BT)
    _store_tile(a_base + 3 * BC * BT + BC, qk31 * scale, BC, BC, BT)
    _store_tile(a_base + 3 * BC * BT + 2 * BC, qk32 * scale, BC, BC, BT)

    # ---- L^-1 for L = I + Diag(b) strict_tril(A_kk): merge the diagonal inverses (fp32) ---------
    n10 = b1[:, None] * kk10
    n20 = b2[:, None] * kk20
    n21 = b2[:, None] * kk21
    n30 = b3[:, None] * kk30
    n31 = b3[:, None] * kk31
    n32 = b3[:, None] * kk32
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

    # ---- pass 2: qg, kg, w = L^-1 Diag(b) (K * e^G), gam, checkpoint factors, per channel slice --
    if HAS_CKPT:
        ck_lo = tl.load(ck_ptr + i_c)
        ck_hi = tl.load(ck_ptr + i_c + 1)
    for ks in range(0, BK, BKS):
        o_k = ks + tl.arange(0, BKS)
        bias_s = _slice_bias(dt_bias, bias, i_hv, o_k, K, GATE, GATE_FN, HAS_BIAS)
        q0, k0, g0 = _load_qkg(q, k, g, t0, eos, i_h, i_hv, o_k, a_log, bias_s, lower_bound, H, HV, K, GATE, GATE_FN)
        q1, k1, g1 = _load_qkg(q, k, g, t1, eos, i_h, i_hv, o_k, a_log, bias_s, lower_bound, H, HV, K, GATE, GATE_FN)
        q2, k2, g2 = _load_qkg(q, k, g, t2, eos, i_h, i_hv, o_k, a_log, bias_s, lower_bound, H, HV, K, GATE, GATE_FN)
        q3, k3, g3 = _load_qkg(q, k, g, t3, eos, i_h, i_hv, o_k, a_log, bias_s, lower_bound, H, HV, K, GATE, GATE_FN)
        k0 = k0 * nk0[:, None]
        k1 = k1 * nk1[:, None]
        k2 = k2 * nk2[:, None]
        k3 = k3 * nk3[:, None]
        gl0, tot0, eg0, er0 = _decays(g0, GATE)
        gl1, tot1, eg1, er1 = _decays(g1, GATE)
        gl2, tot2, eg2, er2 = _decays(g2, GATE)
        gl3, tot3, eg3, er3 = _decays(g3, GATE)
        ep1 = tl.exp(tot0)[None, :]  # chunk start -> start of sub-block a
        ep2 = tl.exp(tot0 + tot1)[None, :]
        ep3 = tl.exp(tot0 + tot1 + tot2)[None, :]

        q_base = qg + head * BT * BK + ks
        _store_tile(q_base, q0 * (scale * nq0)[:, None] * eg0, BC, BKS, BK)
        _store_tile(q_base + BC * BK, q1 * (scale * nq1)[:, None] * (eg1 * ep1), BC, BKS, BK)
        _store_tile(q_base + 2 * BC * BK, q2 * (scale * nq2)[:, None] * (eg2 * ep2), BC, BKS, BK)
        _store_tile(q_base + 3 * BC * BK, q3 * (scale * nq3)[:, None] * (eg3 * ep3), BC, BKS, BK)

        k_base = kg + head * BT * BK + ks
        _store_tile(k_base, k0 * (er0 * tl.exp(tot1 + tot2 + tot3)[None, :]), BC, BKS, BK)
        _store_tile(k_base + BC * BK, k1 * (er1 * tl.exp(tot2 + tot3)[None, :]), BC, BKS, BK)
        _store_tile(k_base + 2 * BC * BK, k2 * (er2 * tl.exp(tot3)[None, :]), BC, BKS, BK)
        _store_tile(k_base + 3 * BC * BK, k3 * er3, BC, BKS, BK)

        gc = tl.exp(tot0 + tot1 + tot2 + tot3)  # [GK] whole-chunk decay
        tl.store(gam + head * BK + o_k, tl.zeros([BKS], dtype=tl.float32) + gc)

        _tril_apply(li00, li10, li11, li20, li21, li22, li30, li31, li32, li33,
                    b0[:, None] * k0 * eg0, b1[:, None] * k1 * (eg1 * ep1),
                    b2[:, None] * k2 * (eg2 * ep2), b3[:, None] * k3 * (eg3 * ep3),
                    w + head * BT * BK + ks, BK, PREC)

        if HAS_CKPT:
            for ci in range(ck_lo, ck_hi):
                r = tl.load(ck_pos + ci)
                ck_head = tl.cast(ci, tl.int64) * HV + i_hv
                _checkpoint_factors(kr + ck_head * BT * BK + ks, dr + ck_head * BK + ks, r,
                                    k0, k1, k2, k3, gl0, gl1, gl2, gl3, er0, er1, er2, er3,
                                    tot0, tot1, tot2, tot3, BK)

    # ---- pass 3: u = L^-1 Diag(b) V, per value slice ---------------------------------------------
    for vs in range(0, BV, BVS):
        o_v = vs + tl.arange(0, BVS)
        m_v = (o_v < V)[None, :]
        v0 = tl.load(v + ((t0 + rows)[:, None] * HV + i_hv) * V + o_v[None, :],
                     mask=((t0 + rows) < eos)[:, None] & m_v, other=0.0).to(tl.float32)
        v1 = tl.load(v + ((t1 + rows)[:, None] * HV + i_hv) * V + o_v[None, :],
                     mask=((t1 + rows) < eos)[:, None] & m_v, other=0.0).to(tl.float32)
        v2 = tl.load(v + ((t2 + rows)[:, None] * HV + i_hv) * V + o_v[None, :],
                     mask=((t2 + rows) < eos)[:, None] & m_v, other=0.0).to(tl.float32)
        v3 = tl.load(v + ((t3 + rows)[:, None] * HV + i_hv) * V + o_v[None, :],
                     mask=((t3 + rows) < eos)[:, None] & m_v, other=0.0).to(tl.float32)
        _tril_apply(li00, li10, li11, li20, li21, li22, li30, li31, li32, li33,
                    b0[:, None] * v0, b1[:, None] * v1, b2[:, None] * v2, b3[:, None] * v3,
                    u + head * BT * BV + vs, BV, PREC)
