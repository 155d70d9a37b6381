"""The fused decode kernels (hyla.ops.triton.norm / gate / conv's multi-conv update) vs their torch
references, on awkward sizes (D = 24, 40, 128; rows 1, 3, 17), fresh random inputs, every output
buffer the kernels allocate pre-filled with NaN (an element a kernel fails to write fails the
test).

Tolerances: in fp32 the kernels compute the same function in the same order of roundings, but
their reductions (sum of squares) and transcendental functions (rsqrt, exp) are not torch's, so
they may differ in the last bits: we ask for a few fp32 ulps (rtol 4e-6 on the result). In bf16 /
fp16 the result must be within one ulp of the output dtype of the torch reference (the rounding
points are the same; a last-bit difference before a rounding can flip it by one ulp). On the
torch path (CPU, fp64) the fused ops are bit-equal to the unfused modules (tests/layers).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`
pytest.importorskip("triton", reason="triton is not installed (pip install 'hyla[triton]')")

from hyla.ops import gate as torch_gate  # noqa: E402
from hyla.ops import norm as torch_norm  # noqa: E402
from hyla.ops import triton as hyla_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and not hyla_triton.interpreting():
    pytest.skip("CPU tensors need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)

DIMS = [24, 40, 128]
ROWS = [1, 3, 17]
SIZES = [(24, 1), (40, 3), (128, 17), (40, 17)]  # (D, rows): every D and every row count, not the product


def fill_empties_with_nan(monkeypatch) -> None:
    """From now on every floating-point torch.empty starts as NaN (unwritten outputs show)."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every floating-point torch.empty the kernels' wrappers allocate starts as NaN."""
    fill_empties_with_nan(monkeypatch)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(DEV)


def ulp_diff(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected| per element in ulps of expected's dtype (bf16 / fp16), fp64 on the CPU."""
    mant = {torch.bfloat16: 7, torch.float16: 10}[expected.dtype]
    a, e = actual.double().cpu(), expected.double().cpu()
    mag = torch.maximum(a.abs(), e.abs()).clamp_min(2.0 ** -14)
    return (a - e).abs() / torch.exp2(torch.floor(torch.log2(mag)) - mant)


def assert_ulps(actual, expected, ulps=1):
    """fp32: within rtol 4e-6 (a few ulps); bf16 / fp16: within `ulps` ulp of the output dtype."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.double().cpu(), expected.double().cpu()
    assert not torch.isnan(a).any(), "unwritten (NaN) outputs"
    if expected.dtype == torch.float32:
        torch.testing.assert_close(a, e, rtol=4e-6, atol=1e-6)
        return
    bad = ulp_diff(actual, expected) > ulps
    assert not bad.any(), f"{int(bad.sum())} elements differ by more than {ulps} ulp: max {(a - e).abs().max():.3g}"


# -- RMSNorms ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,R", SIZES)
def test_rms_norms_match_torch(dtype, D, R):
    seed = D * 100 + R
    x = _randn(R, D, seed=seed, scale=3.0, dtype=dtype)
    w = _randn(D, seed=seed + 1, dtype=dtype)
    assert_ulps(hyla_triton.rms_norm_rounded(x, w, 1e-5), torch_norm.rms_norm_rounded(x, w, 1e-5))
    assert_ulps(hyla_triton.rms_norm_zero_centred(x, w, 1e-6), torch_norm.rms_norm_zero_centred(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,R", SIZES)
@pytest.mark.parametrize("zero_centred", [False, True])
def test_add_rms_norm_matches_torch(dtype, D, R, zero_centred):
    seed = D * 100 + R + 7
    x = _randn(2, R, D, seed=seed, scale=2.0, dtype=dtype)
    res = _randn(2, R, D, seed=seed + 1, scale=2.0, dtype=dtype)
    w = _randn(D, seed=seed + 2, dtype=dtype)
    y, h = hyla_triton.add_rms_norm(x, res, w, 1e-6, zero_centred)
    y_ref, h_ref = torch_norm.add_rms_norm(x, res, w, 1e-6, zero_centred)
    assert torch.equal(h, h_ref)  # the sum is one rounding of the same two numbers
    assert_ulps(y, y_ref)


def test_rms_norm_fp32_weight_on_bf16_input_keeps_torch_promotion():
    x = _randn(5, 40, seed=1, dtype=torch.bfloat16)
    w = _randn(40, seed=2)
    y = hyla_triton.rms_norm_rounded(x, w, 1e-6)
    assert y.dtype == torch.float32
    assert_ulps(y, torch_norm.rms_norm_rounded(x, w, 1e-6))


def test_strided_rows_read_in_place():
    """x and the residual as column slices of a wider tensor (a fused projection's output)."""
    big = _randn(6, 100, seed=3)
    x, res = big[:, 10:50], big[:, 50:90]
    w = _randn(40, seed=4)
    y, h = hyla_triton.add_rms_norm(x, res, w, 1e-6)
    y_ref, h_ref = torch_norm.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(h, h_ref)
    assert_ulps(y, y_ref)


@pytest.mark.parametrize("D", DIMS)
def test_head_rows_of_a_packed_projection_read_in_place(D):
    """q / k norms of attention: heads [T, H, D] cut out of a packed q ++ k ++ v output."""
    T, H = 5, 3
    out = _randn(T, 2 * H * D + H * D + 9, seed=D, dtype=torch.bfloat16)
    k = out[:, 2 * H * D:3 * H * D].unflatten(-1, (H, D))
    q = out[:, :2 * H * D].unflatten(-1, (H, 2 * D)).chunk(2, dim=-1)[0]
    w = _randn(D, seed=D + 1, dtype=torch.bfloat16)
    for t in (k, q):
        assert not t.is_contiguous()
        assert_ulps(hyla_triton.rms_norm_zero_centred(t, w, 1e-6), torch_norm.rms_norm_zero_centred(t, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,R", SIZES)
@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_gated_rms_norm_matches_torch(dtype, D, R, activation):
    seed = D * 10 + R + (activation == "silu")
    x = _randn(R, 1, 2, D, seed=seed, dtype=dtype)
    z = _randn(R, 1, 2, D, seed=seed + 1, scale=2.0, dtype=dtype)
    w = _randn(D, seed=seed + 2)
    assert_ulps(hyla_triton.gated_rms_norm(x, z, w, 1e-5, activation),
                torch_norm.gated_rms_norm(x, z, w, 1e-5, activation))
    assert_ulps(hyla_triton.gated_rms_norm(x, z, None, 1e-5, activation),
                torch_norm.gated_rms_norm(x, z, None, 1e-5, activation))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,R", SIZES)
def test_silu_gated_rms_norm_reads_an_interleaved_gate_in_place(dtype, D, R):
    """GDN: z is cut out of in_proj_qkvz's head-interleaved output ([N, H, K + K + r*V + r*V]),
    a view [N, H, r, V] whose rows are the value heads h * r + i in order."""
    H, r, K = 2, 3, 8
    seed = D + R
    qkvz = _randn(R, H, 2 * K + 2 * r * D, seed=seed, dtype=dtype)
    z = qkvz[..., 2 * K + r * D:].unflatten(-1, (r, D))  # [R, H, r, D] strided
    x = _randn(R, 1, H * r, D, seed=seed + 1, dtype=dtype)
    for w in (_randn(D, seed=seed + 2, dtype=dtype), _randn(D, seed=seed + 3)):  # bf16 and fp32 weights
        ref = torch_norm.silu_gated_rms_norm(x, z.reshape(x.shape), w, 1e-6)
        assert_ulps(hyla_triton.silu_gated_rms_norm(x, z, w, 1e-6), ref)


# r = 160: past the one-load rank (hyla.ops.triton.common.LOWRANK_ONE_LOAD_RANK), two masked steps
@pytest.mark.parametrize("H,D,r,R", [(3, 24, 20, 1), (2, 40, 128, 3), (1, 128, 33, 2), (2, 72, 160, 2)])
@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowrank_gated_rms_norm_matches_the_linear_then_the_norm(H, D, r, R, activation, dtype):
    """KDA's output norm with its gate's up-projection inside the kernel (a decode step), against
    the linear followed by the torch gated norm; g_in a column slice of a wider projection. fp32:
    the gate's r-term sum in another order (a few ulps). bf16: the gate rounded to bf16 as the
    linear's output can land one bf16 ulp apart, and the result is bf16: within 2 ulps."""
    seed = H * D + r + R
    x = _randn(R, 1, H, D, seed=seed, dtype=dtype)
    proj = _randn(R, 1, r + 5, seed=seed + 1, dtype=dtype)
    g_in = proj[..., 2:2 + r]
    w_up = _randn(H * D, r, seed=seed + 2, scale=r ** -0.5, dtype=dtype)
    for w in (_randn(D, seed=seed + 3, dtype=dtype), None):
        y = hyla_triton.lowrank_gated_rms_norm(x, g_in, w_up, w, 1e-6, activation)
        ref = torch_norm.lowrank_gated_rms_norm(x, g_in, w_up, w, 1e-6, activation)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(y.cpu(), ref.cpu(), rtol=1e-5, atol=1e-6)
        else:
            assert float(ulp_diff(y, ref).max()) <= 2


# -- gates ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("H,K,R", [(3, 24, 1), (2, 40, 3), (1, 128, 17), (3, 24, 17)])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_gate_beta_matches_torch(H, K, R, lower_bound, dtype):
    seed = H * K + R
    f = _randn(R, 1, H, K, seed=seed, scale=4.0, dtype=dtype)
    proj = _randn(R, 1, H + 5, seed=seed + 1, scale=3.0, dtype=dtype)
    b = proj[..., 2:2 + H]  # a column slice of a fused projection
    A_log = _randn(1, 1, H, 1, seed=seed + 2)
    dt_bias = _randn(H * K, seed=seed + 3)
    g, beta = hyla_triton.kda_gate_beta(f, b, A_log, dt_bias, lower_bound)
    g_ref, beta_ref = torch_gate.kda_gate_beta(f, b, A_log, dt_bias, lower_bound)
    assert g.shape == g_ref.shape and g.dtype == torch.float32
    torch.testing.assert_close(g.cpu(), g_ref.cpu(), rtol=2e-6, atol=1e-7)
    assert_ulps(beta, beta_ref)
    g2, _ = hyla_triton.kda_gate_beta(f, b, A_log, None, lower_bound)
    torch.testing.assert_close(g2.cpu(), torch_gate.kda_gate(f, A_log, None, lower_bound).cpu(), rtol=2e-6,
                               atol=1e-7)


# K = 40 / 72 / 128: a last row chunk (hyla.ops.triton.gate.LOWRANK_GATE_ROWS) part-filled or full;
# r = 160: past the one-load rank, two masked steps
@pytest.mark.parametrize("H,K,r,R", [(3, 24, 20, 1), (2, 40, 128, 3), (1, 128, 33, 2), (2, 72, 160, 2)])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_lowrank_gate_beta_matches_the_linear_then_the_gate(H, K, r, R, lower_bound, dtype):
    """The decode step's one-launch forget gate (f = fa @ w_up^T per head, then the gate) against
    the up-projection's linear followed by the torch gate. fa is a column slice of a wider
    projection (a row stride of its own). fp32: the GEMV sums r products in another order (a few
    ulps of f). bf16: f is rounded to bf16 as the linear's output, and a sum order that differs in
    the last fp32 bits can round it one bf16 ulp (2^-8 relative) the other way: rtol 1e-2 on g."""
    seed = H * K + r + R
    proj = _randn(R, 1, r + 7, seed=seed, dtype=dtype)
    fa = proj[..., 3:3 + r]
    w_up = _randn(H * K, r, seed=seed + 1, scale=r ** -0.5, dtype=dtype)
    b = _randn(R, 1, H, seed=seed + 2, scale=3.0, dtype=dtype)
    A_log = _randn(1, 1, H, 1, seed=seed + 3)
    dt_bias = _randn(H * K, seed=seed + 4)
    g, beta = hyla_triton.kda_lowrank_gate_beta(fa, w_up, b, A_log, dt_bias, lower_bound)
    g_ref, beta_ref = torch_gate.kda_lowrank_gate_beta(fa, w_up, b, A_log, dt_bias, lower_bound)
    assert g.shape == (R, 1, H, K) and g.dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(g.cpu(), g_ref.cpu(), **tol)
    assert_ulps(beta, beta_ref)


def test_kda_lowrank_gate_beta_dispatch_keeps_prefill_on_the_gemm(monkeypatch):
    """hyla.ops.dispatch: a decode step's rows (<= LOWRANK_GATE_MAX_ROWS) take the one-launch
    kernel, a prefill's rows the up-projection's GEMM and the gate kernel; both the same gate."""
    from hyla.ops import dispatch

    calls = []
    real = hyla_triton.kda_lowrank_gate_beta
    monkeypatch.setattr(hyla_triton, "kda_lowrank_gate_beta", lambda *a: calls.append(a[0].shape[0]) or real(*a),
                        raising=False)
    previous = dispatch.set_backend("triton")
    try:
        for R in (2, dispatch.LOWRANK_GATE_MAX_ROWS + 1):
            fa = _randn(R, 1, 16, seed=R)
            w_up, b = _randn(2 * 24, 16, seed=R + 1), _randn(R, 1, 2, seed=R + 2)
            A_log, dt_bias = _randn(2, seed=R + 3), _randn(48, seed=R + 4)
            g, beta = dispatch.kda_lowrank_gate_beta(fa, w_up, b, A_log, dt_bias, None)
            g_ref, beta_ref = torch_gate.kda_lowrank_gate_beta(fa, w_up, b, A_log, dt_bias, None)
            torch.testing.assert_close(g.cpu(), g_ref.cpu(), rtol=1e-5, atol=1e-6)
    finally:
        dispatch.set_backend(previous)
    assert calls == [2]


def test_lowrank_gates_name_bad_arguments():
    """A low-rank gate's up-projection that does not fit its input or heads is a ValueError naming
    it, through the dispatched op (any backend) and the torch reference alike."""
    from hyla.ops import dispatch

    fa, b = _randn(2, 1, 16, seed=1), _randn(2, 1, 3, seed=2)
    A_log, x = _randn(3, seed=3), _randn(2, 1, 3, 8, seed=4)
    for op in (dispatch.kda_lowrank_gate_beta, torch_gate.kda_lowrank_gate_beta):
        with pytest.raises(ValueError, match="up-projection weight"):
            op(fa, _randn(3 * 8, 15, seed=5), b, A_log)  # r = 15, not 16
        with pytest.raises(ValueError, match=r"\[B, T, r\]"):
            op(fa[0], _randn(3 * 8, 16, seed=5), b, A_log)
    for op in (dispatch.lowrank_gated_rms_norm, torch_norm.lowrank_gated_rms_norm):
        with pytest.raises(ValueError, match="up-projection weight"):
            op(x, fa, _randn(3 * 7, 16, seed=6), None)  # 3 heads x 7, not x 8


@pytest.mark.parametrize("H,r,R", [(1, 1, 1), (3, 2, 3), (4, 3, 17), (1, 1, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_gate_beta_reads_interleaved_ba(H, r, R, dtype):
    """in_proj_ba's output [N, 1, H, 2r]: b then a of each key head's r value heads."""
    seed = H * r + R
    ba = _randn(R, 1, H, 2 * r, seed=seed, scale=4.0, dtype=dtype)
    b, a = ba.split([r, r], dim=-1)
    A_log = _randn(H * r, seed=seed + 1)
    dt_bias = _randn(H * r, seed=seed + 2)
    g, beta = hyla_triton.gdn_gate_beta(a, b, A_log, dt_bias)
    g_ref, beta_ref = torch_gate.gdn_gate_beta(a, b, A_log, dt_bias)
    assert g.shape == g_ref.shape == (R, 1, H * r) and g.dtype == torch.float32
    torch.testing.assert_close(g.cpu(), g_ref.cpu(), rtol=2e-6, atol=1e-7)
    assert_ulps(beta, beta_ref)
    g2, beta2 = hyla_triton.gdn_gate_beta(a.flatten(-2).contiguous(), b.flatten(-2), A_log, None)
    torch.testing.assert_close(g2.cpu(), torch_gate.gdn_gate(a.flatten(-2), A_log, None).cpu(), rtol=2e-6,
                               atol=1e-7)
    assert torch.equal(beta2, beta)


def _gdn_ba_weights(H, r, hidden, seed, dtype, layout):
    """GDN's b and a weights as a layer holds them: "interleaved", the [H, r, hidden] row views of
    Qwen3-Next's in_proj_ba weight [H * 2r, hidden] (b then a of each key head's r value heads);
    "separate", Qwen3.5's in_proj_b / in_proj_a [HV, hidden]. Entries ~N(0, 1.5^2 / hidden), so
    that b and a come out O(1)."""
    w = _randn(2 * H * r, hidden, seed=seed, scale=1.5 * hidden ** -0.5, dtype=dtype)
    if layout == "interleaved":
        return w.unflatten(0, (H, 2 * r)).split(r, dim=1)
    return w[:H * r], w[H * r:]


@pytest.mark.parametrize("H,r,R,hidden", [(3, 1, 1, 200), (1, 3, 3, 72), (3, 2, 16, 200), (2, 3, 1, 2100),
                                          (32, 1, 3, 200), (16, 2, 2, 100)])
@pytest.mark.parametrize("layout", ["interleaved", "separate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_projected_gate_beta_matches_the_linears_then_the_gate(H, r, R, hidden, layout, dtype):
    """A decode step's GDN gate with b = x @ w_b^T and a = x @ w_a^T inside the kernel, against the
    two linears followed by the torch gate; x a column slice of a wider tensor (a row stride of
    its own), hidden not a power of two (2100: more than one chunk of columns). fp32: the sums in
    another order (a few ulps). bf16: b and a are rounded to bf16 as the linear's output, and a
    sum order that differs in the last fp32 bits can round one of them one bf16 ulp the other way:
    rtol 2e-2 on g, 2 ulps on beta."""
    seed = H * r + R + hidden
    x = _randn(R, 1, hidden + 7, seed=seed, dtype=dtype)[..., 3:3 + hidden]
    w_b, w_a = _gdn_ba_weights(H, r, hidden, seed + 1, dtype, layout)
    A_log = _randn(H * r, seed=seed + 2)
    for dt_bias in (_randn(H * r, seed=seed + 3), None):
        g, beta = hyla_triton.gdn_projected_gate_beta(x, w_b, w_a, A_log, dt_bias)
        g_ref, beta_ref = torch_gate.gdn_projected_gate_beta(x, w_b, w_a, A_log, dt_bias)
        assert g.shape == g_ref.shape == (R, 1, H * r) and g.dtype == torch.float32
        assert not torch.isnan(g).any(), "unwritten (NaN) outputs"
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
        torch.testing.assert_close(g.cpu(), g_ref.cpu(), **tol)
        assert_ulps(beta, beta_ref, ulps=2)


def test_gdn_projected_gate_beta_reads_every_row_of_a_batch_of_sequences():
    """x [B, T, hidden] with B > 1 and T > 1: rows b * T + t through one row stride."""
    x = _randn(2, 3, 40, seed=41)
    w_b, w_a = _gdn_ba_weights(2, 2, 40, 42, torch.float32, "interleaved")
    A_log, dt_bias = _randn(4, seed=43), _randn(4, seed=44)
    g, beta = hyla_triton.gdn_projected_gate_beta(x, w_b, w_a, A_log, dt_bias)
    g_ref, beta_ref = torch_gate.gdn_projected_gate_beta(x, w_b, w_a, A_log, dt_bias)
    torch.testing.assert_close(g.cpu(), g_ref.cpu(), rtol=1e-5, atol=1e-6)
    assert_ulps(beta, beta_ref)


def test_gdn_projected_gate_beta_dispatch_keeps_prefill_on_the_gemm(monkeypatch):
    """hyla.ops.dispatch: a decode step's rows (<= LOWRANK_GATE_MAX_ROWS, the rule of KDA's low-rank
    gates) take the one-launch kernel, more rows the reference; gdn_projected_gate_in_kernel says
    which, and the torch backend never takes the kernel."""
    from hyla.ops import dispatch
    from tests.ops.helpers import use_backend

    calls = []
    real = hyla_triton.gdn_projected_gate_beta
    monkeypatch.setattr(hyla_triton, "gdn_projected_gate_beta", lambda *a: calls.append(a[0].shape[0]) or real(*a),
                        raising=False)
    w_b, w_a = _gdn_ba_weights(2, 3, 48, 51, torch.float32, "interleaved")
    A_log, dt_bias = _randn(6, seed=52), _randn(6, seed=53)
    for backend in ("triton", "torch"):
        use_backend(monkeypatch, backend)
        for R in (2, dispatch.LOWRANK_GATE_MAX_ROWS, dispatch.LOWRANK_GATE_MAX_ROWS + 1):
            x = _randn(R, 1, 48, seed=R)
            assert dispatch.gdn_projected_gate_in_kernel(x, w_b, w_a, A_log, dt_bias) == (
                backend == "triton" and R <= dispatch.LOWRANK_GATE_MAX_ROWS)
            g, beta = dispatch.gdn_projected_gate_beta(x, w_b, w_a, A_log, dt_bias)
            g_ref, beta_ref = torch_gate.gdn_projected_gate_beta(x, w_b, w_a, A_log, dt_bias)
            torch.testing.assert_close(g.cpu(), g_ref.cpu(), rtol=1e-5, atol=1e-6)
    assert calls == [2, dispatch.LOWRANK_GATE_MAX_ROWS]
    assert not dispatch.gdn_projected_gate_in_kernel(x[:2], w_b.bfloat16(), w_a.bfloat16(), A_log, dt_bias)


def test_gdn_projected_gate_beta_names_bad_arguments():
    """Weights that do not fit x or each other are a ValueError naming them, through the dispatched
    op (any backend) and the torch reference alike."""
    from hyla.ops import dispatch

    x, A_log = _randn(2, 1, 16, seed=1), _randn(4, seed=2)
    w = _randn(4, 16, seed=3)
    for op in (dispatch.gdn_projected_gate_beta, torch_gate.gdn_projected_gate_beta):
        with pytest.raises(ValueError, match="w_a must be"):
            op(x, w, _randn(4, 15, seed=4), A_log)
        with pytest.raises(ValueError, match="one row per value head"):
            op(x, w, _randn(2, 16, seed=4), A_log)
        with pytest.raises(ValueError, match=r"\[B, T, hidden\]"):
            op(x[0], w, w, A_log)


@pytest.mark.parametrize("B,T", [(2, 3), (3, 1), (1, 4)])
def test_gates_read_every_row_of_a_batch_of_sequences(B, T):
    """[B, T, ...] inputs with B > 1 and T > 1 (a full-sequence forward of several prompts): row
    b * T + t is at b * stride(0) + t * stride(1), one stride per row only because
    stride(0) == T * stride(1); a wrong choice reads other sequences' rows."""
    H, K, r = 2, 24, 2
    f = _randn(B, T, H, K, seed=31, scale=4.0)
    proj = _randn(B, T, H + 3, seed=32, scale=3.0)
    b = proj[..., 1:1 + H]  # strided columns of a fused projection
    A_log, dt_bias = _randn(1, 1, H, 1, seed=33), _randn(H * K, seed=34)
    g, beta = hyla_triton.kda_gate_beta(f, b, A_log, dt_bias, -5.0)
    g_ref, beta_ref = torch_gate.kda_gate_beta(f, b, A_log, dt_bias, -5.0)
    torch.testing.assert_close(g.cpu(), g_ref.cpu(), rtol=2e-6, atol=1e-7)
    assert_ulps(beta, beta_ref)
    ba = _randn(B, T, H, 2 * r, seed=35, scale=4.0)
    bb, a = ba.split([r, r], dim=-1)
    A2, dt2 = _randn(H * r, seed=36), _randn(H * r, seed=37)
    g, beta = hyla_triton.gdn_gate_beta(a, bb, A2, dt2)
    g_ref, beta_ref = torch_gate.gdn_gate_beta(a, bb, A2, dt2)
    torch.testing.assert_close(g.cpu(), g_ref.cpu(), rtol=2e-6, atol=1e-7)
    assert_ulps(beta, beta_ref)


# -- packed short convs --------------------------------------------------------------------------

def _pools(sizes, slots, W, seed, dtype):
    return [_randn(slots, sum(p), W - 1, seed=seed + i, dtype=dtype) for i, p in enumerate(sizes)]


@pytest.mark.parametrize("layout", ["kda", "gdn"])
@pytest.mark.parametrize("D,N", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_conv_update_matches_per_conv(layout, D, N, dtype):
    """KDA: three convs over adjacent column blocks of one projection output; GDN: one conv cut
    into q / k / v parts, its channels gathered from head-interleaved columns. Padding rows (-1)
    give zeros and leave the pools alone."""
    from hyla.ops import conv as torch_conv
    W, slots, seed = 4, N + 3, D + N
    if layout == "kda":
        sizes = [[D], [D], [D]]
        x = _randn(N, 1, 3 * D + 11, seed=seed, scale=2.0, dtype=dtype)  # wider rows: in-place strided read
        channels = None
    else:
        sizes = [[D, D, 2 * D]]
        x = _randn(N, 1, 4 * D + 7, seed=seed, scale=2.0, dtype=dtype)
        channels = torch.randperm(4 * D + 7, generator=_gen(seed))[:4 * D].to(DEV)  # int64, as GDN keeps them
        if dtype == torch.bfloat16:
            channels = channels.to(torch.int32)  # the kernel takes either width
    weights = [_randn(sum(p), 1, W, seed=seed + 10 + i) for i, p in enumerate(sizes)]
    pools = _pools(sizes, slots, W, seed + 20, dtype)
    idx = torch.randperm(slots, generator=_gen(seed + 1))[:N].to(DEV)
    if N > 1:
        idx[1] = -1  # a padding row
    ref_pools = [p.clone() for p in pools]
    ys = hyla_triton.causal_conv1d_update_packed(x, pools, weights, sizes, "silu", idx, channels)
    refs = torch_conv.causal_conv1d_update_packed(x, ref_pools, weights, sizes, "silu", idx, channels)
    assert len(ys) == len(refs) == sum(len(p) for p in sizes)
    for y, r in zip(ys, refs):
        assert y.is_contiguous() and y.shape == r.shape
        live = idx >= 0
        assert torch.equal(y[~live].cpu(), torch.zeros_like(y[~live]).cpu())
        assert_ulps(y[live], r[live])
    for p, r in zip(pools, ref_pools):
        assert torch.equal(p.cpu(), r.cpu())  # the windows are copies of inputs: exact


def test_packed_conv_two_dim_input_and_no_activation():
    from hyla.ops import conv as torch_conv
    x = _randn(3, 50, seed=5)
    sizes = [[24], [24]]
    weights = [_randn(24, 4, seed=6), _randn(24, 4, seed=7)]
    pools = _pools(sizes, 5, 4, 8, torch.float32)
    ref_pools = [p.clone() for p in pools]
    idx = torch.tensor([4, 0, 2], device=DEV)
    ys = hyla_triton.causal_conv1d_update_packed(x, pools, weights, sizes, None, idx)
    refs = torch_conv.causal_conv1d_update_packed(x, ref_pools, weights, sizes, None, idx)
    for y, r in zip(ys, refs):
        assert y.shape == (3, 24)
        assert_ulps(y, r)
    for p, r in zip(pools, ref_pools):
        assert torch.equal(p, r)


def test_packed_conv_launches_the_segments_of_one_dtype_together(monkeypatch):
    """A launch picks each program's pool and weight pointers, so it takes up to three segments
    whose pools share a dtype and whose weights share a dtype (decided from the arguments, never
    from a failed launch); a segment of another dtype gets a launch of its own. Each conv's output
    and pool equal the same conv packed alone."""
    from hyla.ops.triton import conv as triton_conv
    real = triton_conv._launch_packed
    calls = []

    def counted(x3, cols, y, idx, group, *rest):
        calls.append([s[0].dtype for s in group])
        return real(x3, cols, y, idx, group, *rest)

    monkeypatch.setattr(triton_conv, "_launch_packed", counted)
    f32, bf16 = torch.float32, torch.bfloat16
    sizes = [[24], [24], [24]]
    x = _randn(3, 1, 72, seed=11)
    weights = [_randn(24, 1, 4, seed=12 + i) for i in range(3)]
    idx = torch.tensor([2, 0, 3], device=DEV)
    pools = _pools(sizes, 4, 4, 15, f32)
    triton_conv.causal_conv1d_update_packed(x, pools, weights, sizes, "silu", idx)
    assert calls == [[f32] * 3]
    del calls[:]
    pools[1] = pools[1].to(bf16)
    alone = [p.clone() for p in pools]
    ys = triton_conv.causal_conv1d_update_packed(x, pools, weights, sizes, "silu", idx)
    assert calls == [[f32, f32], [bf16]]
    for i in range(3):
        want = triton_conv.causal_conv1d_update_packed(x[..., 24 * i:24 * (i + 1)], [alone[i]], [weights[i]],
                                                       [sizes[i]], "silu", idx)[0]
        assert torch.equal(ys[i], want) and torch.equal(pools[i], alone[i])
