"""Element-wise pieces shared by the Triton kernels: the gate activations.

Everything here runs in fp32 on register tiles and mirrors hyla.ops.gate:

    gate v1 (GATE_FN = 1):  g = -exp(A_log) * softplus(x + dt_bias)
    gate v2 (GATE_FN = 2):  g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))
    precomputed (GATE_FN = 0): g = x
"""

import triton
import triton.language as tl

# Gate kinds of the chunk and recurrent kernels (the GATE constexpr).
NO_GATE, SCALAR_GATE, CHANNEL_GATE = 0, 1, 2
# Gate activations (the GATE_FN constexpr).
PRECOMPUTED, SOFTPLUS, SAFE_SIGMOID = 0, 1, 2


@triton.jit
def softplus(x):
    # softplus(x) = max(x, 0) + log1p(e^-|x|). log(1 + y) alone loses y's low bits to the rounding
    # of u = 1 + y (softplus of a very negative input is ~e^x, not 0), so add back that rounding
    # error c = y - (u - 1) (exact in fp32) times 1 / u. |c| <= 6e-8, so 1 / u on [1, 2] may be
    # replaced by the chord 1.5 - 0.5 u (off by at most 12%): the result is within ~1e-8 of
    # log1p(y) without the division of Kahan's form (a division is ~10x a multiply-add here).
    y = tl.exp(-tl.abs(x))
    u = 1.0 + y
    lp = tl.log(u) + (y - (u - 1.0)) * (1.5 - 0.5 * u)
    return tl.maximum(x, 0.0) + lp


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
