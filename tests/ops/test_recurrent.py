"""Decode / verify over a state pool vs the loop oracle, including speculative rollback."""

import pytest
import torch

from hyla.ops import (
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
    naive_recurrent_gated_delta_rule,
    naive_recurrent_kda,
)
from tests.ops.helpers import make_inputs, rel_err

EXACT = 1e-12
OPS = {"kda": (fused_recurrent_kda, naive_recurrent_kda),
       "gdn": (fused_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule)}


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("T", [1, 7, 65])
def test_matches_loop_without_pool(gate, T):
    rec, naive = OPS[gate]
    q, k, v, g, beta, h0 = make_inputs(2, T, 3, 24, 40, gate=gate, seed=T)
    o_ref, s_ref = naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = rec(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) < EXACT and rel_err(s, s_ref) < EXACT


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_pool_decode_in_place(gate):
    rec, naive = OPS[gate]
    N, H, K, V, slots = 5, 2, 12, 10, 9
    q, k, v, g, beta, _ = make_inputs(1, N, H, K, V, gate=gate, hv=4, seed=3)
    pool = torch.randn(slots, 4, K, V, dtype=torch.float64)
    before = pool.clone()
    idx = torch.tensor([7, 0, 3, -1, 5])  # -1: a padding row (e.g. a CUDA-graph bucket filler)
    cu = torch.arange(N + 1)
    o, out_pool = rec(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx)
    assert out_pool is pool
    for n, slot in enumerate(idx.tolist()):
        if slot < 0:
            assert torch.equal(o[:, n], torch.zeros_like(o[:, n]))
            continue
        sl = lambda x: x[:, n : n + 1]  # noqa: E731
        o_n, s_n = naive(sl(q), sl(k), sl(v), sl(g), sl(beta), initial_state=before[slot : slot + 1],
                         output_final_state=True)
        assert rel_err(o[:, n : n + 1], o_n) < EXACT
        assert rel_err(pool[slot], s_n[0]) < EXACT
    untouched = [s for s in range(slots) if s not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_speculative_verify_writes_every_position_and_rolls_back(gate):
    rec, naive = OPS[gate]
    H, K, V = 2, 8, 6  # 3 speculative tokens: 4 slots per sequence
    lens = [4, 2, 4, 1]  # 1 + drafts per sequence (fewer drafts allowed)
    N = len(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), H, K, V, gate=gate, seed=7)
    pool = torch.randn(4 * N + 2, H, K, V, dtype=torch.float64)
    idx = torch.arange(4 * N).view(N, 4) + 2
    accepted = torch.tensor([1, 2, 4, 1])  # where the previous step's accepted state lives
    before = pool.clone()
    o, _ = rec(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
               num_accepted_tokens=accepted)
    for n in range(N):
        a, b = cu[n].item(), cu[n + 1].item()
        start = before[idx[n, accepted[n] - 1]][None]
        for j in range(b - a):
            sl = lambda x: x[:, a : a + j + 1]  # noqa: E731
            o_j, s_j = naive(sl(q), sl(k), sl(v), sl(g), sl(beta), initial_state=start, output_final_state=True)
            assert rel_err(pool[idx[n, j]], s_j[0]) < EXACT
            assert rel_err(o[:, a : a + j + 1], o_j) < EXACT
        for j in range(b - a, 4):  # slots past this sequence's tokens are not written
            assert torch.equal(pool[idx[n, j]], before[idx[n, j]])
    assert torch.equal(pool[:2], before[:2])


def test_verify_then_accept_prefix_equals_plain_decode_of_accepted_tokens():
    """After verifying [x0, d1, d2] and accepting 2 tokens, the next step starts from the state
    after x0, d1 -- exactly what decoding those two tokens one by one gives."""
    H, K, V = 2, 8, 8
    q, k, v, g, beta, _ = make_inputs(1, 3, H, K, V, seed=9)
    pool = torch.randn(4, H, K, V, dtype=torch.float64)
    start = pool[0].clone()
    idx = torch.tensor([[1, 2, 3]])
    pool[1] = start  # slot idx[0, 0] holds the accepted state of the previous step
    fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=torch.tensor([0, 3]),
                        ssm_state_indices=idx, num_accepted_tokens=torch.tensor([1]))
    accepted_state = pool[idx[0, 1]]
    plain = start[None].clone()
    for t in range(2):
        sl = lambda x: x[:, t : t + 1]  # noqa: E731
        _, plain = naive_recurrent_kda(sl(q), sl(k), sl(v), sl(g), sl(beta), initial_state=plain,
                                       output_final_state=True)
    assert rel_err(accepted_state, plain[0]) < EXACT


def test_pool_argument_errors():
    q, k, v, g, beta, _ = make_inputs(1, 2, 1, 4, 4, seed=0)
    pool = torch.zeros(3, 1, 4, 4, dtype=torch.float64)
    cu = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="initial_state"):
        fused_recurrent_kda(q, k, v, g, beta, cu_seqlens=cu, ssm_state_indices=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="ssm_state_indices"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
                            ssm_state_indices=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="ssm_state_indices"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
                            ssm_state_indices=torch.tensor([0]))
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
                            ssm_state_indices=torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
                            ssm_state_indices=torch.tensor([[0], [1]]), num_accepted_tokens=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="`g`"):
        fused_recurrent_kda(q, k, v, -g, beta, initial_state=pool, cu_seqlens=cu,
                            ssm_state_indices=torch.tensor([0, 1]))


def test_fused_gate_matches_precomputed():
    from hyla.ops import kda_gate
    q, k, v, _, _, h0 = make_inputs(2, 5, 2, 8, 4, seed=4)
    f = torch.randn(2, 5, 2, 8, dtype=torch.float64)
    b = torch.randn(2, 5, 2, dtype=torch.float64)
    A_log, dt_bias = torch.randn(2, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    g = kda_gate(f, A_log, dt_bias, -5.0)
    o1, s1 = fused_recurrent_kda(q, k, v, g, b.sigmoid(), initial_state=h0, output_final_state=True)
    o2, s2 = fused_recurrent_kda(q, k, v, f, b, initial_state=h0, output_final_state=True, use_gate_in_kernel=True,
                                 A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
    assert rel_err(o2, o1) < 1e-14 and rel_err(s2, s1) < 1e-14


def test_bf16_inputs_fp32_pool():
    q, k, v, g, beta, _ = make_inputs(1, 3, 2, 16, 16, seed=2)
    pool = torch.randn(3, 2, 16, 16)
    pool64 = pool.double()
    bf = [x.bfloat16() for x in (q, k, v, g, beta)]
    idx = torch.tensor([2, 0, 1])
    cu = torch.arange(4)
    o, _ = fused_recurrent_kda(*bf, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx)
    o_ref, _ = fused_recurrent_kda(*[x.double() for x in bf], initial_state=pool64, cu_seqlens=cu,
                                   ssm_state_indices=idx)
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-2 and rel_err(pool, pool64) < 1e-6
