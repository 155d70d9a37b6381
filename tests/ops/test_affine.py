import pytest
import torch
import torch.nn.functional as F

from hyla.ops.affine import apply, compose, identity, prefix_scan, segment_affine

K, V, H = 24, 40, 3


def _loop(k, v, g, beta, S, gate):
    """Token loop of the recurrence. k: [B, T, H, K]; v: [B, T, HV, V]; S: [B, HV, K, V]."""
    HV = v.shape[2]
    k = k.repeat_interleave(HV // k.shape[2], dim=2)
    for t in range(k.shape[1]):
        if gate == "kda":
            S = S * g[:, t].exp()[..., None]
        elif gate == "gdn":
            S = S * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + beta[:, t, :, None, None] * kt[..., None] * (v[:, t] - pred)[..., None, :]
    return S


def _inputs(B, T, HV, gate, dtype=torch.float64, g_scale=1.0):
    k = F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=dtype)
    g = {
        "kda": -torch.rand(B, T, HV, K, dtype=dtype) * g_scale,
        "gdn": -torch.rand(B, T, HV, dtype=dtype) * g_scale,
        "none": None,
    }[gate]
    return k, v, g, beta


@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("gate", ["kda", "gdn", "none"])
def test_segment_affine_equals_token_loop(T, gate):
    B = 2
    k, v, g, beta = _inputs(B, T, H, gate)
    S0 = torch.randn(B, H, K, V, dtype=torch.float64)
    M, St = segment_affine(k, v, g, beta, gate=gate)
    assert M.shape == (B, H, K, K) and St.shape == (B, H, K, V) and M.dtype == torch.float64
    ref = _loop(k, v, g, beta, S0, gate)
    torch.testing.assert_close(apply((M, St), S0), ref, rtol=0, atol=1e-10)
    # The summary pieces on their own: S~ is the response to S0 = 0, M to S0 = I with v = 0.
    torch.testing.assert_close(St, _loop(k, v, g, beta, torch.zeros_like(S0), gate), rtol=0, atol=1e-10)
    eye = torch.eye(K, dtype=torch.float64).expand(B, H, K, K)
    torch.testing.assert_close(M, _loop(k, torch.zeros(B, T, H, K, dtype=torch.float64), g, beta, eye, gate),
                               rtol=0, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 128])
def test_chunk_size_does_not_change_the_map(chunk_size):
    k, v, g, beta = _inputs(1, 65, H, "kda")
    M, St = segment_affine(k, v, g, beta, chunk_size=chunk_size)
    M_ref, St_ref = segment_affine(k, v, g, beta, chunk_size=64)
    torch.testing.assert_close(M, M_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(St, St_ref, rtol=0, atol=1e-10)


def test_grouped_value_heads_and_l2norm_in_kernel():
    B, T, HV = 2, 37, 2 * H
    k, v, g, beta = _inputs(B, T, HV, "kda")
    k_raw = torch.randn(B, T, H, K, dtype=torch.float64) * 3
    k_n = k_raw / torch.sqrt((k_raw * k_raw).sum(-1, keepdim=True) + 1e-6)
    S0 = torch.randn(B, HV, K, V, dtype=torch.float64)
    M, St = segment_affine(k_raw, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert M.shape == (B, HV, K, K)
    torch.testing.assert_close(apply((M, St), S0), _loop(k_n, v, g, beta, S0, "kda"), rtol=0, atol=1e-10)


def test_empty_segment_is_identity():
    k, v, g, beta = _inputs(2, 0, H, "gdn")
    M, St = segment_affine(k, v, g, beta, gate="gdn")
    I, Z = identity(2, H, K, V, dtype=torch.float64)
    assert torch.equal(M, I) and torch.equal(St, Z)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_prefix_scan_equals_sequential(gate):
    B, cuts = 2, [0, 1, 50, 64, 129, 300]
    k, v, g, beta = _inputs(B, cuts[-1], H, gate)
    S0 = torch.randn(B, H, K, V, dtype=torch.float64)
    segs = [
        segment_affine(k[:, a:b], v[:, a:b], None if g is None else g[:, a:b], beta[:, a:b], gate=gate)
        for a, b in zip(cuts[:-1], cuts[1:])
    ]
    incoming, final = prefix_scan(segs, initial_state=S0)
    assert len(incoming) == len(segs)
    for (a, _), s_in in zip(zip(cuts[:-1], cuts[1:]), incoming):
        ref = _loop(k[:, :a], v[:, :a], g[:, :a], beta[:, :a], S0, gate)
        torch.testing.assert_close(s_in, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(final, _loop(k, v, g, beta, S0, gate), rtol=0, atol=1e-10)
    # Without an initial state the scan starts from zeros.
    inc0, fin0 = prefix_scan(segs)
    assert torch.equal(inc0[0], torch.zeros_like(S0))
    torch.testing.assert_close(fin0, _loop(k, v, g, beta, torch.zeros_like(S0), gate), rtol=0, atol=1e-10)


def test_compose_is_associative_and_matches_concatenation():
    k, v, g, beta = _inputs(1, 90, H, "kda")
    a, b, c = (segment_affine(k[:, s], v[:, s], g[:, s], beta[:, s])
               for s in (slice(0, 20), slice(20, 61), slice(61, 90)))
    left = compose(compose(a, b), c)
    right = compose(a, compose(b, c))
    whole = segment_affine(k, v, g, beta)
    for x, y in [(left, right), (left, whole)]:
        torch.testing.assert_close(x[0], y[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(x[1], y[1], rtol=0, atol=1e-10)
    # Order matters: swapping the segments gives a different map.
    assert (compose(b, a)[1] - compose(a, b)[1]).abs().max() > 1e-3


def test_fp32_stays_finite_with_very_strong_decay():
    # Cumulative log-decay reaches about -64 * 60 within one chunk: a K / Gamma form would
    # compute exp(3840) = inf; the masked pairwise form must stay finite and accurate.
    B, T = 1, 130
    k, v, g, beta = _inputs(B, T, H, "kda", g_scale=60.0)
    g[:, ::7] = -1e-3  # mix near-1 and near-0 decays
    S0 = torch.randn(B, H, K, V, dtype=torch.float64)
    M, St = segment_affine(k.float(), v.float(), g.float(), beta.float())
    assert M.dtype == torch.float32 and torch.isfinite(M).all() and torch.isfinite(St).all()
    ref = _loop(k, v, g, beta, S0, "kda")
    torch.testing.assert_close(apply((M, St), S0.float()).double(), ref, rtol=0, atol=1e-4)


def test_bad_inputs():
    k, v, g, beta = _inputs(1, 5, H, "kda")
    with pytest.raises(ValueError, match="gate"):
        segment_affine(k, v, g, beta, gate="mamba")
    with pytest.raises(ValueError, match="k must be"):
        segment_affine(k[0], v, g, beta)
    with pytest.raises(ValueError, match="v must be"):
        segment_affine(k, v[:, :4], g, beta)
    with pytest.raises(ValueError, match="v must be"):
        segment_affine(k, torch.randn(1, 5, H + 1, V, dtype=torch.float64), g, beta)
    with pytest.raises(ValueError, match="beta"):
        segment_affine(k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="g must be"):
        segment_affine(k, v, g[..., 0], beta, gate="kda")
    with pytest.raises(ValueError, match="g must be"):
        segment_affine(k, v, g, beta, gate="gdn")
    with pytest.raises(ValueError, match="g must be None"):
        segment_affine(k, v, g, beta, gate="none")
    with pytest.raises(ValueError, match="chunk_size"):
        segment_affine(k, v, g, beta, chunk_size=0)
    a = segment_affine(k, v, g, beta)
    with pytest.raises(ValueError, match="second"):
        compose(a, (a[0][..., :3, :3], a[1]))
    with pytest.raises(ValueError, match="first"):
        compose(a[0], a)
    with pytest.raises(ValueError, match="S must"):
        apply(a, torch.randn(1, H, K, V + 1))
    with pytest.raises(ValueError, match="initial_state"):
        prefix_scan([a], initial_state=torch.randn(1, H, K, 3))
    with pytest.raises(ValueError, match="segments"):
        prefix_scan([])
    with pytest.raises(ValueError, match="segments"):
        prefix_scan(a[0])
