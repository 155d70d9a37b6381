import pytest
import torch

from hyla.ops.gate import gdn_gate, kda_gate


def _softplus(x):
    # Independent of F.softplus's threshold shortcut: log(1 + e^x) = max(x, 0) + log1p(e^-|x|).
    return x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))


def _inputs(B=2, T=7, H=3, K=5, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f = torch.randn(B, T, H, K, dtype=dtype, generator=gen) * 3
    A_log = torch.randn(H, dtype=torch.float32, generator=gen)
    dt_bias = torch.randn(H * K, dtype=torch.float32, generator=gen)
    return f, A_log, dt_bias


def test_kda_gate_v1_matches_formula():
    f, A_log, dt_bias = _inputs()
    H, K = f.shape[2:]
    g = kda_gate(f, A_log, dt_bias)
    ref = -A_log.double().exp()[:, None] * _softplus(f + dt_bias.double().view(H, K))
    assert g.dtype == torch.float64 and g.shape == f.shape
    torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12)
    assert (g <= 0).all()


def test_kda_gate_v2_matches_formula_and_is_bounded():
    f, A_log, dt_bias = _inputs()
    H, K = f.shape[2:]
    g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    ref = -5.0 * torch.sigmoid(A_log.double().exp()[:, None] * (f + dt_bias.double().view(H, K)))
    torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)
    # Open interval in exact arithmetic; fp64 saturates to the bound only past |x| ~ 37.
    assert ((g >= -5) & (g < 0)).all() and (g > -5).float().mean() > 0.9


def test_kda_gate_checkpoint_shapes_and_no_bias():
    f, A_log, dt_bias = _inputs(B=1, T=4, H=2, K=3)
    a = kda_gate(f, A_log.view(1, 1, 2, 1), dt_bias.view(2, 3))
    b = kda_gate(f, A_log, dt_bias)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    c = kda_gate(f, A_log)
    ref = -A_log.double().exp()[:, None] * _softplus(f)
    torch.testing.assert_close(c, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gates_return_fp32_for_low_precision(dtype):
    f, A_log, dt_bias = _inputs(dtype=dtype)
    g = kda_gate(f, A_log, dt_bias, lower_bound=-5)
    assert g.dtype == torch.float32
    ref = kda_gate(f.double(), A_log, dt_bias, lower_bound=-5)
    torch.testing.assert_close(g.double(), ref, rtol=1e-5, atol=1e-5)
    a = torch.randn(2, 5, 4).to(dtype)
    assert gdn_gate(a, torch.randn(4), torch.randn(4)).dtype == torch.float32


def test_gdn_gate_matches_formula():
    a = torch.randn(3, 9, 6, dtype=torch.float64) * 4
    A_log, dt_bias = torch.randn(6), torch.randn(6)
    g = gdn_gate(a, A_log, dt_bias)
    ref = -A_log.double().exp() * _softplus(a + dt_bias.double())
    assert g.shape == a.shape
    torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gdn_gate(a, A_log.view(1, 1, 6, 1), None),
                               -A_log.double().exp() * _softplus(a), rtol=1e-10, atol=1e-12)


def test_kda_gate_bad_inputs():
    f, A_log, dt_bias = _inputs(H=3, K=5)
    with pytest.raises(ValueError, match="f must be"):
        kda_gate(f[0], A_log, dt_bias)
    with pytest.raises(ValueError, match="f must be"):
        kda_gate(f.long(), A_log, dt_bias)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f, torch.randn(4), dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(f, A_log, torch.randn(3, 4))
    for lb in (0.0, 2.0, float("nan"), "x"):
        with pytest.raises(ValueError, match="lower_bound"):
            kda_gate(f, A_log, dt_bias, lower_bound=lb)


def test_gdn_gate_bad_inputs():
    a = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="a must be"):
        gdn_gate(a[..., None], torch.randn(4), torch.randn(4))
    with pytest.raises(ValueError, match="A_log"):
        gdn_gate(a, torch.randn(5), torch.randn(4))
    with pytest.raises(ValueError, match="dt_bias"):
        gdn_gate(a, torch.randn(4), torch.randn(8))
