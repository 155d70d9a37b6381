"""Triton kernels vs the torch reference, on small awkward shapes.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
triton is first imported); with one they run on it. Inputs are fp32, the reference is the torch
path in fp64, and every output must match to 1e-4 relative: the kernels compute the same
function in fp32, nothing is approximated. Outputs the kernels fail to write would surface as
garbage from torch.empty, never as a lucky zero (inputs are random, never zeros).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`
pytest.importorskip("triton", reason="triton is not installed (pip install 'hyla[triton]')")

from hyla.contract import as_k_last  # noqa: E402
from hyla.ops import chunk as torch_chunk  # noqa: E402
from hyla.ops import recurrent as torch_rec  # noqa: E402
from hyla.ops import triton as hyla_triton  # noqa: E402
from tests.ops.helpers import make_inputs, rel_err, use_backend  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4
if DEV == "cpu" and not hyla_triton.interpreting():
    pytest.skip("CPU tensors need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)

CHUNK = {"kda": ("chunk_kda", torch_chunk.chunk_kda),
         "gdn": ("chunk_gated_delta_rule", torch_chunk.chunk_gated_delta_rule),
         "none": ("chunk_delta_rule", torch_chunk.chunk_delta_rule)}
REC = {"kda": ("fused_recurrent_kda", torch_rec.fused_recurrent_kda),
       "gdn": ("fused_recurrent_gated_delta_rule", torch_rec.fused_recurrent_gated_delta_rule)}


def _chunk_pair(gate):
    name, ref = CHUNK[gate]
    fast = getattr(hyla_triton, name)
    if gate == "none":
        return (lambda q, k, v, g, b, **kw: fast(q, k, v, b, **kw)), (lambda q, k, v, g, b, **kw: ref(q, k, v, b, **kw))
    return fast, ref


def _f32(*xs):
    return [None if x is None else x.float().to(DEV) for x in xs]


def _check(actual, expected, what, tol=TOL):
    err = rel_err(actual.cpu(), expected.cpu())
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("gate", ["kda", "gdn", "none"])
@pytest.mark.parametrize("T", [1, 63, 65, 130])
def test_chunk_matches_torch(gate, T):
    fast, ref = _chunk_pair(gate)
    q, k, v, g, beta, h0 = make_inputs(1, T, 2, 32, 32, gate=gate, seed=T)
    o_ref, s_ref = ref(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = fast(*_f32(q, k, v, g, beta), initial_state=h0.float().to(DEV), output_final_state=True)
    assert o.shape == o_ref.shape and o.dtype == torch.float32 and s.dtype == torch.float32
    _check(o, o_ref, "o")
    _check(s, s_ref, "final state")


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_chunk_wider_heads_grouped_values_no_initial_state(gate):
    fast, ref = _chunk_pair(gate)
    q, k, v, g, beta, _ = make_inputs(2, 100, 2, 64, 64, gate=gate, hv=4, seed=5)
    o_ref, s_ref = ref(q, k, v, g, beta, output_final_state=True)
    o, s = fast(*_f32(q, k, v, g, beta), output_final_state=True)
    _check(o, o_ref, "o")
    _check(s, s_ref, "final state")
    o2, s2 = fast(*_f32(q, k, v, g, beta))
    assert s2 is None and torch.equal(o2, o)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_chunk_varlen_with_checkpoints_at_odd_positions(gate):
    fast, ref = _chunk_pair(gate)
    lens = [65, 1, 130]
    cu = torch.tensor([0, 65, 66, 196])
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), 2, 32, 32, gate=gate, seed=17)
    h0 = torch.randn(3, 2, 32, 32, dtype=torch.float64)
    ckpts = [[33, 1, 64, 65, 17], [1], [129, 63, 64, 130, 3, 100]]
    o_ref, s_ref, c_ref = ref(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                              checkpoint_positions=ckpts)
    o, s, c = fast(*_f32(q, k, v, g, beta), initial_state=h0.float().to(DEV), output_final_state=True,
                   cu_seqlens=cu.to(DEV), checkpoint_positions=ckpts)
    _check(o, o_ref, "o")
    _check(s, s_ref, "final state")
    assert [x.shape[0] for x in c] == [len(p) for p in ckpts]
    for n in range(3):
        _check(c[n], c_ref[n], f"checkpoints of sequence {n}")
    # the checkpoint at a sequence's end is its final state
    _check(c[2][3], s[2], "checkpoint at the end")


@pytest.mark.parametrize("gate,wu_in_scan,k_last", [("kda", True, True), ("kda", False, False), ("gdn", True, False),
                                                     ("none", False, True)])
def test_chunk_state_pool_in_place(gate, wu_in_scan, k_last):
    """The scan reads each start state from its pool slot (zeros where has_initial_state is False)
    and writes the final state back in place, K-last or V-contiguous: bit for bit the states and
    outputs of the gathered call, the other slots untouched."""
    from hyla.ops.triton.chunk import chunk_fwd

    lens = [65, 1, 70]
    cu = torch.tensor([0, 65, 66, 136], device=DEV)
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), 2, 32, 32, gate=gate, seed=29)
    args = _f32(q, k, v, g, beta)
    kw = dict(gate=None if gate == "none" else gate, cu_seqlens=cu, wu_in_scan=wu_in_scan,
              checkpoint_positions=[[64], [], [1, 69]])
    pool = torch.randn(5, 2, 32, 32, device=DEV)
    if k_last:
        pool = as_k_last(pool)
    slots = torch.tensor([4, 0, 2], device=DEV)
    resume = torch.tensor([True, False, True], device=DEV)
    before = pool.clone()
    o_ref, s_ref, c_ref = chunk_fwd(*args, initial_state=torch.where(resume[:, None, None, None], pool[slots], 0),
                                    output_final_state=True, **kw)
    o, s, c = chunk_fwd(*args, initial_state=pool, ssm_state_indices=slots, has_initial_state=resume, **kw)
    assert s is pool and torch.equal(o, o_ref) and torch.equal(pool[slots], s_ref)
    assert all(torch.equal(a, b) for a, b in zip(c, c_ref))
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


def test_chunk_no_checkpoints_requested_returns_empty_lists():
    fast, _ = _chunk_pair("kda")
    q, k, v, g, beta, _ = make_inputs(1, 20, 2, 32, 32, seed=3)
    cu = torch.tensor([0, 5, 20])
    o, s, c = fast(*_f32(q, k, v, g, beta), cu_seqlens=cu.to(DEV), checkpoint_positions=[[], []])
    assert [x.shape for x in c] == [(0, 2, 32, 32)] * 2


@pytest.mark.parametrize("variant", ["kda_v1", "kda_v2", "gdn"])
def test_chunk_fused_gate_beta_sigmoid_and_l2norm(variant):
    gate = "kda" if variant.startswith("kda") else "gdn"
    fast, ref = _chunk_pair(gate)
    T, H, K = 130, 2, 32
    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(1, T, H, K) * 3, r(1, T, H, K) * 3, r(1, T, H, K)
    raw = r(1, T, H, K) if gate == "kda" else r(1, T, H)
    beta_logit = r(1, T, H)
    A_log = (torch.rand(H, generator=gen, dtype=torch.float64) * 2.7)  # exp(A_log) in [1, 15]
    dt_bias = r(H * K) if gate == "kda" else r(H)
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
              use_qk_l2norm_in_kernel=True, output_final_state=True)
    if variant == "kda_v2":
        kw["lower_bound"] = -5.0
    o_ref, s_ref = ref(q, k, v, raw, beta_logit, **kw)
    kw.update(A_log=A_log.float().to(DEV), dt_bias=dt_bias.float().to(DEV))
    o, s = fast(*_f32(q, k, v, raw, beta_logit), **kw)
    _check(o, o_ref, "o")
    _check(s, s_ref, "final state")


def test_chunk_steep_decays_take_the_exact_diagonal_path():
    """Per-token decays near -30 in some channels push 16-token sub-blocks far past e^-80, where
    the factored diagonal would overflow; the kernel must switch to pairwise exponents."""
    fast, ref = _chunk_pair("kda")
    q, k, v, g, beta, h0 = make_inputs(1, 130, 2, 32, 32, seed=9)
    steep = torch.rand(1, 130, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(130)) < 0.3
    g = torch.where(steep, g * 60.0, g)
    g[:, 70:80] *= 200.0  # one sub-block with channels decaying by ~1e4
    o_ref, s_ref, c_ref = ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                              checkpoint_positions=[[75, 130]])
    o, s, c = fast(*_f32(q, k, v, g, beta), initial_state=h0.float().to(DEV), output_final_state=True,
                   checkpoint_positions=[[75, 130]])
    _check(o, o_ref, "o")
    _check(s, s_ref, "final state")
    _check(c[0], c_ref[0], "checkpoints")


# every variant with both gate modes and both wu paths, each (mode, wu path) pair at least once
# per gate family: the paths are independent launches, so pairs cover them without the full product
@pytest.mark.parametrize("variant,mode,wu_in_scan", [
    ("kda_v1", "in_kernel", True), ("kda_v1", "precompute", False), ("kda_v2", "in_kernel", False),
    ("kda_v2", "precompute", True), ("gdn", "in_kernel", True), ("gdn", "precompute", False),
    ("gdn_gate", "in_kernel", False), ("gdn_gate", "in_kernel", True)])
def test_chunk_local_kernels_agree_with_torch(variant, mode, wu_in_scan):
    """chunk_gram_kernel with narrow slices (a chunk takes several), then either the scan from
    the Gram kernel's row scales (wu_in_scan, the default: raw q, k for GDN, the decayed tiles
    it wrote for KDA) or chunk_factors_kernel (one chunk has several slice programs of each
    kind) and its scan; a fused gate's activation in the kernels or launched before them,
    varlen with checkpoints and grouped value heads: equal to the fp64 torch path."""
    from hyla.ops.triton.chunk import chunk_fwd

    gate = "kda" if variant.startswith("kda") else "gdn"
    _, ref = _chunk_pair(gate)
    lens, H, HV, K = [70, 1, 65], 1, 2, 32  # two chunks, one token, a chunk and one token
    cu = torch.tensor([0, 70, 71, 136])
    gen = torch.Generator().manual_seed(71)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    T = sum(lens)
    q, k, v = r(1, T, H, K) * 2, r(1, T, H, K) * 2, r(1, T, HV, K)
    beta_logit = r(1, T, HV)
    h0 = r(3, HV, K, K)
    kw = dict(use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True, output_final_state=True,
              checkpoint_positions=[[1, 64, 69], [1], [65, 64, 3]])
    if variant == "gdn_gate":
        raw = -torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    else:
        raw = r(1, T, HV, K) if gate == "kda" else r(1, T, HV)
        A_log = torch.rand(HV, generator=gen, dtype=torch.float64) * 2.7
        dt_bias = r(HV * K) if gate == "kda" else r(HV)
        kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        if variant == "kda_v2":
            kw["lower_bound"] = -5.0
    o_ref, s_ref, c_ref = ref(q, k, v, raw, beta_logit, initial_state=h0, cu_seqlens=cu, **kw)
    if "A_log" in kw:
        kw.update(A_log=kw["A_log"].float().to(DEV), dt_bias=kw["dt_bias"].float().to(DEV))
    o, s, c = chunk_fwd(*_f32(q, k, v, raw, beta_logit), gate=gate, initial_state=h0.float().to(DEV),
                        cu_seqlens=cu.to(DEV), precompute_gate=mode == "precompute",
                        slice_k=16, factor_slice=16, wu_in_scan=wu_in_scan, **kw)
    _check(o, o_ref, "o")
    _check(s, s_ref, "final state")
    for n in range(3):
        _check(c[n], c_ref[n], f"checkpoints of sequence {n}")


@pytest.mark.parametrize("gate", ["gdn", "none"])
@pytest.mark.parametrize("wu_in_scan", [True, False])
def test_chunk_scalar_gate_factors_in_scan_or_factor_kernel(gate, wu_in_scan):
    """Scalar or no gate: the scan building w, u, qg, kg from the raw inputs and row scales
    (wu_in_scan, the default) and the factor-kernel path both equal the fp64 torch path, on
    varlen rows with checkpoints at odd positions, grouped value heads, K != V, a fused gate
    with beta sigmoid and L2 norm, and steep chunks (decays of -30 .. -3000 per token)."""
    from hyla.ops.triton.chunk import chunk_fwd

    ref = CHUNK[gate][1]
    lens, H, HV, K, V = [70, 1, 150], 1, 2, 32, 48
    cu = torch.tensor([0, 70, 71, 221])
    gen = torch.Generator().manual_seed(29)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    T = sum(lens)
    q, k, v = r(1, T, H, K) * 2, r(1, T, H, K) * 2, r(1, T, HV, V)
    beta_logit = r(1, T, HV)
    h0 = r(3, HV, K, V)
    kw = dict(use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True, output_final_state=True,
              checkpoint_positions=[[1, 64, 69], [1], [65, 128, 3, 150]])
    raw = None
    if gate == "gdn":
        raw = -torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
        raw[:, 90:94] = -3000.0  # a steep chunk in the third sequence
        raw[:, 150:160, 1] *= 100.0
    args = (q, k, v, raw, beta_logit) if gate == "gdn" else (q, k, v, beta_logit)
    o_ref, s_ref, c_ref = ref(*args, initial_state=h0, cu_seqlens=cu, **kw)
    o, s, c = chunk_fwd(*_f32(q, k, v, raw, beta_logit), gate=None if gate == "none" else gate,
                        initial_state=h0.float().to(DEV), cu_seqlens=cu.to(DEV), wu_in_scan=wu_in_scan, **kw)
    _check(o, o_ref, "o")
    _check(s, s_ref, "final state")
    for n in range(3):
        _check(c[n], c_ref[n], f"checkpoints of sequence {n}")


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_chunk_low_precision_inverse(gate):
    """low_precision_inverse with fp16 inputs: L^-1 goes to the factor kernel in fp16 and its
    products run in fp16. Same function as the fp32-inverse path up to fp16 rounding (the
    outputs are fp16: 2^-11 ~ 5e-4 per element, summed over the chunk's 64 tokens); the fp32
    L^-1 copy would be bit-identical whichever path, so a wrong copy or a dropped dot fails."""
    from hyla.ops.triton.chunk import chunk_fwd

    _, ref = _chunk_pair(gate)
    q, k, v, g, beta, h0 = make_inputs(2, 100, 2, 32, 32, gate=gate, seed=23)
    o_ref, s_ref = ref(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    half = [x.to(torch.float16).to(DEV) for x in (q, k, v)]
    outs = {}
    for low in (False, True):
        outs[low] = chunk_fwd(*half, g.float().to(DEV), beta.to(torch.float16).to(DEV), gate=gate,
                              initial_state=h0.float().to(DEV), output_final_state=True,
                              low_precision_inverse=low)
    for low, (o, s) in outs.items():
        assert rel_err(o.float().cpu(), o_ref.cpu()) <= 5e-3, (low, rel_err(o.float().cpu(), o_ref.cpu()))
        assert rel_err(s.cpu(), s_ref.cpu()) <= 5e-3
    assert rel_err(outs[True][0].float().cpu(), outs[False][0].float().cpu()) <= 3e-3


@pytest.mark.parametrize("bad", [0, 300, 128.0, True, "168"])
def test_chunk_rejects_bad_register_caps(bad):
    from hyla.ops.triton.chunk import chunk_fwd

    q, k, v, g, beta, _ = make_inputs(1, 20, 1, 16, 16, gate="gdn", seed=2)
    args = _f32(q, k, v, g, beta)
    for name in ("gram_maxnreg", "factor_maxnreg"):
        with pytest.raises(ValueError, match=name):
            chunk_fwd(*args, gate="gdn", **{name: bad})


def test_chunk_kda_takes_the_scan_form_with_or_without_checkpoints(monkeypatch):
    """KDA's default path launches no factor kernel, with checkpoints too (they come from the
    token recurrence, spied on here); wu_in_scan=False takes the factor kernel's path (its fast
    and steep passes) and its checkpoint states, not the recurrence."""
    from hyla.ops.triton import chunk as tc

    launches, recurrences = [], []
    factor_kernel, by_recurrence = tc.chunk_factors_kernel, tc._checkpoints_by_recurrence

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return factor_kernel[grid]

    def recurrence_spy(*a, **kw):
        recurrences.append(1)
        return by_recurrence(*a, **kw)

    monkeypatch.setattr(tc, "chunk_factors_kernel", Spy())
    monkeypatch.setattr(tc, "_checkpoints_by_recurrence", recurrence_spy)
    q, k, v, g, beta, _ = make_inputs(1, 70, 1, 16, 16, gate="kda", seed=4)
    args = _f32(q, k, v, g, beta)
    tc.chunk_fwd(*args, gate="kda")
    assert launches == [] and recurrences == []
    _, _, (scan_ck,) = tc.chunk_fwd(*args, gate="kda", checkpoint_positions=[[5, 69]])
    assert launches == [] and recurrences == [1]
    _, _, (factor_ck,) = tc.chunk_fwd(*args, gate="kda", checkpoint_positions=[[5, 69]], wu_in_scan=False)
    assert len(launches) == 2 and recurrences == [1]
    torch.testing.assert_close(scan_ck, factor_ck, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_chunk_checkpoint_tables_are_shared_by_a_steps_layers(gate):
    """An engine step hands every layer the same cu_seqlens tensor: the checkpoint tables (and
    KDA's recurrence rows) are built once for it and reused by the next layer's call, whose
    inputs differ; a call with other checkpoints on that tensor gets its own. Each call's
    checkpoints equal those of a call on a fresh cu_seqlens (nothing cached)."""
    from hyla.ops.triton import chunk as tc

    built = []
    tables = tc._checkpoint_tables
    cu = torch.tensor([0, 70, 100], device=DEV)
    calls = [(3, [[5, 69], [30]]), (5, [[5, 69], [30]]), (7, [[64], [1, 29]])]
    for seed, positions in calls:
        q, k, v, g, beta, _ = make_inputs(1, 100, 2, 16, 16, gate=gate, seed=seed)
        args = _f32(q, k, v, g, beta)
        tc._checkpoint_tables = lambda *a: (built.append(1), tables(*a))[1]
        try:
            _, _, shared = tc.chunk_fwd(*args, gate=gate, cu_seqlens=cu, checkpoint_positions=positions)
        finally:
            tc._checkpoint_tables = tables
        _, _, fresh = tc.chunk_fwd(*args, gate=gate, cu_seqlens=cu.clone(), checkpoint_positions=positions)
        for a, b in zip(shared, fresh):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(built) == 2  # the second call reused the first's tables; the third had other checkpoints


def test_chunk_kda_scan_form_refuses_an_fp32_inverse_with_bf16_inputs():
    """KDA's scan form with an fp32 L^-1 beside bf16 operands was miscompiled by Triton 3.6 on an
    H200: asked for explicitly it is refused by name; low_precision_inverse=False alone takes the
    factor kernel's path (and is exact: test_chunk_low_precision_inverse)."""
    from hyla.ops.triton.chunk import chunk_fwd

    q, k, v, g, beta, _ = make_inputs(1, 20, 1, 16, 16, gate="kda", seed=2)
    low = [x.to(torch.bfloat16).to(DEV) for x in (q, k, v, beta)]
    with pytest.raises(ValueError, match="low_precision_inverse"):
        chunk_fwd(*low[:3], g.float().to(DEV), low[3], gate="kda", wu_in_scan=True, low_precision_inverse=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunk_refuses_an_unpipelined_low_precision_scan(dtype):
    """scan_stages=1 with bf16 / fp16 operands is refused (Triton 3.6 miscompiled it on an H200);
    fp32 runs unpipelined by default, so 1 stays valid there."""
    from hyla.ops.triton.chunk import chunk_fwd

    q, k, v, g, beta, _ = make_inputs(1, 20, 1, 16, 16, gate="gdn", seed=2)
    low = [t.to(DEV, dtype) for t in (q, k, v)]
    with pytest.raises(ValueError, match="scan_stages"):
        chunk_fwd(*low, g.float().to(DEV), beta.to(DEV, dtype), gate="gdn", scan_stages=1)


@pytest.mark.parametrize("wu_in_scan", [True, False])
def test_chunk_kda_steep_chunks_and_checkpoints(wu_in_scan):
    """Per-channel gate with steep chunks (both kernels' second passes), K != V and checkpoints
    in a steep chunk and at a chunk end; the Gram kernel's decayed tiles read by the scan
    (wu_in_scan) or the factor kernel's."""
    from hyla.ops.triton.chunk import chunk_fwd

    q, k, v, g, beta, h0 = make_inputs(1, 200, 2, 32, 48, seed=31)
    g = -g.abs() * 0.05
    g[:, 70:80, 1, :5] = -40.0
    g[:, 150:152, 0] = -3000.0
    ck = [[75, 1, 64, 151, 200]]
    o_ref, s_ref, c_ref = torch_chunk.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                checkpoint_positions=ck)
    o, s, c = chunk_fwd(*_f32(q, k, v, g, beta), gate="kda", initial_state=h0.float().to(DEV),
                        output_final_state=True, checkpoint_positions=ck, wu_in_scan=wu_in_scan)
    _check(o, o_ref, "o")
    _check(s, s_ref, "final state")
    _check(c[0], c_ref[0], "checkpoints")


def test_chunk_two_pass_gram_mixes_fast_and_steep_chunks():
    """A per-channel gate's Gram kernel runs a fast pass that skips the chunks where a channel
    decays past e^-140, then a pass over those only: one steep (chunk, head) among fast ones,
    in a sequence whose other chunks and other head stay on the fast path, is exact."""
    fast, ref = _chunk_pair("kda")
    q, k, v, g, beta, h0 = make_inputs(1, 200, 2, 32, 32, seed=5)
    g = -g.abs() * 0.05
    g[:, 70:80, 1, :5] = -40.0  # chunk 1, head 1: five channels lose e^-400
    o_ref, s_ref = ref(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = fast(*_f32(q, k, v, g, beta), initial_state=h0.float().to(DEV), output_final_state=True, slice_k=16)
    _check(o, o_ref, "o")
    _check(s, s_ref, "final state")


def test_chunk_steep_scalar_decays():
    """GDN decays of -30 .. -3000 per token on some tokens: the scalar-gate Gram assembles its
    pairwise exponents from sub-block pieces, so steep chunks stay exact (no overflow, no
    cancellation between large cumulative sums).

    Inside a sub-block a pair's exponent is summed directly over the tokens between them (a
    difference of two cumsums near -12,000 would keep fp32's 2^-10 spacing there: 0.6-1.5e-4 on
    o before). Over 12 draws of the steep pattern o is within 1.4e-7, the states within 7.4e-6."""
    fast, ref = _chunk_pair("gdn")
    q, k, v, g, beta, h0 = make_inputs(1, 150, 2, 32, 32, gate="gdn", seed=13)
    steep = torch.rand(1, 150, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(13)) < 0.2
    g = torch.where(steep, g * 100.0, g)
    g[:, 20:24] = -3000.0
    o_ref, s_ref, c_ref = ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                              checkpoint_positions=[[22, 150]])
    o, s, c = fast(*_f32(q, k, v, g, beta), initial_state=h0.float().to(DEV), output_final_state=True,
                   checkpoint_positions=[[22, 150]])
    _check(o, o_ref, "o", tol=1e-6)
    _check(s, s_ref, "final state")
    _check(c[0], c_ref[0], "checkpoints")


# ---- decode / verify ------------------------------------------------------------------------


@pytest.mark.parametrize("layout,persistent", [("kv", None), ("klast", None), ("klast", False)])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_decode_over_a_pool_with_padding_rows(gate, layout, persistent):
    """Both pool layouts, default launches (a K-last pool: 8-column tiles, one warp, when not
    persistent; K = 48 is ragged in 16 rows)."""
    name, ref = REC[gate]
    fast = getattr(hyla_triton, name)
    N, H, K, V = 5, 2, 48, 32
    q, k, v, g, beta, _ = make_inputs(N, 1, H, K, V, gate=gate, seed=31)
    pool = torch.randn(9, H, K, V, dtype=torch.float64)
    idx = torch.tensor([7, 2, -1, 0, 5])
    pool_ref = pool.clone()
    o_ref, _ = ref(q, k, v, g, beta, initial_state=pool_ref, ssm_state_indices=idx)
    pool_fast = pool.float().to(DEV)
    if layout == "klast":
        pool_fast = as_k_last(pool_fast)
    o, out_pool = fast(*_f32(q, k, v, g, beta), initial_state=pool_fast, ssm_state_indices=idx.to(DEV),
                       persistent=persistent)
    assert out_pool is pool_fast  # in place
    _check(o, o_ref, "o")
    assert torch.all(o[2] == 0), "a padding row's output is 0"
    _check(pool_fast, pool_ref, "pool")


def _decode_step(variant, N, H, HV, K, V, gen):
    """One decode token per sequence in fp64 for the torch path -> (q, k, v, g, beta, kw):
    variant "kda" / "gdn" with precomputed log-decays, "kda_v1" / "gdn_v1" with the raw gate and
    its A_log / dt_bias in kw (use_gate_in_kernel); q / k L2-normed in the kernel."""
    gate = variant[:3]
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(N, 1, H, K), r(N, 1, H, K), r(N, 1, HV, V)
    beta = torch.rand(N, 1, HV, generator=gen, dtype=torch.float64)
    gshape = (N, 1, HV, K) if gate == "kda" else (N, 1, HV)
    kw = dict(use_qk_l2norm_in_kernel=True)
    if variant.endswith("v1"):
        g = r(*gshape)
        kw.update(use_gate_in_kernel=True, A_log=torch.rand(HV, generator=gen, dtype=torch.float64),
                  dt_bias=r(HV * K) if gate == "kda" else r(HV))
    else:
        g = -torch.rand(*gshape, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, kw


def _on_device(kw):
    """_decode_step's kw with its gate parameters as the kernels take them (fp32 on DEV)."""
    if "A_log" not in kw:
        return kw
    return {**kw, "A_log": kw["A_log"].float().to(DEV), "dt_bias": kw["dt_bias"].float().to(DEV)}


# each launch form with one gate variant, the variants in turn (each two or three times): the loop
# forms and layouts are gate-independent code, the gates the same token_step in every form
@pytest.mark.parametrize("variant,K,block_v,stages,layout", [
    ("kda", 32, None, None, "kv"), ("kda_v1", 32, 32, None, "kv"), ("gdn", 256, None, None, "kv"),
    ("gdn_v1", 160, 32, None, "kv"), ("kda", 32, 16, 3, "kv"), ("kda_v1", 256, 16, 0, "kv"),
    ("gdn", 32, None, None, "klast"), ("gdn_v1", 160, 32, None, "klast"), ("kda", 256, 16, 0, "klast"),
    ("gdn_v1", 32, 16, 3, "klast")])
def test_persistent_decode_equals_torch(variant, K, block_v, stages, layout):
    """The persistent decode kernel with few programs (each walks several tiles), padding rows
    and value blocks narrower than V = 48 (the last one ragged): K = 32 takes the one-tile
    register prefetch, K = 256 the software-pipelined loop, K = 160 a ragged K as well; an
    explicit decode_stages swaps the two loop forms; both pool layouts. Same outputs and pool
    as the torch path."""
    from hyla.ops.triton.recurrent import _decode_launch, recurrent_fwd

    assert _decode_launch(128, 48, 4, None, None, None)[3] == 0 and _decode_launch(256, 48, 4, None, None, None)[3] >= 2
    gate = variant[:3]
    _, ref = REC[gate]
    N, H, HV, V = 6, 1, 2, 48
    gen = torch.Generator().manual_seed(81)
    q, k, v, g, beta, kw = _decode_step(variant, N, H, HV, K, V, gen)
    pool = torch.randn(11, HV, K, V, generator=gen, dtype=torch.float64)
    idx = torch.tensor([7, 2, -1, 0, 10, 5])
    pool_ref = pool.clone()
    o_ref, _ = ref(q, k, v, g, beta, initial_state=pool_ref, ssm_state_indices=idx, **kw)
    kw = _on_device(kw)
    pool_fast = pool.float().to(DEV)
    if layout == "klast":
        pool_fast = as_k_last(pool_fast)
    o, _ = recurrent_fwd(*_f32(q, k, v, g, beta), gate=gate, initial_state=pool_fast,
                         ssm_state_indices=idx.to(DEV), persistent=True, block_v=block_v, programs_per_sm=1,
                         decode_stages=stages, **kw)
    _check(o, o_ref, "o")
    assert torch.all(o[2] == 0), "a padding row's output is 0"
    _check(pool_fast, pool_ref, "pool")
    assert torch.equal(pool_fast[[1, 3, 4, 6, 8, 9]].cpu(), pool[[1, 3, 4, 6, 8, 9]].float()), "unaddressed slots"


@pytest.mark.parametrize("N", [5, 30])
@pytest.mark.parametrize("variant", ["kda", "kda_v1", "gdn_v1"])
def test_k_last_pool_default_launches(variant, N):
    """A K-last pool with the default launch, which depends on the grid (_klast_decode_launch;
    the interpreter counts one SM): N = 5 takes the persistent prefetch loop, N = 30 one program
    per 8-column tile, or with KDA's gate computed in the kernel the persistent loop over
    8-column tiles. Same outputs and pool as the torch path."""
    from hyla.ops.triton.recurrent import _klast_decode_launch, num_sms

    gate = variant[:3]
    _, ref = REC[gate]
    H, K, V = 2, 32, 32
    tiles_per_sm = N * H * (V // 16) / num_sms(torch.device(DEV))
    assert _klast_decode_launch(K, tiles_per_sm, variant == "kda_v1") == (
        (True, 16, 1, 8) if N == 5 else (True, 8, 1, 16) if variant == "kda_v1" else (False, 8, 1, 0))
    gen = torch.Generator().manual_seed(N)
    q, k, v, g, beta, kw = _decode_step(variant, N, H, H, K, V, gen)
    pool = torch.randn(N + 4, H, K, V, generator=gen, dtype=torch.float64)
    idx = torch.randperm(N + 4, generator=gen)[:N]
    idx[1] = -1
    pool_ref = pool.clone()
    o_ref, _ = ref(q, k, v, g, beta, initial_state=pool_ref, ssm_state_indices=idx, **kw)
    kw = _on_device(kw)
    pool_fast = as_k_last(pool.float().to(DEV))
    o, _ = getattr(hyla_triton, REC[gate][0])(*_f32(q, k, v, g, beta), initial_state=pool_fast,
                                              ssm_state_indices=idx.to(DEV), **kw)
    _check(o, o_ref, "o")
    assert torch.all(o[1] == 0), "a padding row's output is 0"
    _check(pool_fast, pool_ref, "pool")


@pytest.mark.parametrize("layout", ["kv", "klast"])
@pytest.mark.parametrize("variant", ["kda_v1", "gdn"])
def test_persistent_pool_kernel_over_rows_of_several_tokens(variant, layout):
    """The persistent pool kernel on rows of T = 3 tokens each (no cu_seqlens) with a 1-D pool
    index and a padding row: every row's state stepped through its tokens and written back to
    its slot, as the torch path does."""
    from hyla.ops.triton.recurrent import recurrent_fwd

    gate = variant[:3]
    _, ref = REC[gate]
    N, T, H, K, V = 4, 3, 2, 32, 48
    gen = torch.Generator().manual_seed(5)
    steps = [_decode_step(variant, N, H, H, K, V, gen) for _ in range(T)]
    q, k, v, g, beta = (torch.cat([s[i] for s in steps], dim=1) for i in range(5))
    kw = steps[0][5]
    pool = torch.randn(7, H, K, V, generator=gen, dtype=torch.float64)
    idx = torch.tensor([6, -1, 0, 3])
    pool_ref = pool.clone()
    o_ref, _ = ref(q, k, v, g, beta, initial_state=pool_ref, ssm_state_indices=idx, **kw)
    pool_fast = pool.float().to(DEV)
    if layout == "klast":
        pool_fast = as_k_last(pool_fast)
    o, _ = recurrent_fwd(*_f32(q, k, v, g, beta), gate=gate, initial_state=pool_fast, ssm_state_indices=idx.to(DEV),
                         persistent=True, programs_per_sm=1, **_on_device(kw))
    _check(o, o_ref, "o")
    assert torch.all(o[1] == 0), "a padding row's output is 0"
    _check(pool_fast, pool_ref, "pool")
    assert torch.equal(pool_fast[[1, 2, 4, 5]].cpu(), pool[[1, 2, 4, 5]].float()), "unaddressed slots"


def test_persistent_decode_rejects_other_calls():
    from hyla.ops.triton.recurrent import recurrent_fwd

    q, k, v, g, beta, _ = make_inputs(2, 2, 2, 32, 32, seed=3)
    with pytest.raises(ValueError, match="persistent=True needs a state pool"):  # per-sequence states
        recurrent_fwd(*_f32(q, k, v, g, beta), gate="kda", initial_state=torch.zeros(2, 2, 32, 32, device=DEV),
                      persistent=True)
    # the persistent kernel's own knobs on a call that does not take it, and a bad loop depth
    step = _f32(*(x[:, :1] for x in (q, k, v, g, beta)))
    pool = torch.zeros(4, 2, 32, 32, device=DEV)
    idx = torch.tensor([0, 1], device=DEV)
    for knob in (dict(programs_per_sm=4), dict(decode_stages=0)):
        with pytest.raises(ValueError, match="does not take that kernel"):
            recurrent_fwd(*step, gate="kda", initial_state=pool, ssm_state_indices=idx, persistent=False, **knob)
    for knobs in (dict(prefetch_next_token=1), dict(prefetch_next_token=True, persistent=True)):
        with pytest.raises(ValueError, match="prefetch_next_token"):
            recurrent_fwd(*step, gate="kda", initial_state=pool, ssm_state_indices=idx, **knobs)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="decode_stages"):
            recurrent_fwd(*step, gate="kda", initial_state=pool, ssm_state_indices=idx, persistent=True,
                          decode_stages=bad)


def test_pool_of_other_strides_is_an_error():
    """The pool is updated in place, so only its two layouts are taken: a pool whose head axis
    is not where it belongs (or any other view) is a ValueError naming both, never a silent copy."""
    from hyla.ops.triton.recurrent import recurrent_fwd

    q, k, v, g, beta, _ = make_inputs(2, 1, 2, 32, 32, seed=3)
    idx = torch.tensor([0, 1], device=DEV)
    odd = torch.zeros(2, 4, 32, 32, device=DEV).transpose(0, 1)  # heads outermost: [4, 2, 32, 32] view
    with pytest.raises(ValueError, match="contiguous .* or K-last"):
        recurrent_fwd(*_f32(q, k, v, g, beta), gate="kda", initial_state=odd, ssm_state_indices=idx)


@pytest.mark.parametrize("launch", ["default", "prefetch", "persistent"])
@pytest.mark.parametrize("layout", ["kv", "klast"])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_verify_with_rejected_drafts(gate, layout, launch):
    """[N, 1 + num_spec] slots, varlen drafts, num_accepted_tokens from the previous step: the
    state after token j lands in slot j only; untouched slots keep their contents. Default
    launch, one program per tile with the next token's inputs and slot prefetched, the persistent
    pool kernel with one program walking every tile."""
    name, ref = REC[gate]
    fast = getattr(hyla_triton, name)
    H, K, V = 2, 32, 32
    lens = [4, 2, 3, 1]
    cu = torch.tensor([0, 4, 6, 9, 10])
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), H, K, V, gate=gate, seed=41)
    pool = torch.randn(20, H, K, V, dtype=torch.float64)
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, -1, 10, 11], [-1, -1, -1, -1]])
    n_acc = torch.tensor([3, 1, 1, 2])
    pool_ref = pool.clone()
    o_ref, _ = ref(q, k, v, g, beta, initial_state=pool_ref, cu_seqlens=cu, ssm_state_indices=idx,
                   num_accepted_tokens=n_acc)
    pool_fast = pool.float().to(DEV)
    if layout == "klast":
        pool_fast = as_k_last(pool_fast)
    knobs = {"default": {}, "prefetch": dict(prefetch_next_token=True),
             "persistent": dict(persistent=True, programs_per_sm=1)}[launch]
    o, _ = fast(*_f32(q, k, v, g, beta), initial_state=pool_fast, cu_seqlens=cu.to(DEV),
                ssm_state_indices=idx.to(DEV), num_accepted_tokens=n_acc.to(DEV), **knobs)
    _check(o, o_ref, "o")
    _check(pool_fast, pool_ref, "pool")
    assert torch.equal(pool_fast[12:].cpu(), pool[12:].float()), "unaddressed slots must stay untouched"


def _column_blocks(*xs):
    """fp32 copies of xs [B, T, H_i, D_i] on DEV laid side by side in one [B, T, sum + 5] buffer
    (5 spare columns), each returned as a view of its columns: strided token rows, contiguous
    heads -- how a verify step's q, k, v come out of its conv."""
    B, T = xs[0].shape[:2]
    widths = [x[0, 0].numel() for x in xs]
    buf = torch.randn(B, T, sum(widths) + 5, device=DEV)
    out, c = [], 0
    for x, w in zip(xs, widths):
        view = buf[..., c:c + w].unflatten(-1, x.shape[2:])
        view.copy_(x.float().to(DEV))
        out.append(view)
        c += w
    return out


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("shape", ["verify", "verify_prefetch", "decode"])
def test_recurrent_reads_strided_token_rows_in_place(gate, shape):
    """q, k, v as column blocks of one buffer (a verify's conv output, with or without the next
    token's inputs prefetched; a decode batch [N, 1, ...] of such rows): read through their row
    stride without a copy, same outputs and pool as the fp64 reference on contiguous inputs."""
    from hyla.ops.triton.recurrent import _token_rows

    name, ref = REC[gate]
    fast = getattr(hyla_triton, name)
    H, HV, K, V = 2, 4, 32, 16
    if shape.startswith("verify"):
        cu = torch.tensor([0, 3, 4, 7])
        idx = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, -1]])
        kw = dict(cu_seqlens=cu, ssm_state_indices=idx, num_accepted_tokens=torch.tensor([2, 1, 3]))
        q, k, v, g, beta, _ = make_inputs(1, 7, H, K, V, gate=gate, hv=HV, seed=43)
    else:
        kw = dict(ssm_state_indices=torch.tensor([5, -1, 0, 2]))
        q, k, v, g, beta, _ = make_inputs(4, 1, H, K, V, gate=gate, hv=HV, seed=44)
    pool = torch.randn(9, HV, K, V, dtype=torch.float64)
    pool_ref = pool.clone()
    o_ref, _ = ref(q, k, v, g, beta, initial_state=pool_ref, **kw)
    qs, ks, vs = _column_blocks(q, k, v)
    assert not qs.is_contiguous() and all(_token_rows(t)[0] is t for t in (qs, ks, vs)), "read in place"
    pool_fast = pool.float().to(DEV)
    o, _ = fast(qs, ks, vs, *_f32(g, beta), initial_state=pool_fast, prefetch_next_token=shape == "verify_prefetch",
                **{key: val.to(DEV) for key, val in kw.items()})
    _check(o, o_ref, "o")
    _check(pool_fast, pool_ref, "pool")


def test_token_rows_copies_what_it_cannot_address():
    """Heads not contiguous inside a row, or two batch entries' rows not evenly spaced: copied;
    a contiguous tensor is read as it is."""
    from hyla.ops.triton.recurrent import _token_rows

    heads_apart = torch.randn(1, 3, 4, 10)[..., :8]
    got, stride = _token_rows(heads_apart)
    assert got is not heads_apart and got.is_contiguous() and stride == 32
    uneven = torch.randn(2, 5, 4, 8)[:, :3]  # entries 5 rows apart, 3 rows each
    got, stride = _token_rows(uneven)
    assert got is not uneven and got.is_contiguous() and stride == 32
    x = torch.randn(2, 3, 4, 8)
    got, stride = _token_rows(x)
    assert got is x and stride == 32


@pytest.mark.parametrize("prefetch", [None, True])
@pytest.mark.parametrize("variant", ["kda_v1", "kda_v2", "gdn"])
def test_recurrent_plain_states_with_fused_gate(variant, prefetch):
    """Per-sequence states (no pool), raw gates, beta logits; the default launch and the next
    token's inputs prefetched."""
    gate = "kda" if variant.startswith("kda") else "gdn"
    name, ref = REC[gate]
    fast = getattr(hyla_triton, name)
    B, T, H, K = 3, 3, 2, 32
    gen = torch.Generator().manual_seed(51)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, K)
    raw = r(B, T, H, K) if gate == "kda" else r(B, T, H)
    beta_logit = r(B, T, H)
    h0 = r(B, H, K, K)
    A_log = torch.rand(H, generator=gen, dtype=torch.float64)
    dt_bias = r(H * K) if gate == "kda" else r(H)
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
              use_qk_l2norm_in_kernel=True, output_final_state=True)
    if variant == "kda_v2":
        kw["lower_bound"] = -5.0
    o_ref, s_ref = ref(q, k, v, raw, beta_logit, initial_state=h0, **kw)
    kw.update(A_log=A_log.float().to(DEV), dt_bias=dt_bias.float().to(DEV))
    o, s = fast(*_f32(q, k, v, raw, beta_logit), initial_state=h0.float().to(DEV), prefetch_next_token=prefetch,
                **kw)
    _check(o, o_ref, "o")
    _check(s, s_ref, "final state")


def test_decode_after_prefill_continues_the_same_recurrence():
    """Split-resume across the two kernels: prefill [:s] (chunk), then decode the rest token by
    token from a pool (recurrent) == one torch pass over everything."""
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 32, 32, seed=61)
    o_ref, s_ref = torch_chunk.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    q, k, v, g, beta, h0 = _f32(q, k, v, g, beta, h0)
    o1, s = hyla_triton.chunk_kda(q[:, :67], k[:, :67], v[:, :67], g[:, :67], beta[:, :67], initial_state=h0,
                                  output_final_state=True)
    pool = torch.zeros(3, 2, 32, 32, device=DEV)
    pool[1] = s[0]
    outs = [o1]
    for t in range(67, 70):
        sl = slice(t, t + 1)
        o_t, _ = hyla_triton.fused_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                                 initial_state=pool, ssm_state_indices=torch.tensor([1], device=DEV))
        outs.append(o_t)
    _check(torch.cat(outs, 1), o_ref, "o")
    _check(pool[1:2], s_ref, "state")


# ---- dispatch -----------------------------------------------------------------------------------


def test_dispatch_routes_by_backend_and_keeps_autograd_on_torch(monkeypatch):
    import hyla.ops as ops
    from hyla.ops.dispatch import backend_for

    q, k, v, g, beta, _ = _f32(*make_inputs(1, 20, 2, 32, 32, seed=71))
    use_backend(monkeypatch, "triton")
    assert backend_for(q, v, [q, k, v]) == "triton"
    o_fast, _ = ops.chunk_kda(q, k, v, g, beta)
    use_backend(monkeypatch, "torch")
    assert backend_for(q, v, [q, k, v]) == "torch"
    o_torch, _ = ops.chunk_kda(q, k, v, g, beta)
    _check(o_fast, o_torch, "dispatched o")
    use_backend(monkeypatch, "triton")
    qg = q.clone().requires_grad_()
    assert backend_for(qg, v, [qg, k, v]) == "torch"
    o, _ = ops.chunk_kda(qg, k, v, g, beta)
    o.sum().backward()  # the torch path, with autograd
    assert qg.grad is not None
    assert backend_for(q.double(), v.double(), [q]) == "torch"
    use_backend(monkeypatch, "auto")
    assert backend_for(q, v, [q]) == ("triton" if q.is_cuda else "torch")
    with pytest.raises(ValueError, match="HYLA_BACKEND"):
        use_backend(monkeypatch, "cuda")


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_kcp_local_pass_on_the_kernel(gate, monkeypatch):
    """KCP's one pass per rank (values [v | 0] from state [0 | I]) on the kernel: its outputs
    plus P @ S_in, and its (M, S~), match the torch chunk path from S_in."""
    from hyla.ops.affine import segment_affine
    from hyla.parallel import add_incoming, local_pass

    use_backend(monkeypatch, "triton")
    name, ref = CHUNK[gate]
    q, k, v, g, beta, s_in = make_inputs(1, 70, 2, 16, 24, gate=gate, seed=5)
    o_zero, P, M, S = local_pass(*_f32(q, k, v, g, beta), gate=gate)
    o_ref, _ = ref(q, k, v, g, beta, initial_state=s_in)
    _check(add_incoming(o_zero, P, s_in.float().to(DEV)), o_ref, "o")
    use_backend(monkeypatch, "torch")
    M_ref, S_ref = segment_affine(k, v, g, beta, gate=gate)
    _check(M, M_ref, "M")
    _check(S, S_ref, "S~")


@pytest.mark.parametrize("L, W, bias, act", [(1, 4, False, "silu"), (3, 4, True, "silu"), (2, 2, False, None),
                                              (5, 4, True, None)])
def test_conv_update_matches_torch(L, W, bias, act):
    """The short-conv update kernel vs the torch op: outputs, and the pool after the in-place
    update (live slots advanced, the padding row's nothing, untouched slots unchanged), with
    D = 200 (two channel blocks, a partial one) and L both below and above W - 1."""
    from hyla.ops import conv as torch_conv

    gen = torch.Generator().manual_seed(L * 10 + W)
    N, D, slots = 4, 200, 7
    x = torch.randn(N, L, D, generator=gen)
    pool = torch.randn(slots, D, W - 1, generator=gen)
    weight = torch.randn(D, W, generator=gen)
    b = torch.randn(D, generator=gen) if bias else None
    idx = torch.tensor([5, -1, 0, 3])
    want_pool = pool.clone()
    want = torch_conv.causal_conv1d_update(x, want_pool, weight, b, act, idx)
    got_pool = pool.clone().to(DEV)
    got = hyla_triton.causal_conv1d_update(*_f32(x), got_pool, *_f32(weight, b), act, idx.to(DEV))
    assert got.shape == want.shape and got.dtype == x.dtype
    _check(got, want, "y")
    assert (got[1] == 0).all(), "a padding row outputs zeros"
    _check(got_pool, want_pool, "pool")
    assert torch.equal(got_pool.cpu()[[1, 2, 4, 6]], pool[[1, 2, 4, 6]]), "slots nobody owns stay as they were"
    one = hyla_triton.causal_conv1d_update(*_f32(x[:, 0]), pool.clone().to(DEV), *_f32(weight), None, act,
                                           idx.to(DEV))  # [N, D] form
    assert one.shape == (N, D)


@pytest.mark.parametrize("L, W", [(1, 4), (4, 4), (6, 3)])
def test_conv_verify_matches_torch(L, W):
    """The verify conv kernel vs the torch op: outputs of live rows, and per-position windows
    written to their slots, including a row whose position-1 slot is the slot it starts from
    (the old window must be read before it is overwritten) and -1 slots that write nothing."""
    from hyla.ops import conv as torch_conv

    gen = torch.Generator().manual_seed(L * 7 + W)
    N, D = 3, 150
    x = torch.randn(N, L, D, generator=gen)
    # As the engine lays them out: row n owns slots own[n, 0..L]; position j writes own[n, j] and
    # the row starts from own[n, a_n - 1]. Row 0 starts from own[0, 1] (its position 1 overwrites
    # the slot it read), row 2's last position writes nothing.
    own = torch.arange(N * (L + 1)).view(N, L + 1).flip(1) + 1  # slot 0 left unowned
    pool = torch.randn(N * (L + 1) + 1, D, W - 1, generator=gen)
    weight = torch.randn(D, W, generator=gen)
    read = own[torch.arange(N), torch.tensor([min(1, L - 1), 0, L - 1])]
    write = own[:, :L].clone()
    write[2, -1] = -1
    for writes in (write, None):
        want_pool = pool.clone()
        want = torch_conv.causal_conv1d_verify(x, want_pool, weight, None, "silu", read_indices=read,
                                               write_indices=writes)
        got_pool = pool.clone().to(DEV)
        got = hyla_triton.causal_conv1d_verify(*_f32(x), got_pool, *_f32(weight), None, "silu",
                                               read_indices=read.to(DEV),
                                               write_indices=None if writes is None else writes.to(DEV))
        assert got.shape == want.shape == (N, L, D)
        _check(got, want, "y")
        _check(got_pool, want_pool, "pool")
    pad = hyla_triton.causal_conv1d_verify(*_f32(x), pool.clone().to(DEV), *_f32(weight), None, "silu",
                                           read_indices=torch.tensor([-1, 1, 2]).to(DEV))
    assert (pad[0] == 0).all(), "a padding row (read slot -1) outputs zeros"
    # x as columns of a wider buffer (a verify's packed projection output): read in place
    wide = torch.randn(N, L, D + 7, device=DEV)
    wide[..., 3:3 + D] = x.float().to(DEV)
    cols = wide[..., 3:3 + D]
    want = hyla_triton.causal_conv1d_verify(cols.contiguous(), pool.clone().to(DEV), *_f32(weight), None, "silu",
                                            read_indices=read.to(DEV), write_indices=write.to(DEV))
    got_pool = pool.clone().to(DEV)
    got = hyla_triton.causal_conv1d_verify(cols, got_pool, *_f32(weight), None, "silu",
                                           read_indices=read.to(DEV), write_indices=write.to(DEV))
    assert torch.equal(got, want), "strided rows give the contiguous result"


@pytest.mark.parametrize("script", ["decode_schedules", "verify_schedules"])
def test_schedule_scripts_kernels_are_exact(script):
    """The benchmark scripts' own kernels (other schedules, no-work floors) against the shipped
    op, so their GPU tables time kernels that compute the right thing."""
    if DEV != "cpu":
        pytest.skip("their checks run on CPU tensors in the interpreter")
    from tests.scripts import load_script

    load_script(script).check()


def test_engine_launches_compile_for_the_gpu_without_spills():
    """scripts/kernel_registers.py --check: the decode / verify launches compiled for sm_90a by
    Triton's code generator and its bundled ptxas (no GPU needed), which the interpreter above
    never exercises; none may spill. Run in a child process without TRITON_INTERPRET."""
    import subprocess
    import sys
    from pathlib import Path

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"this triton build ships no ptxas ({ptxas})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "scripts" / "kernel_registers.py"), "--check"], env=env,
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| verify KDA, 8 col | " in out.stdout
