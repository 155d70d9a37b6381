"""One token of the gated delta rule on a state tile held in registers: the step shared by the
recurrent kernels (recurrent.py: decode / verify / plain states; recurrent_decode.py: the
persistent decode loop)."""

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
def token_step(b_s, q, k, v, g, beta, row, i_h, i_hv, o_k, o_v, a_log, bias, lower_bound, scale, sq, sk, sv,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               GATE: tl.constexpr, GATE_FN: tl.constexpr, USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """b_s: the state [BK, BV] fp32 (rows o_k, columns o_v); row: the token's row in q, k, v, g,
    beta; a_log, bias: head_gate_params'; sq, sk, sv: the elements between two token rows of q, k,
    v (their heads and channels contiguous inside a row; H * K, H * K, HV * V when contiguous) ->
    (the state after the token, its output [BV] fp32).
    Decay first, then predict with the decayed state, then write the error, then read."""
    m_k = o_k < K
    m_v = o_v < V
    b_q = tl.load(q + row * sq + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
    b_k = tl.load(k + row * sk + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
    b_v = tl.load(v + row * sv + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
    b_b = tl.load(beta + row * HV + i_hv).to(tl.float32)
    if BETA_SIGMOID:
        b_b = sigmoid(b_b)
    if USE_L2NORM:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
    if GATE == 2:
        b_g = tl.load(g + (row * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.where(m_k, apply_gate(b_g, a_log, bias, lower_bound, GATE_FN), 0.0)
        b_s = b_s * tl.exp(b_g)[:, None]
    elif GATE == 1:
        b_g = apply_gate(tl.load(g + row * HV + i_hv).to(tl.float32), a_log, bias, lower_bound, GATE_FN)
        b_s = b_s * tl.exp(b_g)
    # Both products with the decayed state are independent (one pass over S, no second
    # dependent reduction): o = S_new^T q = S_dec^T q + (k . q) err.
    pred = tl.sum(b_s * b_k[:, None], axis=0)  # [BV] S_dec^T k
    read = tl.sum(b_s * b_q[:, None], axis=0)  # [BV] S_dec^T q
    b_err = b_b * (b_v - pred)
    b_s = b_s + b_k[:, None] * b_err[None, :]
    return b_s, (read + tl.sum(b_q * b_k, axis=0) * b_err) * scale
