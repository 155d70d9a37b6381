"""Chunk prefill, pass 1 of 2: everything that depends on one 64-token chunk only (Triton).

By default (chunk_fwd's wu_in_scan) only chunk_gram_kernel runs here (for a per-channel gate
in two launches: a fast pass, then the steep chunks it flagged, where a channel decays past
e^-MAX_SPAN within the chunk) and the scan works from its outputs and the inputs (see
chunk_gram_kernel's ROW_FORM). The factor kernel's path, described next, is kept for wu_in_scan=False
and for KDA with an fp32 L^-1 and bf16 / fp16 inputs.

chunk_gram_kernel, one program per (chunk, value head),
reads q, k, the gate and beta of its 64 tokens, applies the fused pieces (gate activation,
beta sigmoid, q/k L2 norm) and writes aqk, L^-1 and three row factors. chunk_factors_kernel,
one small program per (channel or value slice, chunk, value head), turns them into the rest.
(One kernel doing both held both [64, 64] Gram accumulators, L^-1 and a slice's operands at
once: 255 registers, two 4-warp programs per SM; split, the slice programs run at 112-161
registers, several per SM.) Together they write what the sequential pass (chunk_scan.py) needs,
so that pass is four matmuls per chunk:

    w   = L^-1 Diag(b) (K * e^G)            [64, K]   u   = L^-1 Diag(b) V       [64, V]
    qg  = scale * Q * e^G                    [64, K]   kg  = K * e^(G_C - G)      [64, K]
    aqk = scale * tril(A_qk)                 [64, 64]  gam = e^(G_C)              [K]
    L   = I + Diag(b) strict_tril(A_kk),  A_xk[i, j] = sum_d x_id k_jd e^(G_id - G_jd)

(G = cumulative log-decay from the chunk start, G_C its value at the chunk end; see
hyla/ops/chunk.py for the algebra.) For every requested checkpoint at in-chunk offset r it also
writes kr = K * e^(G_r - G) (rows >= r zeroed) and dr = e^(G_r), the two factors that turn the
chunk-start state and this chunk's u into the state after exactly r tokens.

Numerics. The chunk is four 16-token sub-blocks. Each keeps its own inclusive cumsum Gl
(relative to the sub-block start) and total Tot_a, and every exponent is assembled from
same-sign pieces (Gl, Tot_a - Gl, sums of whole totals), so no fp32 cancellation between two
large cumulative sums occurs (the torch path gets the same effect from fp64). The decayed Gram
matrices are computed per channel slice in one of three ways, chosen at run time:

  - fast: every channel of the slice decays by at most e^-140 over the chunk. Factor at the
    chunk midpoint m = G_C / 2: e^(G_i - G_j) = e^(G_i - m) e^(m - G_j), both within e^(+-70),
    so the whole [64, 64] block is one tensor-core matmul; the upper triangle (which may
    overflow) is masked off. e^(+-70) leaves the factored operands normal fp32 numbers for any
    |q|, |k| in [1e-7, 1e7] (fp32 spans e^(+-87)); the exponent differences G_i - G_j lose at
    most ~1e-5 to fp32 rounding at |G| <= 140. Typical gates (and the safe gate, lower_bound >= -5, over most chunks).
  - medium: every 16-token sub-block decays by at most e^-140: the same factoring with one
    midpoint per 16-row block (four matmuls).
  - exact: otherwise (unbounded gates): e^(min(G_i - G_j, 0)) row by row. Slow, but only taken
    where a channel loses more than e^-140 within 16 tokens.

L^-1 by block forward substitution on 16 x 16 blocks (_invert_in_place): the four diagonal
blocks inverted as a batch from tensor-core products whose terms stay bounded ((I - D)(I + D^2)
for their 4x4 blocks, D^4 = 0, merged as (I + E)^-1 = (I - E)(I + E^2), E^4 = 0), then one
sub-diagonal of blocks at a time. (Forming the inverse from ten full [64, 64] products, as an
earlier version did, cost ~60x the arithmetic and kept the kernel at 255 registers.)
"""

import triton
import triton.language as tl

from hyla.ops.triton.common import apply_gate, head_gate_params, sigmoid

BT = tl.constexpr(64)  # chunk
BC = tl.constexpr(16)  # sub-block
# Largest decay (in log units) a factored product may span: the factors stay within e^(+-70).
# (An H200 run with Kimi-Linear-like gates, A = e^A_log up to 16, found a quarter of the heads'
# chunks past e^-80 and on the slower sub-block path, 0.5 ms of a 32K-token prefill.)
MAX_SPAN = tl.constexpr(140.0)
# Cap of exponents that only masked-off entries can reach (keeps them finite).
EXP_CAP = tl.constexpr(80.0)


@triton.jit
def _rows(x4):
    """[4, N] per-sub-block values -> [64, N], row r taking x4[r // 16]."""
    blk = (tl.arange(0, BT) // BC)[:, None]
    out = tl.where(blk == 0, _pick(x4, 0)[None, :], 0.0)
    out = tl.where(blk == 1, _pick(x4, 1)[None, :], out)
    out = tl.where(blk == 2, _pick(x4, 2)[None, :], out)
    return tl.where(blk == 3, _pick(x4, 3)[None, :], out)


@triton.jit
def _pick(x4, a):
    """Row a (runtime or constexpr) of a [4, N] tile, as [N]."""
    return tl.sum(tl.where((tl.arange(0, 4) == a)[:, None], x4, 0.0), axis=0)


@triton.jit
def _between(tot, a):
    """[4(b), N]: sum of tot[c] over b < c < a (the sub-blocks strictly between b and a)."""
    i4 = tl.arange(0, 4)
    m = (i4[None, :] > i4[:, None]) & (i4[None, :] < a)  # [4(b), 4(c)]
    return tl.sum(tl.where(m[:, :, None], tot[None, :, :], 0.0), axis=1)


@triton.jit
def _chunk_start(chunk_seq, chunk_pos, cu_seqlens, i_c):
    """Chunk i_c -> (its first token row t0, the end row eos of its sequence), both int64."""
    i_n = tl.load(chunk_seq + i_c)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return bos + tl.load(chunk_pos + i_c).to(tl.int64) * BT, eos


@triton.jit
def _load_decays(g, A_log, dt_bias, lower_bound, t0, eos, i_hv, o_k,
                 HV: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr, GATE_FN: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """The chunk's log-decays, the fused activation applied: [64, len(o_k)] for the channels o_k
    of a per-channel gate (GATE 2), [64] for a per-head gate, zeros [64] without a gate. Rows at
    or past eos are 0 (no decay)."""
    o_t = t0 + tl.arange(0, BT)  # [64] int64 token rows
    m_t = o_t < eos
    a_log, bias = head_gate_params(A_log, dt_bias, i_hv, o_k, K, GATE, GATE_FN, HAS_BIAS)
    if GATE == 2:
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        if GATE_FN > 0 and HAS_BIAS:
            bias = bias[None, :]
        b_g = tl.load(g + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_g = tl.where(m_tk, apply_gate(b_g, a_log, bias, lower_bound, GATE_FN), 0.0)
    elif GATE == 1:
        b_g = tl.load(g + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_g = tl.where(m_t, apply_gate(b_g, a_log, bias, lower_bound, GATE_FN), 0.0)
    else:
        b_g = tl.zeros([BT], dtype=tl.float32)
    return b_g


@triton.jit
def _load_qk(q, k, t0, eos, i_h, o_k, H: tl.constexpr, K: tl.constexpr):
    """q, k [64, len(o_k)] of the chunk's channels o_k, in their stored dtype; rows past eos 0."""
    o_t = t0 + tl.arange(0, BT)
    m_tk = (o_t < eos)[:, None] & (o_k < K)[None, :]
    off = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    return tl.load(q + off, mask=m_tk, other=0.0), tl.load(k + off, mask=m_tk, other=0.0)


@triton.jit
def _load_slice(q, k, g, A_log, dt_bias, lower_bound, t0, eos, i_h, i_hv, o_k,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr, GATE_FN: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """q, k [64, BKS] (fp32) of the chunk's channel slice o_k and its log-decays (_load_decays)."""
    b_q, b_k = _load_qk(q, k, t0, eos, i_h, o_k, H, K)
    b_g = _load_decays(g, A_log, dt_bias, lower_bound, t0, eos, i_hv, o_k, HV, K, GATE, GATE_FN, HAS_BIAS)
    return b_q.to(tl.float32), b_k.to(tl.float32), b_g


@triton.jit
def _seg_add(a, fa, b, fb):
    # (value, starts-a-segment) pairs: a running sum that restarts at every flagged row
    return tl.where(fb, b, a + b), fa | fb


@triton.jit
def _decays(b_g, GATE: tl.constexpr):
    """gl [64, GK]: inclusive cumsum inside each 16-token sub-block (GK = BKS or 1);
    tot [4, GK]: the sub-block totals (exactly gl's last row of each sub-block)."""
    rows = tl.arange(0, BT)
    if GATE == 2:
        start = tl.broadcast_to(((rows % BC) == 0)[:, None], b_g.shape)
        gl, _ = tl.associative_scan((b_g, start), 0, _seg_add)
    else:
        # one decay per head: scan the [64] vector (a scan over a size-1 axis does not lower)
        gl, _ = tl.associative_scan((b_g, (rows % BC) == 0), 0, _seg_add)
        gl = gl[:, None]
    last = (rows % BC) == BC - 1
    blk = rows // BC
    i4 = tl.arange(0, 4)
    # [4, GK] <- the last row of each sub-block
    tot = tl.sum(tl.where((last[None, :] & (blk[None, :] == i4[:, None]))[:, :, None], gl[None, :, :], 0.0), axis=1)
    return gl, tot


@triton.jit
def _spans_scalar(b_g):
    """For one decay per token (b_g [64]): (inside [64, 64], rem [64]). inside[i, j] = the sum of
    g_t over j < t <= i for i, j in one sub-block (elsewhere unused), rem[j] = the sum over the
    later tokens of j's sub-block. Each is a running sum of same-sign terms per sub-block
    ([4, 16, 16]); differences of cumsums (gl_i - gl_j, tot - gl_j) would lose ulp(|gl|) to
    cancellation after a steep token (fp32's 2^-10 at -12,000)."""
    t = tl.arange(0, BC)
    g4 = tl.reshape(b_g, (4, BC))
    terms = tl.where(t[None, :, None] > t[None, None, :], g4[:, :, None], 0.0)  # [4, 16(t), 16(j)]: g_t, t > j
    inside3 = tl.cumsum(terms, axis=1)  # [4, 16(i), 16(j)]: sum over j < t <= i
    rem = tl.reshape(tl.sum(terms, axis=1), (BT,))  # [64]
    inside = tl.reshape(tl.broadcast_to(tl.reshape(inside3, (BT, 1, BC)), (BT, 4, BC)), (BT, BT))
    return inside, rem


@triton.jit
def _chunk_cumsum(b_g, GATE: tl.constexpr):
    """Plain cumulative decay from the chunk start, G [64, GK], and the chunk total gc [GK].
    Used only when every channel's chunk total is >= -MAX_SPAN: then all |G| <= 140 and the
    differences G_i - G_j lose at most ~1e-5 to fp32 rounding."""
    if GATE == 2:
        return tl.cumsum(b_g, axis=0), tl.sum(b_g, axis=0)
    else:
        return tl.cumsum(b_g, axis=0)[:, None], tl.zeros([1], dtype=tl.float32) + tl.sum(b_g, axis=0)


@triton.jit
def _prefix_suffix(tot):
    """P[a] = sum_{b<a} tot[b] (chunk start -> start of sub-block a) and
    S[a] = sum_{b>a} tot[b] (end of sub-block a -> chunk end), both [4, GK]."""
    i4 = tl.arange(0, 4)
    t3 = tot[None, :, :]
    p = tl.sum(tl.where((i4[None, :] < i4[:, None])[:, :, None], t3, 0.0), axis=1)
    s = tl.sum(tl.where((i4[None, :] > i4[:, None])[:, :, None], t3, 0.0), axis=1)
    return p, s


@triton.jit
def _gram_slice(a_qk, a_kk, b_q, b_k, b_g, PREC: tl.constexpr):
    """Add one channel slice's decayed Gram products to a_qk, a_kk [64, 64] (lower triangle valid),
    the path chosen for the slice. b_g: its log-decays [64, BKS] (a per-channel gate)."""
    if tl.min(tl.sum(b_g, axis=0), axis=0) >= -MAX_SPAN:
        a_qk, a_kk, _, _, _, _, _ = _gram_fast(a_qk, a_kk, b_q, b_k, b_g, PREC)
    else:
        gl, tot = _decays(b_g, 2)
        a_qk, a_kk = _gram_steep(a_qk, a_kk, b_q, b_k, gl, tot, PREC)
    return a_qk, a_kk


@triton.jit
def _gram_fast(a_qk, a_kk, b_q, b_k, b_g, PREC: tl.constexpr):
    """The fast path of a per-channel gate's slice: one midpoint for the chunk, the whole block one
    matmul -> (a_qk, a_kk, whether the slice may take it: every channel's chunk total >= -MAX_SPAN;
    if not, what it added is garbage; the decayed slices Q e^G, K e^G, K e^(G_C - G) [64, BKS]
    and e^(G_C) [BKS], from the same exponentials: e^G = e^(G - m) e^m, e^(G_C - G) = e^(m - G) e^m)."""
    gg, gc = _chunk_cumsum(b_g, 2)
    m = 0.5 * gc[None, :]
    ck = b_k * tl.exp(m - gg)
    rf = tl.exp(gg - m)
    qr = b_q * rf
    kr = b_k * rf
    a_qk = tl.dot(qr, tl.trans(ck), a_qk, input_precision=PREC)
    a_kk = tl.dot(kr, tl.trans(ck), a_kk, input_precision=PREC)
    em = tl.exp(m)  # [1, BKS], >= e^-70 where the slice is fast
    return a_qk, a_kk, tl.min(gc, axis=0) >= -MAX_SPAN, qr * em, kr * em, ck * em, tl.sum(em * em, axis=0)


@triton.jit
def _gram_steep(a_qk, a_kk, b_q, b_k, gl, tot, PREC: tl.constexpr):
    """_gram_slice for a slice whose chunk decays past e^-MAX_SPAN somewhere: sub-block references."""
    rows = tl.arange(0, BT)
    blk = rows // BC
    tot_r = _rows(tot)
    if tl.min(tl.min(tot, axis=1), axis=0) >= -MAX_SPAN:
        # medium: one midpoint per 16-row block a; columns of later blocks are masked to 0
        rf = tl.exp(gl - 0.5 * tot_r)  # [64, GK], row i relative to its own block's midpoint
        rem = tot_r - gl  # token j -> end of its sub-block
        for a in tl.static_range(4):
            half = 0.5 * _pick(tot, a)[None, :]  # [1, GK]
            e = tl.where((blk < a)[:, None], half + _rows(_between(tot, a)) + rem, half - gl)
            ck = b_k * tl.where((blk <= a)[:, None], tl.exp(tl.minimum(e, EXP_CAP)), 0.0)
            in_a = (blk == a)[:, None]
            a_qk = tl.dot(tl.where(in_a, b_q * rf, 0.0), tl.trans(ck), a_qk, input_precision=PREC)
            a_kk = tl.dot(tl.where(in_a, b_k * rf, 0.0), tl.trans(ck), a_kk, input_precision=PREC)
    else:
        # exact: row i sees e^(G_i - G_j) with the exponent built from same-sign pieces
        rem = tot_r - gl
        for i in range(BT):
            a = i // BC
            sel = (rows == i)[:, None]
            gl_i = tl.sum(tl.where(sel, gl, 0.0), axis=0)[None, :]  # [1, GK]
            q_i = tl.sum(tl.where(sel, b_q, 0.0), axis=0)[None, :]  # [1, BKS]
            k_i = tl.sum(tl.where(sel, b_k, 0.0), axis=0)[None, :]
            e = tl.where((blk == a)[:, None], gl_i - gl, gl_i + _rows(_between(tot, a)) + rem)
            kd = b_k * tl.where((rows <= i)[:, None], tl.exp(tl.minimum(e, 0.0)), 0.0)  # [64(j), BKS]
            a_qk = tl.where(sel, a_qk + tl.sum(kd * q_i, axis=1)[None, :], a_qk)
            a_kk = tl.where(sel, a_kk + tl.sum(kd * k_i, axis=1)[None, :], a_kk)
    return a_qk, a_kk


@triton.jit
def _inv16(n, PREC: tl.constexpr):
    """(I + n)^-1 for a batch of strictly lower-triangular 16 x 16 blocks n [NB, 16, 16]: the 4x4
    diagonal blocks as (I - d)(I + d^2) (d^4 = 0), merged as (I + e)^-1 = (I - e)(I + e^2) with
    e = (4x4 block-diagonal inverse) x (the rest of n), e^4 = 0. Every term stays bounded (a
    Neumann series over the whole block would not: its terms grow like binomials for correlated
    keys). One batched matmul per product: with 4 warps each warp takes one block."""
    r = tl.arange(0, BC)
    eye = (r[:, None] == r[None, :]).to(tl.float32)[None, :, :]
    b4 = ((r[:, None] // 4) == (r[None, :] // 4))[None, :, :]
    d = tl.where(b4, n, 0.0)
    inv = tl.dot(eye - d, eye + tl.dot(d, d, input_precision=PREC), input_precision=PREC)
    e = tl.dot(inv, tl.where(b4, 0.0, n), input_precision=PREC)
    return tl.dot(tl.dot(eye - e, eye + tl.dot(e, e, input_precision=PREC), input_precision=PREC), inv,
                  input_precision=PREC)


@triton.jit
def _block_offsets(rb, cb):
    """Element offsets of the 16 x 16 blocks (rb[i], cb[i]) of a row-major [64, 64] matrix: [NB, 16, 16]."""
    r = tl.arange(0, BC)
    return (rb[:, None, None] * BC + r[None, :, None]) * BT + cb[:, None, None] * BC + r[None, None, :]


@triton.jit
def _load_blocks(ptr, rb, cb, NB: tl.constexpr):
    """Blocks (rb[i], cb[i]) of the fp32 [64, 64] matrix at ptr, [NB, 16, 16]; rb >= 4 reads zeros."""
    m = tl.broadcast_to((rb < 4)[:, None, None], (NB, BC, BC))
    return tl.load(ptr + _block_offsets(rb, cb), mask=m, other=0.0)


@triton.jit
def _store_blocks(ptr, rb, cb, x, NB: tl.constexpr):
    m = tl.broadcast_to((rb < 4)[:, None, None], (NB, BC, BC))
    tl.store(ptr + _block_offsets(rb, cb), x, mask=m)


@triton.jit
def _invert_in_place(ptr, PREC: tl.constexpr):
    """ptr: fp32 [64, 64] holding a strictly lower-triangular n (zeros above the diagonal) ->
    (I + n)^-1, in place, by block forward substitution on 16 x 16 blocks (X = that inverse):

        X_aa = (I + n_aa)^-1                       (_inv16, the four at once)
        X_ab = -X_aa sum_{b <= c < a} n_ac X_cb    (a > b, one sub-diagonal at a time)

    About 1/64 of the arithmetic of forming the inverse from full [64, 64] products, and only
    [.., 16, 16] tiles live at a time. The blocks are written back and re-read between the
    steps (the program's own 16 KB, in L1 / L2): register tiles cannot be sliced into blocks.
    Every thread's stores are visible to the others after a barrier."""
    i4 = tl.arange(0, 4)
    i2 = tl.arange(0, 2)
    # every n block the substitution reads, before any of them is overwritten
    n_d = _load_blocks(ptr, i4, i4, 4)  # n_aa
    n_1 = _load_blocks(ptr, i4 + 1, i4, 4)  # n_{a+1,a}, a = 0..2 (a = 3: zeros)
    n_2 = _load_blocks(ptr, i2 + 2, i2, 2)  # n_{a+2,a}, a = 0, 1
    n_21 = _load_blocks(ptr, i2 + 2, i2 + 1, 2)  # n_{a+2,a+1}
    n_3 = _load_blocks(ptr, i4 * 0 + 3, i4, 4)  # n_30, n_31, n_32 (and n_33, unused)
    x_d = _inv16(n_d, PREC)
    tl.debug_barrier()
    _store_blocks(ptr, i4, i4, x_d, 4)
    tl.debug_barrier()
    # first sub-diagonal: X_{a+1,a} = -X_{a+1,a+1} n_{a+1,a} X_aa
    x_up = _load_blocks(ptr, i4 + 1, i4 + 1, 4)
    x_1 = -tl.dot(x_up, tl.dot(n_1, x_d, input_precision=PREC), input_precision=PREC)
    _store_blocks(ptr, i4 + 1, i4, x_1, 4)
    tl.debug_barrier()
    # second: X_{a+2,a} = -X_{a+2,a+2} (n_{a+2,a} X_aa + n_{a+2,a+1} X_{a+1,a})
    acc = tl.dot(n_2, _load_blocks(ptr, i2, i2, 2), input_precision=PREC)
    acc = tl.dot(n_21, _load_blocks(ptr, i2 + 1, i2, 2), acc, input_precision=PREC)
    x_2 = -tl.dot(_load_blocks(ptr, i2 + 2, i2 + 2, 2), acc, input_precision=PREC)
    _store_blocks(ptr, i2 + 2, i2, x_2, 2)
    tl.debug_barrier()
    # third: X_30 = -X_33 (n_30 X_00 + n_31 X_10 + n_32 X_20), as a sum over a batch of three
    x_c0 = _load_blocks(ptr, tl.where(i4 < 3, i4, 4), i4 * 0, 4)  # X_00, X_10, X_20, 0
    part = tl.sum(tl.dot(n_3, x_c0, input_precision=PREC), axis=0)  # [16, 16]
    x_33 = tl.sum(tl.where((i4 == 3)[:, None, None], x_d, 0.0), axis=0)
    r = tl.arange(0, BC)
    tl.store(ptr + (3 * BC + r[:, None]) * BT + r[None, :], -tl.dot(x_33, part, input_precision=PREC))


@triton.jit
def _store_rows(ptr, x, STRIDE: tl.constexpr):
    """Store a [R, N] tile at ptr with row stride STRIDE, in the pointer's dtype."""
    o_r = tl.arange(0, x.shape[0])
    o_c = tl.arange(0, x.shape[1])
    tl.store(ptr + o_r[:, None] * STRIDE + o_c[None, :], x.to(ptr.dtype.element_ty))


@triton.jit
def _store_tokens(ptr, x, t0, eos, i_hv, o_k, HV: tl.constexpr, K: tl.constexpr):
    """Store a chunk's [64, len(o_k)] slice x into a token-major [T, HV, K] tensor (the layout of
    q and k), rows at or past eos skipped, in the pointer's dtype."""
    o_t = t0 + tl.arange(0, BT)
    tl.store(ptr + (o_t[:, None] * HV + i_hv) * K + o_k[None, :], x.to(ptr.dtype.element_ty),
             mask=(o_t < eos)[:, None] & (o_k < K)[None, :])


@triton.jit
def _boundary_decays(b_g, GATE: tl.constexpr, FAST: tl.constexpr):
    """e^G (chunk start -> token i), e^(G_C - G) (token j -> chunk end), both [64, GK], and
    e^(G_C) [GK], for one channel slice of log-decays b_g. FAST: the chunk is known not to be
    steep (the Gram kernel did not flag it), so only the plain cumsum form is compiled."""
    gg, gc = _chunk_cumsum(b_g, GATE)
    if FAST:
        eg = tl.exp(gg)
        e_end = tl.exp(gc[None, :] - gg)
    elif tl.min(gc, axis=0) >= -MAX_SPAN:
        eg = tl.exp(gg)
        e_end = tl.exp(gc[None, :] - gg)
    else:
        # steep chunk: assemble the exponents from sub-block pieces (no large cancellations)
        gl, tot = _decays(b_g, GATE)
        p, s = _prefix_suffix(tot)
        eg = tl.exp(_rows(p) + gl)
        if GATE == 1:
            _, rem = _spans_scalar(b_g)
            e_end = tl.exp(_rows(s) + rem[:, None])
        else:
            e_end = tl.exp(_rows(s + tot) - gl)
    return eg, e_end, tl.exp(gc)


@triton.jit
def _checkpoint_decays(r, b_g, GATE: tl.constexpr):
    """For a checkpoint after r tokens of this chunk (r in 1..64, runtime): f [64, GK] =
    e^(G_r - G_j) for rows j < r (0 from row r on) and d [GK] = e^(G_r), from one slice of
    log-decays b_g. Rare, so always the exact sub-block form."""
    gl, tot = _decays(b_g, GATE)
    rows = tl.arange(0, BT)
    blk = rows // BC
    t = r - 1  # last token included
    a = t // BC
    gl_t = tl.sum(tl.where((rows == t)[:, None], gl, 0.0), axis=0)  # [GK]
    # same sub-block: Gl_t - Gl_j; earlier: Gl_t + (totals strictly between) + (Tot_b - Gl_j)
    e = tl.where((blk == a)[:, None], gl_t[None, :] - gl,
                 gl_t[None, :] + _rows(_between(tot, a)) + _rows(tot) - gl)
    f = tl.where((rows <= t)[:, None], tl.exp(tl.minimum(e, 0.0)), 0.0)
    p, _ = _prefix_suffix(tot)
    return f, tl.exp(_pick(p, a) + gl_t)


@triton.jit
def _checkpoint_factors(kr_ptr, dr_ptr, r, b_k, b_g, GATE: tl.constexpr, BK: tl.constexpr):
    """One channel slice of kr = K * e^(G_r - G) (rows >= r zero) and dr = e^(G_r) for a
    checkpoint after r tokens of this chunk; b_k: normalised keys [64, BKS]."""
    f, d = _checkpoint_decays(r, b_g, GATE)
    _store_rows(kr_ptr, b_k * f, BK)
    o_c = tl.arange(0, b_k.shape[1])
    tl.store(dr_ptr + o_c, tl.zeros([b_k.shape[1]], dtype=tl.float32) + d)


@triton.jit
def _gram_scalar(q, k, g, A_log, dt_bias, lower_bound, t0, eos, i_h, i_hv,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                 GATE: tl.constexpr, GATE_FN: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr):
    """The Gram matrices of a chunk whose decay is one scalar per token (GDN, or none):
    A_xk = (X K^T) * e^(G_i - G_j), so the products need no per-channel factors: one dot each
    over all channels on the operands as loaded (bf16 products are exact in the fp32
    accumulator), then the [64, 64] decay. Its exponent is assembled from same-sign sub-block
    pieces (as _gram_steep does per channel), so no chunk is too steep for it.
    -> (a_qk, a_kk [64, 64] fp32, lower triangles valid; row sums of squares of q and k [64];
    the chunk's total log-decay; its per-token log-decays [64], zeros without a gate)."""
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    b_q, b_k = _load_qk(q, k, t0, eos, i_h, o_k, H, K)
    qf = b_q.to(tl.float32)
    sq = tl.sum(qf * qf, axis=1)
    a_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    a_kk = tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    lower = rows[:, None] >= rows[None, :]
    sk = tl.sum(tl.where(rows[:, None] == rows[None, :], a_kk, 0.0), axis=1)  # |k_i|^2: the diagonal
    b_g = _load_decays(g, A_log, dt_bias, lower_bound, t0, eos, i_hv, o_k, HV, K, GATE, GATE_FN, HAS_BIAS)
    if GATE == 1:
        gl, tot = _decays(b_g, GATE)  # [64, 1], [4, 1]
        gl = tl.sum(gl, axis=1)  # [64]
        tot = tl.sum(tot, axis=1)  # [4]
        blk = rows // BC
        same = blk[:, None] == blk[None, :]
        inside, rem = _spans_scalar(b_g)  # same sub-block: G_i - G_j; token j -> its sub-block's end
        between = tl.zeros([BT, BT], dtype=tl.float32)  # totals of the sub-blocks strictly between j's and i's
        for c in tl.static_range(4):
            t_c = tl.sum(tl.where(tl.arange(0, 4) == c, tot, 0.0), axis=0)
            between += tl.where((blk[None, :] < c) & (blk[:, None] > c), t_c, 0.0)
        e = tl.where(same, inside, gl[:, None] + between + rem[None, :])
        dec = tl.where(lower, tl.exp(tl.minimum(e, EXP_CAP)), 0.0)
        total = tl.sum(tot, axis=0)
    else:
        dec = tl.where(lower, 1.0, 0.0)
        total = 0.0
    return a_qk * dec, a_kk * dec, sq, sk, total, b_g


@triton.jit(do_not_specialize=["lower_bound", "scale"])
def chunk_gram_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, scale,
    cu_seqlens, chunk_seq, chunk_pos,
    aqk, li_scratch, li_out, rows_out, steep,
    gam, ck_ptr, ck_pos, kr, dr, qe, ke, kd,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BK: tl.constexpr, BKS: tl.constexpr,
    GATE: tl.constexpr, GATE_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, PREC: tl.constexpr, PASS: tl.constexpr,
    ROW_FORM: tl.constexpr, HAS_CKPT: tl.constexpr,
):
    """Per (chunk, value head): aqk [64, 64] (scale * tril(A_qk)), L^-1 [64, 64] (built in the fp32
    li_scratch; li_out is li_scratch, or a bf16 / fp16 copy of it) and
    the row factors rows_out [3, 64] fp32: scale * |q_i|^-1, |k_i|^-1 and beta_i.

    ROW_FORM (chunk_scan.chunk_scan_rows_kernel then builds w, u, qg, kg itself, and
    chunk_factors_kernel is not launched). A per-channel gate: each slice also writes
    qe = Q e^G, ke = K e^G, kd = K e^(G_C - G) (token-major [T, HV, K], the scan's q / k tiles;
    on the fast path from the Gram product's own factors e^(G - m), e^(m - G) times e^m, so no
    extra exponentials) and gam = e^(G_C) per channel; rows_out [4, 64] holds
    scale / |q_i|, 1 / |k_i|, beta_i / |k_i| and beta_i. A scalar or no gate: rows_out [4, 64]
    holds the four row scales that turn the raw inputs into them, with e^G from the chunk start
    to token i:
    rq = scale e^G_i / |q_i|, rk = e^(G_C - G_i) / |k_i|, rw = beta_i e^G_i / |k_i| and beta_i;
    gam [BK] = e^(G_C); and for each checkpoint in the chunk kr [64] = e^(G_r - G_j) / |k_j|
    (0 from row r on), dr [BK] = e^(G_r) (see _checkpoint_decays).

    A per-channel gate runs in two launches over the same grid: PASS 1 takes the fast path for
    every channel slice and, for a chunk where some channel decays past e^-MAX_SPAN, writes
    steep[chunk, head] = 1 and stops; PASS 2 does only those chunks, choosing per slice. (A kernel
    that also carries the steep paths' code was ~0.25 ms slower on a 32K-token prefill on an
    H200 even when no chunk takes them.) PASS 0: one launch, the choice per slice (scalar gates,
    whose Gram has no steep case)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, eos = _chunk_start(chunk_seq, chunk_pos, cu_seqlens, i_c)
    rows = tl.arange(0, BT)
    head = i_c.to(tl.int64) * HV + i_hv
    if PASS == 2:
        if tl.load(steep + head) == 0:
            return

    if GATE == 2:
        a_qk = tl.zeros([BT, BT], dtype=tl.float32)
        a_kk = tl.zeros([BT, BT], dtype=tl.float32)
        sq = tl.zeros([BT], dtype=tl.float32)
        sk = tl.zeros([BT], dtype=tl.float32)
        fast = True
        for ks in range(0, BK, BKS):
            o_k = ks + tl.arange(0, BKS)
            b_q, b_k, b_g = _load_slice(q, k, g, A_log, dt_bias, lower_bound, t0, eos, i_h, i_hv, o_k,
                                        H, HV, K, GATE, GATE_FN, HAS_BIAS)
            sq += tl.sum(b_q * b_q, axis=1)
            sk += tl.sum(b_k * b_k, axis=1)
            if PASS == 1:
                a_qk, a_kk, ok, t_q, t_k, t_d, gam_s = _gram_fast(a_qk, a_kk, b_q, b_k, b_g, PREC)
                fast = fast & ok
            else:
                a_qk, a_kk = _gram_slice(a_qk, a_kk, b_q, b_k, b_g, PREC)
                if ROW_FORM:
                    eg, e_end, gam_s = _boundary_decays(b_g, GATE, False)
                    t_q = b_q * eg
                    t_k = b_k * eg
                    t_d = b_k * e_end
            if ROW_FORM:
                # the scan's decayed operands of this slice (a chunk pass 1 flags is rewritten by pass 2)
                _store_tokens(qe, t_q, t0, eos, i_hv, o_k, HV, K)
                _store_tokens(ke, t_k, t0, eos, i_hv, o_k, HV, K)
                _store_tokens(kd, t_d, t0, eos, i_hv, o_k, HV, K)
                tl.store(gam + head * BK + o_k, gam_s)
        if PASS == 1:
            flag = tl.where(fast, 0, 1)
            tl.store(steep + head, flag)
            if flag != 0:
                return
    else:
        a_qk, a_kk, sq, sk, total, b_g = _gram_scalar(q, k, g, A_log, dt_bias, lower_bound, t0, eos, i_h, i_hv,
                                                      H, HV, K, BK, GATE, GATE_FN, HAS_BIAS, PREC)
        if GATE == 1 and not ROW_FORM:  # for chunk_factors_kernel's split: the decay passes e^-MAX_SPAN
            tl.store(steep + head, tl.where(total >= -MAX_SPAN, 0, 1))
    if USE_L2NORM:
        nq = 1.0 / tl.sqrt(sq + 1e-6)
        nk = 1.0 / tl.sqrt(sk + 1e-6)
    else:
        nq = tl.full([BT], 1.0, dtype=tl.float32)
        nk = nq
    o_b = t0 + rows
    b_b = tl.load(beta + o_b * HV + i_hv, mask=o_b < eos, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b_b = tl.where(o_b < eos, sigmoid(b_b), 0.0)
    a_qk = tl.where(rows[:, None] >= rows[None, :], a_qk * (scale * nq[:, None] * nk[None, :]), 0.0)
    _store_rows(aqk + head * BT * BT, a_qk, BT)
    n = tl.where(rows[:, None] > rows[None, :], a_kk * ((b_b * nk)[:, None] * nk[None, :]), 0.0)
    li = li_scratch + head * BT * BT
    _store_rows(li, n, BT)
    tl.debug_barrier()
    _invert_in_place(li, PREC)
    if li_out.dtype.element_ty != tl.float32:  # a low-precision copy for chunk_factors_kernel
        tl.debug_barrier()
        _store_rows(li_out + head * BT * BT, tl.load(li + rows[:, None] * BT + rows[None, :]), BT)
    if ROW_FORM and GATE == 2:  # the decays are in the tiles the slice loop wrote
        tl.store(rows_out + head * 4 * BT + rows, scale * nq)
        tl.store(rows_out + head * 4 * BT + BT + rows, nk)
        tl.store(rows_out + head * 4 * BT + 2 * BT + rows, b_b * nk)
        tl.store(rows_out + head * 4 * BT + 3 * BT + rows, b_b)
    elif ROW_FORM:
        eg, e_end, gam_s = _boundary_decays(b_g, GATE, False)  # [64, 1], [64, 1], [1]
        eg = tl.sum(eg, axis=1)
        e_end = tl.sum(e_end, axis=1)
        tl.store(rows_out + head * 4 * BT + rows, scale * nq * eg)
        tl.store(rows_out + head * 4 * BT + BT + rows, nk * e_end)
        tl.store(rows_out + head * 4 * BT + 2 * BT + rows, b_b * nk * eg)
        tl.store(rows_out + head * 4 * BT + 3 * BT + rows, b_b)
        o_k = tl.arange(0, BK)
        tl.store(gam + head * BK + o_k, tl.zeros([BK], dtype=tl.float32) + gam_s)
        if HAS_CKPT:
            for ci in range(tl.load(ck_ptr + i_c), tl.load(ck_ptr + i_c + 1)):
                ck_head = tl.cast(ci, tl.int64) * HV + i_hv
                f, d = _checkpoint_decays(tl.load(ck_pos + ci), b_g, GATE)  # [64, 1], [1]
                tl.store(kr + ck_head * BT + rows, nk * tl.sum(f, axis=1))
                tl.store(dr + ck_head * BK + o_k, tl.zeros([BK], dtype=tl.float32) + d)
    else:
        tl.store(rows_out + head * 3 * BT + rows, scale * nq)
        tl.store(rows_out + head * 3 * BT + BT + rows, nk)
        tl.store(rows_out + head * 3 * BT + 2 * BT + rows, b_b)


@triton.jit
def _li_dot(li, x, PREC: tl.constexpr):
    """L^-1 [64, 64] @ x [64, N] (fp32 x): tf32 products for an fp32 L^-1, else both operands in
    L^-1's precision (one bf16 / fp16 tensor-core product, as fla's WY kernels do)."""
    if li.dtype == tl.float32:
        return tl.dot(li, x, input_precision=PREC)
    else:
        return tl.dot(li, x.to(li.dtype))


@triton.jit(do_not_specialize=["lower_bound"])
def chunk_factors_kernel(
    q, k, v, g, A_log, dt_bias, lower_bound,
    cu_seqlens, chunk_seq, chunk_pos, li_in, rows_in, steep,
    w, u, qg, kg, gam,
    ck_ptr, ck_pos, kr, dr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BKS: tl.constexpr, BVS: tl.constexpr,
    GATE: tl.constexpr, GATE_FN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CKPT: tl.constexpr,
    PREC: tl.constexpr, PASS: tl.constexpr,
):
    """Per (channel slice, chunk, value head), from chunk_gram_kernel's L^-1 and row factors:
    slices s < BK / BKS write qg, kg, w, gam (and checkpoint factors) for channels s * BKS ...;
    the others write u for value columns (s - BK / BKS) * BVS ... .

    With a gate, two launches, as the Gram kernel (steep[chunk, head]: its flags): PASS 1 does
    every u slice and the channel slices of unflagged chunks, compiled with the fast boundary
    decays only; PASS 2 (a grid of channel slices only) the flagged chunks' channel slices.
    PASS 0: one launch, the choice per slice (no gate)."""
    i_s = tl.program_id(0)
    i_c = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    head = i_c.to(tl.int64) * HV + i_hv
    NKS: tl.constexpr = BK // BKS
    if PASS == 1:
        if i_s < NKS:
            if tl.load(steep + head) != 0:
                return
    if PASS == 2:
        if tl.load(steep + head) == 0:
            return
    t0, eos = _chunk_start(chunk_seq, chunk_pos, cu_seqlens, i_c)
    rows = tl.arange(0, BT)
    li = tl.load(li_in + head * BT * BT + rows[:, None] * BT + rows[None, :])  # [64, 64] fp32 or bf16 / fp16
    b_b = tl.load(rows_in + head * 3 * BT + 2 * BT + rows)  # [64] beta (0 on padding rows)
    if i_s < NKS:
        ks = i_s * BKS
        o_k = ks + tl.arange(0, BKS)
        b_q, b_k, b_g = _load_slice(q, k, g, A_log, dt_bias, lower_bound, t0, eos, i_h, i_hv, o_k,
                                    H, HV, K, GATE, GATE_FN, HAS_BIAS)
        nk = tl.load(rows_in + head * 3 * BT + BT + rows)
        b_k = b_k * nk[:, None]
        eg, e_end, gam_s = _boundary_decays(b_g, GATE, PASS == 1)
        sq = tl.load(rows_in + head * 3 * BT + rows)  # scale / |q_i|
        _store_rows(qg + head * BT * BK + ks, b_q * sq[:, None] * eg, BK)
        _store_rows(kg + head * BT * BK + ks, b_k * e_end, BK)
        tl.store(gam + head * BK + o_k, tl.zeros([BKS], dtype=tl.float32) + gam_s)
        _store_rows(w + head * BT * BK + ks, _li_dot(li, b_k * b_b[:, None] * eg, PREC), BK)
        if HAS_CKPT:
            for ci in range(tl.load(ck_ptr + i_c), tl.load(ck_ptr + i_c + 1)):
                ck_head = tl.cast(ci, tl.int64) * HV + i_hv
                _checkpoint_factors(kr + ck_head * BT * BK + ks, dr + ck_head * BK + ks, tl.load(ck_pos + ci),
                                    b_k, b_g, GATE, BK)
    else:
        vs = (i_s - NKS) * BVS
        o_v = vs + tl.arange(0, BVS)
        o_b = t0 + rows
        b_v = tl.load(v + (o_b[:, None] * HV + i_hv) * V + o_v[None, :],
                      mask=(o_b < eos)[:, None] & (o_v < V)[None, :], other=0.0).to(tl.float32)
        _store_rows(u + head * BT * BV + vs, _li_dot(li, b_v * b_b[:, None], PREC), BV)
