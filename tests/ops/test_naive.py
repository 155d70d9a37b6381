"""The loop oracle against an independent matrix form of the recurrence (DESIGN.md):

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T,    o_t = scale * S_t^T q_t

built with explicit K x K matrices, so an ordering mistake in the oracle (e.g. predicting with the
undecayed state) cannot hide."""

import pytest
import torch

from hyla.ops import (
    naive_recurrent_delta_rule,
    naive_recurrent_gated_delta_rule,
    naive_recurrent_kda,
    naive_recurrent_linear_attn,
)
from tests.ops.helpers import make_inputs, rel_err


def matrix_form(q, k, v, g, beta, h0, gate, delta):
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = h0.clone()
    eye = torch.eye(K, dtype=torch.float64)
    o = torch.empty(B, T, H, V, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = S[b, h]
            for t in range(T):
                kt = k[b, t, h][:, None]
                if gate == "kda":
                    a = torch.diag(g[b, t, h].exp())
                elif gate == "gdn":
                    a = eye * g[b, t, h].exp()
                else:
                    a = eye
                if delta:
                    s = (eye - beta[b, t, h] * kt @ kt.T) @ a @ s + beta[b, t, h] * kt @ v[b, t, h][None, :]
                else:
                    s = s + kt @ v[b, t, h][None, :]
                o[b, t, h] = s.T @ q[b, t, h] * K ** -0.5
            S[b, h] = s
    return o, S


@pytest.mark.parametrize("gate,delta,fn", [
    ("kda", True, lambda q, k, v, g, b, **kw: naive_recurrent_kda(q, k, v, g, b, **kw)),
    ("gdn", True, lambda q, k, v, g, b, **kw: naive_recurrent_gated_delta_rule(q, k, v, g, b, **kw)),
    (None, True, lambda q, k, v, g, b, **kw: naive_recurrent_delta_rule(q, k, v, b, **kw)),
    (None, False, lambda q, k, v, g, b, **kw: naive_recurrent_linear_attn(q, k, v, **kw)),
])
def test_loop_matches_matrix_form(gate, delta, fn):
    q, k, v, g, beta, h0 = make_inputs(2, 9, 2, 5, 3, gate=gate or "none", seed=3)
    o_ref, s_ref = matrix_form(q, k, v, g, beta, h0, gate, delta)
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-12
    assert rel_err(s, s_ref) < 1e-12


def test_varlen_equals_separate_calls():
    q, k, v, g, beta, h0 = make_inputs(1, 20, 2, 6, 4, seed=5)
    cu = torch.tensor([0, 7, 7, 20])
    h0 = torch.randn(3, 2, 6, 4, dtype=torch.float64)
    o, s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n, (a, b) in enumerate([(0, 7), (7, 7), (7, 20)]):
        o_n, s_n = naive_recurrent_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                       initial_state=h0[n : n + 1], output_final_state=True)
        assert rel_err(o[:, a:b], o_n) < 1e-14 if b > a else True
        assert rel_err(s[n : n + 1], s_n) < 1e-14


def test_l2norm_in_kernel_and_scale():
    q, k, v, g, beta, h0 = make_inputs(1, 5, 1, 4, 3, seed=9)
    q2, k2 = q * 3.0, k * 0.5
    o1, _ = naive_recurrent_kda(q2, k2, v, g, beta, use_qk_l2norm_in_kernel=True, scale=0.7)
    qn = q2 / (q2.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    kn = k2 / (k2.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    o2, _ = naive_recurrent_kda(qn, kn, v, g, beta, scale=0.7)
    assert rel_err(o1, o2) < 1e-14
