"""Pieces shared by the Triton kernels: the gate activations and a head's low-rank up-projection.

Everything here runs in fp32 on register tiles and mirrors hyla.ops.gate:

    gate v1 (GATE_FN = 1):  g = -exp(A_log) * softplus(x + dt_bias)
    gate v2 (GATE_FN = 2):  g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))
    precomputed (GATE_FN = 0): g = x

and the per-head gate parameters every kernel with a fused gate loads (head_gate_params).
"""

import triton
import triton.language as tl

# Gate kinds of the chunk and recurrent kernels (the GATE constexpr).
NO_GATE, SCALAR_GATE, CHANNEL_GATE = 0, 1, 2
# Gate activations (the GATE_FN constexpr).
PRECOMPUTED, SOFTPLUS, SAFE_SIGMOID = 0, 1, 2


@triton.jit
def softplus(x):
    # softplus(x) = max(x, 0) + log1p(y), y = e^-|x| in (0, 1]. log1p on [0, 1] as y * q(y), q a
    # degree-8 polynomial (Chebyshev interpolant of log1p(y) / y): relative error <= 3e-7 over all
    # x (checked in fp32 against the fp64 softplus), tiny y keep their low bits (softplus of a
    # very negative input is ~e^x, not 0), and it is one exp and nine FMAs. tl.log would inline
    # libdevice's logf, ~30 instructions with a branch per element: the fused gate v1 of the
    # chunk kernels spent most of its extra time there.
    y = tl.exp(-tl.abs(x))
    q = 0.0051261019 * y - 0.0290740654
    q = q * y + 0.0775160864
    q = q * y - 0.136022478
    q = q * y + 0.190768808
    q = q * y - 0.248353988
    q = q * y + 0.333181202
    q = q * y - 0.499994457
    q = q * y + 0.99999994
    return tl.maximum(x, 0.0) + y * q


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def apply_gate(x, a_log, bias, lower_bound, GATE_FN: tl.constexpr):
    """x: raw gate tile (fp32), a_log: scalar A_log of the head, bias: dt_bias broadcastable to x."""
    if GATE_FN == 1:
        return -tl.exp(a_log) * softplus(x + bias)
    elif GATE_FN == 2:
        return lower_bound * sigmoid(tl.exp(a_log) * (x + bias))
    else:
        return x


@triton.jit
def head_gate_params(A_log, dt_bias, i_hv, o_k, K: tl.constexpr, GATE: tl.constexpr, GATE_FN: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    """The fused gate's parameters of value head i_hv -> (A_log scalar, dt_bias: the channels o_k
    [len(o_k)] of a per-channel gate (GATE 2), one scalar of a per-head gate); 0.0 where unused."""
    a_log = 0.0
    bias = 0.0
    if GATE_FN > 0:
        a_log = tl.load(A_log + i_hv).to(tl.float32)
        if HAS_BIAS:
            if GATE == 2:
                bias = tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)
            else:
                bias = tl.load(dt_bias + i_hv).to(tl.float32)
    return a_log, bias


# Up to this rank a head's slice of the up-projection is one load (BRK = r): a decode step's
# programs then have all of their weight bytes in flight at once, not r / 32 dependent steps
LOWRANK_ONE_LOAD_RANK = 128


@triton.jit
def head_up_projection(inp, n, in_s0, w_up, w_s0, rows, m_rows, r, BD: tl.constexpr, BRK: tl.constexpr):
    """One head's slice of a low-rank up-projection at one token: inp[n, :r] @ w_up[rows, :r]^T in
    fp32 -> [BD] (rows [BD] int64, masked by m_rows; BRK input columns at a time). KDA's f_b_proj
    and g_b_proj at a decode step, inside the kernel that consumes them."""
    acc = tl.zeros([BD], tl.float32)
    for r0 in range(0, r, BRK):
        o_r = r0 + tl.arange(0, BRK)
        m_r = o_r < r
        a = tl.load(inp + n * in_s0 + o_r, mask=m_r, other=0.0).to(tl.float32)  # [BRK]
        wt = tl.load(w_up + rows[:, None] * w_s0 + o_r[None, :], mask=m_rows[:, None] & m_r[None, :], other=0.0)
        acc += tl.sum(wt.to(tl.float32) * a[None, :], 1)
    return acc
