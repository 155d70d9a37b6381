"""Chunkwise prefill vs the loop oracle: fp64 exactness at awkward sizes, varlen, split-resume,
in-pass checkpoints, unbounded gates, autograd, low precision, and argument validation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyla.ops import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    kda_gate,
    naive_recurrent_delta_rule,
    naive_recurrent_gated_delta_rule,
    naive_recurrent_kda,
)
from hyla.contract import as_k_last
from tests.ops.helpers import make_inputs, rel_err

EXACT = 1e-10  # fp64: both paths are exact algebra; only rounding separates them

OPS = {
    "kda": (chunk_kda, naive_recurrent_kda),
    "gdn": (chunk_gated_delta_rule, naive_recurrent_gated_delta_rule),
    "none": (lambda q, k, v, g, b, **kw: chunk_delta_rule(q, k, v, b, **kw),
             lambda q, k, v, g, b, **kw: naive_recurrent_delta_rule(q, k, v, b, **kw)),
}


def call(fn, q, k, v, g, beta, **kw):
    return fn(q, k, v, g, beta, **kw)


@pytest.mark.parametrize("gate", ["kda", "gdn", "none"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("with_h0", [False, True])
def test_fp64_matches_loop(gate, T, with_h0):
    chunk, naive = OPS[gate]
    q, k, v, g, beta, h0 = make_inputs(2, T, 3, 24, 40, gate=gate, seed=T)
    h0 = h0 if with_h0 else None
    o_ref, s_ref = call(naive, q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = call(chunk, q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float64 and o.shape == o_ref.shape
    assert rel_err(o, o_ref) < EXACT
    assert rel_err(s, s_ref) < EXACT


@pytest.mark.parametrize("chunk_size", [8, 16, 32, 128])
def test_other_chunk_sizes(chunk_size):
    q, k, v, g, beta, h0 = make_inputs(1, 100, 2, 8, 6, seed=chunk_size)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    assert rel_err(o, o_ref) < EXACT and rel_err(s, s_ref) < EXACT


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_grouped_value_heads(gate):
    chunk, naive = OPS[gate]
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 16, 8, gate=gate, hv=6, seed=11)
    o_ref, s_ref = call(naive, q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = call(chunk, q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.shape == (1, 70, 6, 8)
    assert rel_err(o, o_ref) < EXACT and rel_err(s, s_ref) < EXACT


@pytest.mark.parametrize("gate", ["kda", "gdn", "none"])
def test_varlen_equals_per_sequence_loop(gate):
    chunk, naive = OPS[gate]
    lens = [1, 65, 0, 130, 17]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), 2, 12, 10, gate=gate, seed=21)
    h0 = torch.randn(len(lens), 2, 12, 10, dtype=torch.float64)
    o, s = call(chunk, q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n in range(len(lens)):
        a, b = cu[n].item(), cu[n + 1].item()
        sl = lambda x: None if x is None else x[:, a:b]  # noqa: E731
        o_n, s_n = call(naive, sl(q), sl(k), sl(v), sl(g), sl(beta), initial_state=h0[n : n + 1],
                        output_final_state=True)
        if b > a:
            assert rel_err(o[:, a:b], o_n) < EXACT
        assert rel_err(s[n : n + 1], s_n) < EXACT


@pytest.mark.parametrize("gate", ["kda", "gdn", "none"])
@pytest.mark.parametrize("k_last", [False, True])
def test_state_pool_in_place_equals_gathered_states(gate, k_last):
    """With ssm_state_indices the pool is read and written in place: sequence n starts from its
    slot (zeros where has_initial_state is False) and its final state lands there; other slots
    are untouched; the outputs are those of the gathered call, bit for bit."""
    chunk, _ = OPS[gate]
    lens = [65, 1, 130, 3]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), 2, 12, 10, gate=gate, seed=23)
    pool = torch.randn(7, 2, 12, 10, dtype=torch.float64)
    if k_last:
        pool = as_k_last(pool)
    slots = torch.tensor([5, 0, 3, 6])
    resume = torch.tensor([True, False, True, True])
    start = torch.where(resume[:, None, None, None], pool[slots], 0).contiguous()  # the layout the op gathers
    before = pool.clone()
    o_ref, s_ref, c_ref = call(chunk, q, k, v, g, beta, initial_state=start, output_final_state=True,
                               cu_seqlens=cu, checkpoint_positions=[[64], [], [1, 130], [2]])
    o, s, c = call(chunk, q, k, v, g, beta, initial_state=pool, ssm_state_indices=slots, has_initial_state=resume,
                   cu_seqlens=cu, checkpoint_positions=[[64], [], [1, 130], [2]])
    assert s is pool and torch.equal(o, o_ref) and torch.equal(pool[slots], s_ref)
    assert all(torch.equal(a, b) for a, b in zip(c, c_ref))
    others = [i for i in range(7) if i not in slots.tolist()]
    assert torch.equal(pool[others], before[others])
    # without has_initial_state every sequence resumes from its slot
    pool2 = before.clone()
    call(chunk, q, k, v, g, beta, initial_state=pool2, ssm_state_indices=slots, cu_seqlens=cu)
    s_all = call(chunk, q, k, v, g, beta, initial_state=before[slots].contiguous(), output_final_state=True, cu_seqlens=cu)[1]
    assert torch.equal(pool2[slots], s_all)


@pytest.mark.parametrize("split", [1, 40, 64, 99])
def test_split_resume(split):
    q, k, v, g, beta, h0 = make_inputs(2, 150, 2, 16, 12, seed=split)
    o_all, s_all = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    a = lambda x: x[:, :split]  # noqa: E731
    b = lambda x: x[:, split:]  # noqa: E731
    o1, s1 = chunk_kda(a(q), a(k), a(v), a(g), a(beta), initial_state=h0, output_final_state=True)
    o2, s2 = chunk_kda(b(q), b(k), b(v), b(g), b(beta), initial_state=s1, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), o_all) < EXACT
    assert rel_err(s2, s_all) < EXACT


@pytest.mark.parametrize("gate", ["kda", "gdn", "none"])
def test_checkpoints_equal_loop_state_after_p_tokens(gate):
    chunk, naive = OPS[gate]
    cu = torch.tensor([0, 70, 75, 275])  # lengths 70, 5, 200
    q, k, v, g, beta, _ = make_inputs(1, 275, 2, 12, 10, gate=gate, seed=4)
    h0 = torch.randn(3, 2, 12, 10, dtype=torch.float64)
    positions = [[70, 1, 33, 64, 65], [5, 3], [199, 128, 129, 17]]
    o, s, ck = call(chunk, q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                    checkpoint_positions=positions)
    o_plain, _ = call(chunk, q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    assert rel_err(o, o_plain) < 1e-14  # exporting checkpoints must not perturb the outputs
    assert [c.shape[0] for c in ck] == [len(p) for p in positions]
    for n, ps in enumerate(positions):
        a = cu[n].item()
        for i, p in enumerate(ps):
            sl = lambda x: None if x is None else x[:, a : a + p]  # noqa: E731
            _, s_p = call(naive, sl(q), sl(k), sl(v), sl(g), sl(beta), initial_state=h0[n : n + 1],
                          output_final_state=True)
            assert rel_err(ck[n][i], s_p[0]) < EXACT, (n, p)
        assert ck[n].shape[1:] == (2, 12, 10)


def test_checkpoint_at_end_equals_final_state():
    q, k, v, g, beta, h0 = make_inputs(2, 77, 2, 8, 8, seed=8)
    _, s, ck = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                         checkpoint_positions=[[77], [77, 77]])
    assert torch.equal(ck[0][0], s[0]) or rel_err(ck[0][0], s[0]) < 1e-14
    assert rel_err(ck[1][1], s[1]) < 1e-14


def test_unbounded_gates_long_sequence_fp64_and_fp32():
    # Softplus (v1) gates reach -1e3 per token: a 64-token chunk spans e^-64000, which overflows
    # any factorisation that exponentiates -G. The chunk path must stay finite and exact.
    T, H, K, V = 4096, 2, 16, 16
    q, k, v, _, beta, h0 = make_inputs(1, T, H, K, V, seed=1)
    gen = torch.Generator().manual_seed(2)
    f = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) * 4
    A_log = torch.tensor([1.0, 6.9], dtype=torch.float64)  # exp(6.9) ~ 1e3
    g = kda_gate(f, A_log)
    assert g.min() < -1000
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < EXACT and rel_err(s, s_ref) < EXACT
    f32 = [x.float() for x in (q, k, v, g, beta, h0)]
    o32, s32 = chunk_kda(*f32[:5], initial_state=f32[5], output_final_state=True)
    assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
    # Compare with the fp64 loop on the same fp32-rounded inputs: rounding g ~ -1e3 to fp32 alone
    # moves e^g by ~6e-5 relative, which is input noise, not the algorithm's error.
    o_ref32, _ = naive_recurrent_kda(*[x.double() for x in f32[:5]], initial_state=f32[5].double())
    assert rel_err(o32, o_ref32) < 1e-5


def test_fused_gate_and_beta_sigmoid_equal_precomputed():
    q, k, v, _, _, h0 = make_inputs(1, 50, 2, 8, 4, seed=12)
    f = torch.randn(1, 50, 2, 8, dtype=torch.float64)
    b_raw = torch.randn(1, 50, 2, dtype=torch.float64)
    A_log = torch.randn(2, dtype=torch.float64)
    dt_bias = torch.randn(16, dtype=torch.float64)
    for lb in (None, -5.0):
        g = kda_gate(f, A_log, dt_bias, lb)
        o_ref, s_ref = chunk_kda(q, k, v, g, b_raw.sigmoid(), initial_state=h0, output_final_state=True)
        o, s = chunk_kda(q, k, v, f, b_raw, initial_state=h0, output_final_state=True, use_gate_in_kernel=True,
                         A_log=A_log, dt_bias=dt_bias, lower_bound=lb, use_beta_sigmoid_in_kernel=True)
        assert rel_err(o, o_ref) < 1e-14 and rel_err(s, s_ref) < 1e-14


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_inputs_compute_in_fp32(dtype, tol):
    q, k, v, g, beta, h0 = make_inputs(1, 130, 2, 32, 32, seed=6)
    cast = lambda x: x.to(dtype)  # noqa: E731
    o_ref, s_ref = naive_recurrent_kda(cast(q).double(), cast(k).double(), cast(v).double(), cast(g).double(),
                                       cast(beta).double(), initial_state=h0, output_final_state=True)
    o, s = chunk_kda(cast(q), cast(k), cast(v), cast(g), cast(beta), initial_state=h0.float(),
                     output_final_state=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_gradients_match_loop(gate):
    chunk, naive = OPS[gate]
    base = make_inputs(1, 37, 2, 6, 5, gate=gate, seed=31)

    def grads(fn):
        q, k, v, g, beta, h0 = (x.clone().requires_grad_() for x in base)
        o, s = call(fn, q, k, v, g, beta, initial_state=h0, output_final_state=True, **(
            {"chunk_size": 16} if fn is chunk else {}))
        (o.sin().sum() + s.cos().sum()).backward()
        return [x.grad for x in (q, k, v, g, beta, h0)]

    for a, b in zip(grads(chunk), grads(naive)):
        assert rel_err(a, b) < 1e-9


def test_gradients_finite_with_unbounded_gates():
    q, k, v, g, beta, _ = make_inputs(1, 96, 1, 8, 4, seed=2, g_scale=800.0)
    g.requires_grad_()
    o, _ = chunk_kda(q, k, v, g, beta)
    o.sum().backward()
    assert torch.isfinite(g.grad).all()


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 140), H=st.integers(1, 3), K=st.integers(1, 20), V=st.integers(1, 20),
       n_seq=st.integers(1, 3), gate=st.sampled_from(["kda", "gdn", "none"]), seed=st.integers(0, 10_000),
       g_scale=st.sampled_from([0.01, 1.0, 50.0]))
def test_property_random_shapes(T, H, K, V, n_seq, gate, seed, g_scale):
    chunk, naive = OPS[gate]
    q, k, v, g, beta, _ = make_inputs(1, T, H, K, V, gate=gate, seed=seed, g_scale=g_scale)
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, T + 1, (n_seq - 1,), generator=gen).tolist())
    cu = torch.tensor([0] + cuts + [T])
    h0 = torch.randn(n_seq, H, K, V, generator=gen, dtype=torch.float64)
    o_ref, s_ref = call(naive, q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o, s = call(chunk, q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert rel_err(o, o_ref) < EXACT and rel_err(s, s_ref) < EXACT


class TestValidation:
    def setup_method(self):
        self.q, self.k, self.v, self.g, self.beta, self.h0 = make_inputs(1, 10, 2, 4, 3, seed=0)

    def run(self, **over):
        args = dict(q=self.q, k=self.k, v=self.v, g=self.g, beta=self.beta)
        kw = {key: over.pop(key) for key in list(over) if key not in args}
        args.update(over)
        return chunk_kda(args["q"], args["k"], args["v"], args["g"], args["beta"], **kw)

    @pytest.mark.parametrize("name,bad,match", [
        ("q", torch.zeros(1, 10, 2), "`q`"),
        ("k", torch.zeros(1, 10, 2, 5, dtype=torch.float64), "`k`"),
        ("v", torch.zeros(1, 9, 2, 3, dtype=torch.float64), "`v`"),
        ("v", torch.zeros(1, 10, 3, 3, dtype=torch.float64), "multiple"),
        ("g", torch.zeros(1, 10, 2, dtype=torch.float64), "`g`"),
        ("beta", torch.zeros(1, 10, 3, dtype=torch.float64), "`beta`"),
        ("q", torch.zeros(1, 10, 2, 4, dtype=torch.int64), "`q`"),
    ])
    def test_bad_shapes_and_dtypes(self, name, bad, match):
        with pytest.raises(ValueError, match=match):
            self.run(**{name: bad})

    def test_positive_log_gate(self):
        with pytest.raises(ValueError, match="`g`"):
            self.run(g=self.g.abs() + 0.1)

    def test_cu_seqlens(self):
        with pytest.raises(ValueError, match="non-decreasing"):
            self.run(cu_seqlens=torch.tensor([0, 6, 4, 10]))
        with pytest.raises(ValueError, match="end at T"):
            self.run(cu_seqlens=torch.tensor([0, 4, 9]))
        with pytest.raises(ValueError, match="`cu_seqlens`"):
            self.run(cu_seqlens=torch.tensor([0.0, 10.0]))

    def test_initial_state_rows_and_shape(self):
        with pytest.raises(ValueError, match="`initial_state`"):
            self.run(initial_state=torch.zeros(2, 2, 4, 3, dtype=torch.float64))
        with pytest.raises(ValueError, match="`initial_state`"):
            self.run(initial_state=torch.zeros(1, 2, 3, 4, dtype=torch.float64))

    def test_device_mismatch(self):
        with pytest.raises(ValueError, match="one device"):
            self.run(beta=self.beta.to("meta"))

    def test_checkpoint_positions(self):
        with pytest.raises(ValueError, match="checkpoint_positions"):
            self.run(checkpoint_positions=[[0]])
        with pytest.raises(ValueError, match="checkpoint_positions"):
            self.run(checkpoint_positions=[[11]])
        with pytest.raises(ValueError, match="checkpoint_positions"):
            self.run(checkpoint_positions=[[1], [2]])

    def test_state_pool_arguments(self):
        pool = torch.zeros(3, 2, 4, 3, dtype=torch.float64)
        with pytest.raises(ValueError, match="needs `initial_state`"):
            self.run(ssm_state_indices=torch.tensor([0]))
        with pytest.raises(ValueError, match="int32/int64"):
            self.run(initial_state=pool, ssm_state_indices=torch.tensor([0.0]))
        with pytest.raises(ValueError, match=r"\[N\] with N=1"):
            self.run(initial_state=pool, ssm_state_indices=torch.tensor([0, 1]))
        for bad in (3, -1):
            with pytest.raises(ValueError, match=r"lie in \[0, 3\)"):
                self.run(initial_state=pool, ssm_state_indices=torch.tensor([bad]))
        with pytest.raises(ValueError, match="`has_initial_state` must"):
            self.run(initial_state=pool, ssm_state_indices=torch.tensor([1]), has_initial_state=torch.tensor([1]))
        with pytest.raises(ValueError, match="`has_initial_state` needs"):
            self.run(initial_state=self.h0, has_initial_state=torch.tensor([True]))

    def test_chunk_size(self):
        with pytest.raises(ValueError, match="chunk_size"):
            self.run(chunk_size=24)


@pytest.mark.parametrize("g_scale", [0.5, 2.5, 50.0])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, EXACT), (torch.float32, 2e-6)])
def test_every_intra_chunk_path(g_scale, dtype, tol):
    # 0.5: whole chunks factorised; 2.5: chunks over the span limit but 16-token sub-blocks under
    # it (blocked path, factorised diagonal); 50: sub-blocks over it too (masked differences).
    q, k, v, g, beta, h0 = make_inputs(1, 130, 2, 16, 8, seed=int(g_scale * 10), g_scale=g_scale)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    cast = lambda x: x.to(dtype)  # noqa: E731
    o, s = chunk_kda(cast(q), cast(k), cast(v), cast(g), cast(beta), initial_state=cast(h0), output_final_state=True)
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol


def test_factored_path_overflow_above_the_diagonal_is_discarded():
    # A chunk span just under the fp32 factored limit (80) and a large query: the products above
    # the diagonal overflow to inf in fp32; they must be discarded, not turned into NaN.
    q, k, v, _, beta, h0 = make_inputs(1, 64, 2, 16, 8, seed=40)
    q = q * 1e6  # e^79 * 1e6 * |k| exceeds the fp32 range
    g = torch.full((1, 64, 2, 16), -79.0 / 64, dtype=torch.float64)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    f32 = [x.float() for x in (q, k, v, g, beta, h0)]
    o, s = chunk_kda(*f32[:5], initial_state=f32[5], output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
