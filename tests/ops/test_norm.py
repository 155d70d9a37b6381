import pytest
import torch

from hyla.ops.norm import gated_rms_norm, l2norm, rms_norm


def test_l2norm_fp64_formula():
    x = torch.randn(3, 5, 2, 24, dtype=torch.float64) * 2
    y = l2norm(x)
    ref = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-14)
    # eps keeps a zero row finite (and zero), as fla's l2norm does.
    assert torch.equal(l2norm(torch.zeros(2, 7, dtype=torch.float64)), torch.zeros(2, 7, dtype=torch.float64))
    torch.testing.assert_close(l2norm(x, eps=0.5), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 0.5))


def test_rms_norm_fp64_formula():
    x = torch.randn(4, 3, 40, dtype=torch.float64) + 0.3
    w = torch.randn(40, dtype=torch.float64)
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm(x, w), ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(rms_norm(x, None, eps=1e-3),
                               x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-3), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("activation", ["sigmoid", "silu", "swish"])
def test_gated_rms_norm_fp64_formula(activation):
    x = torch.randn(2, 5, 3, 24, dtype=torch.float64)
    z = torch.randn(2, 5, 3, 24, dtype=torch.float64) * 2
    w = torch.rand(24, dtype=torch.float64) + 0.5
    act = torch.sigmoid(z) if activation == "sigmoid" else z * torch.sigmoid(z)
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w * act
    torch.testing.assert_close(gated_rms_norm(x, z, w, activation=activation), ref, rtol=1e-12, atol=1e-14)


def test_gated_default_is_sigmoid():
    x, z, w = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64), torch.randn(8)
    torch.testing.assert_close(gated_rms_norm(x, z, w), gated_rms_norm(x, z, w, activation="sigmoid"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_computes_in_fp32_and_keeps_dtype(dtype):
    x = (torch.randn(6, 64) * 30).to(dtype)  # large values: a bf16 sum of squares would be coarse
    z = torch.randn(6, 64).to(dtype)
    w = torch.randn(64)
    xd, zd = x.double(), z.double()
    for got, ref in [
        (l2norm(x), l2norm(xd)),
        (rms_norm(x, w), rms_norm(xd, w.double())),
        (gated_rms_norm(x, z, w, activation="silu"), gated_rms_norm(xd, zd, w.double(), activation="silu")),
    ]:
        assert got.dtype == dtype
        # One rounding to the output dtype: the error is within one ulp-ish of the exact value.
        torch.testing.assert_close(got.double(), ref.to(dtype).double(), rtol=2 ** -7, atol=1e-3)


def test_bad_inputs():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="x must be"):
        l2norm(x.long())
    with pytest.raises(ValueError, match="eps"):
        l2norm(x, eps=-1.0)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(7))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(1, 8))
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, torch.randn(3, 7), torch.randn(8))
    with pytest.raises(ValueError, match="activation"):
        gated_rms_norm(x, torch.randn(3, 8), torch.randn(8), activation="relu")
