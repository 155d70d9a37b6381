"""hyla.ops.dispatch.silu_mul (the dense SwiGLU activation, hyla.ops.triton.gated_act on CUDA) vs
torch's `F.silu(gate) * up`, on awkward sizes (I = 1, 7, 640, 1000; rows 1, 3, 17), gate and up
the column views of one packed [T, 2I] tensor (as PackedLinears returns them), the kernel's output
pre-filled with NaN (an element it fails to write fails the test).

Tolerances: fp32 within 1e-6 (rtol and atol): the kernel computes g / (1 + exp(-g)) * u, torch's
formula, but its exp is not torch's and may differ in the last fp32 bit. bf16 / fp16: the kernel
rounds where torch rounds (the silu to the input dtype, then the product), so it is bit-equal to
torch wherever both compute the same fp32 silu; an exp one fp32 ulp apart can move the silu
across a bf16 rounding boundary, and then the result by one ulp of its dtype. So: at most one
ulp everywhere, and bit-equal for all but a tiny fraction (< 0.5%) of the elements. On the torch
path (CPU without HYLA_BACKEND=triton, fp64, grad) silu_mul is exactly `F.silu(gate) * up`, and
the MLP module's output is bit-equal to the unfused formula.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.ops.helpers import use_backend
from tests.ops.test_fused_decode import fill_empties_with_nan, ulp_diff
from tests.ops.triton_env import triton_module

SIZES = [(1, 1), (7, 3), (640, 17), (1000, 3), (7, 17), (1000, 1)]  # (I, rows): every I and row count


def _packed(T, I, dtype, device, seed, lead=()):
    """gate, up: the two column halves of one random [*lead, T, 2I] tensor (row stride 2I)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, T, 2 * I, generator=g) * 3.0).to(dtype).to(device)
    return x[..., :I], x[..., I:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("I,T", SIZES)
def test_kernel_matches_torch(monkeypatch, dtype, I, T):
    mod, dev = triton_module("gated_act")
    gate, up = _packed(T, I, dtype, dev, seed=I * 100 + T)
    assert T == 1 or gate.stride() == (2 * I, 1)
    expected = F.silu(gate) * up
    fill_empties_with_nan(monkeypatch)
    out = mod.silu_mul(gate, up)
    assert out.dtype == dtype and out.shape == (T, I) and out.is_contiguous()
    assert not torch.isnan(out).any(), "unwritten (NaN) outputs"
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        return
    ulps = ulp_diff(out, expected)
    assert ulps.max() <= 1, f"max {ulps.max():.3g} ulp"
    assert (ulps > 0).double().mean() < 5e-3, f"{int((ulps > 0).sum())} of {ulps.numel()} not bit-equal"


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy exp
def test_kernel_extreme_inputs():
    """Large |g| (exp(-g) overflowing to inf: silu -> -0), zeros, and 3-d leading dims."""
    mod, dev = triton_module("gated_act")
    vals = torch.tensor([-1e4, -100.0, -88.0, -20.0, -1.0, -0.0, 0.0, 1e-30, 1.0, 20.0, 88.0, 100.0, 1e4])
    I = vals.numel()
    x = torch.empty(2, 3, 2 * I).copy_(torch.cat([vals, vals.flip(0)]))
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype).to(dev)
        gate, up = xd[..., :I], xd[..., I:]
        expected = F.silu(gate) * up
        out = mod.silu_mul(gate, up)
        assert out.shape == gate.shape
        assert torch.equal(out.isinf(), expected.isinf()) and torch.equal(out == 0, expected == 0)
        if dtype == torch.float32:
            # On a GPU tl.exp is ex2.approx of g * log2(e): rounding that product costs up to
            # |g| * log2(e) * 2^-24 relative in exp(-g), 7.6e-6 at |g| = 88 (torch's expf is exact
            # to an ulp); near |g| ~ 1 it is the 1e-6 of the test above.
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=0.0)
        else:  # rounded to bf16: at most one ulp apart
            assert ulp_diff(out, expected).max() <= 1


def test_dispatch_routes_to_the_kernel(monkeypatch):
    """HYLA_BACKEND=triton (the interpreter on CPU): dispatch.silu_mul is the kernel; a fp64 or
    unit-stride-less call, and a call needing a gradient, stays on torch's formula."""
    mod, dev = triton_module("gated_act")
    from hyla.ops import dispatch

    use_backend(monkeypatch, "triton")
    calls = []
    kernel = mod.silu_mul

    def counted(g, u, fp8_output=False):
        calls.append(g.shape)
        return kernel(g, u, fp8_output)

    monkeypatch.setattr(mod, "silu_mul", counted)
    gate, up = _packed(3, 40, torch.bfloat16, dev, seed=1)
    torch.testing.assert_close(dispatch.silu_mul(gate, up), F.silu(gate) * up, rtol=0.0, atol=0.0)
    assert calls == [(3, 40)]
    g64, u64 = _packed(3, 40, torch.float64, dev, seed=2)
    assert torch.equal(dispatch.silu_mul(g64, u64), F.silu(g64) * u64)
    gt, ut = gate.t(), up.t()  # column stride 2I: torch
    assert torch.equal(dispatch.silu_mul(gt, ut), F.silu(gt) * ut)
    gg = gate.float().requires_grad_()
    y = dispatch.silu_mul(gg, up.float())
    assert y.requires_grad
    assert calls == [(3, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_mlp_output_unchanged_on_cpu(dtype):
    """The MLP module on the CPU (the torch path): bit-equal to down(silu(gate(x)) * up(x)), packed
    (one GEMM, column views) or not, with and without grad."""
    from hyla.layers.mlp import MLP

    torch.manual_seed(0)
    mlp = MLP(24, 40).to(dtype)
    x = torch.randn(2, 5, 24).to(dtype)
    with torch.no_grad():
        ref = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        assert torch.equal(mlp(x), ref)
        mlp.prepare_for_inference()
        gate, up = mlp.gate_up(x)
        assert gate.stride(-2) == 80  # column views of the packed [.., 2I] output
        packed_ref = mlp.down_proj(F.silu(gate) * up)
        assert torch.equal(mlp(x), packed_ref)
    y = mlp(x)
    assert y.requires_grad
    y.float().sum().backward()
    assert mlp.gate_proj.weight.grad is not None
