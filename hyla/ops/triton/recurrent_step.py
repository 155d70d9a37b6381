"""One token of the gated delta rule on a state tile held in registers: the step shared by the
recurrent kernels (recurrent.py: decode / verify / plain states; recurrent_decode.py: the
persistent pool loop). token_step = token_loads (the token's inputs, loads only) then
token_update (the arithmetic): split so that a kernel can issue the next token's loads before
it works on the current token (recurrent.py's PREFETCH)."""

import triton
import triton.language as tl

from hyla.ops.triton.common import apply_gate, sigmoid


@triton.jit
def state_offsets(o_k, o_v, K: tl.constexpr, V: tl.constexpr, KLAST: tl.constexpr):
    """[BK, BV] element offsets of rows o_k, columns o_v inside one head's state [K, V]: V
    contiguous (fla's layout), or K-last (KLAST: stored [V, K], hyla.contract.state_pool)."""
    if KLAST:
        return o_k[:, None] + o_v[None, :] * K
    else:
        return o_k[:, None] * V + o_v[None, :]


@triton.jit
def row_span(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """Row i_n's token rows [bos, eos) (int64): cu_seqlens' with IS_VARLEN, else T per row."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def start_slot(idx, n_acc, i_n, IDX_W: tl.constexpr, SPEC: tl.constexpr, EAGER: tl.constexpr):
    """The pool slot row i_n starts from (int64; negative: a padding row): idx[n], or for a
    speculative verify (idx [N, IDX_W]) the slot of its last accepted token, idx[n, n_acc[n] - 1].
    EAGER (verify): every candidate idx[n, 0 .. IDX_W - 1] is loaded beside n_acc[n] and one
    picked after, so the pool state's address waits on one load, not on two in turn."""
    if SPEC:
        if EAGER:
            j = tl.load(n_acc + i_n) - 1
            slot = tl.load(idx + i_n * IDX_W).to(tl.int64)
            for w in tl.static_range(1, IDX_W):
                slot = tl.where(j == w, tl.load(idx + i_n * IDX_W + w).to(tl.int64), slot)
            return slot
        else:
            return tl.load(idx + i_n * IDX_W + tl.load(n_acc + i_n) - 1).to(tl.int64)
    else:
        return tl.load(idx + i_n).to(tl.int64)


@triton.jit
def position_slot(idx, i_n, j, IDX_W: tl.constexpr):
    """A speculative verify's slot for the state after row i_n's token j: idx[n, j] (int64), -1
    past the slot width (a row longer than it writes no more states)."""
    return tl.load(idx + i_n * IDX_W + j, mask=j < IDX_W, other=-1).to(tl.int64)


@triton.jit
def token_loads(q, k, v, g, beta, row, ok, i_h, i_hv, o_k, o_v, sq, sk, sv, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, GATE: tl.constexpr):
    """Token row `row`'s inputs for one tile, as stored (no conversion, no arithmetic on them):
    (q [BK], k [BK], v [BV], beta, g [BK] / scalar / unused by GATE); zeros and no memory touched
    where `ok` is false (a prefetch past the row's end). Loads only, so a kernel can
    issue the next token's loads before it works on the current one: the compiler cannot move
    them above the current token's pool store itself (for all it knows the two may alias), and a
    warp stalls at the first instruction that uses a pending load."""
    m_k = (o_k < K) & ok
    b_q = tl.load(q + row * sq + i_h * K + o_k, mask=m_k, other=0.0)
    b_k = tl.load(k + row * sk + i_h * K + o_k, mask=m_k, other=0.0)
    b_v = tl.load(v + row * sv + i_hv * V + o_v, mask=(o_v < V) & ok, other=0.0)
    b_b = tl.load(beta + row * HV + i_hv, mask=ok, other=0.0)
    if GATE == 2:
        b_g = tl.load(g + (row * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
    elif GATE == 1:
        b_g = tl.load(g + row * HV + i_hv, mask=ok, other=0.0)
    else:
        b_g = tl.zeros([1], dtype=tl.float32)  # unused; a tensor so that a loop can carry it
    return b_q, b_k, b_v, b_b, b_g


@triton.jit
def token_update(b_s, b_q, b_k, b_v, b_b, b_g, o_k, a_log, bias, lower_bound, scale, K: tl.constexpr,
                 GATE: tl.constexpr, GATE_FN: tl.constexpr, USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """The state [BK, BV] fp32 and token_loads' inputs -> (the state after the token, its output
    [BV] fp32). Decay first, then predict with the decayed state, then write the error, then read."""
    b_q = b_q.to(tl.float32)
    b_k = b_k.to(tl.float32)
    b_v = b_v.to(tl.float32)
    b_b = b_b.to(tl.float32)
    if BETA_SIGMOID:
        b_b = sigmoid(b_b)
    if USE_L2NORM:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
    if GATE == 2:
        b_g = tl.where(o_k < K, apply_gate(b_g.to(tl.float32), a_log, bias, lower_bound, GATE_FN), 0.0)
        b_s = b_s * tl.exp(b_g)[:, None]
    elif GATE == 1:
        b_s = b_s * tl.exp(apply_gate(b_g.to(tl.float32), a_log, bias, lower_bound, GATE_FN))
    # Both products with the decayed state are independent (one pass over S, no second
    # dependent reduction): o = S_new^T q = S_dec^T q + (k . q) err.
    pred = tl.sum(b_s * b_k[:, None], axis=0)  # [BV] S_dec^T k
    read = tl.sum(b_s * b_q[:, None], axis=0)  # [BV] S_dec^T q
    b_err = b_b * (b_v - pred)
    b_s = b_s + b_k[:, None] * b_err[None, :]
    return b_s, (read + tl.sum(b_q * b_k, axis=0) * b_err) * scale


@triton.jit
def token_step(b_s, q, k, v, g, beta, row, i_h, i_hv, o_k, o_v, a_log, bias, lower_bound, scale, sq, sk, sv,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               GATE: tl.constexpr, GATE_FN: tl.constexpr, USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """b_s: the state [BK, BV] fp32 (rows o_k, columns o_v); row: the token's row in q, k, v, g,
    beta; a_log, bias: head_gate_params'; sq, sk, sv: the elements between two token rows of q, k,
    v (their heads and channels contiguous inside a row; H * K, H * K, HV * V when contiguous) ->
    (the state after the token, its output [BV] fp32): token_loads, then token_update."""
    b_q, b_k, b_v, b_b, b_g = token_loads(q, k, v, g, beta, row, True, i_h, i_hv, o_k, o_v, sq, sk, sv, HV, K, V,
                                          GATE)
    return token_update(b_s, b_q, b_k, b_v, b_b, b_g, o_k, a_log, bias, lower_bound, scale, K, GATE, GATE_FN,
                        USE_L2NORM, BETA_SIGMOID)
