"""hyla.ops.router: the three-term bf16 split is the fp32 weight, the router op's fp32 path, and the
decode steps' one-launch GEMV."""

import pytest
import torch

from hyla.ops.router import router_logits, split_bf16
from tests.ops.triton_env import triton_module


def test_three_bf16_terms_sum_to_the_fp32_weight():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 96)  # a spread of magnitudes
    hi, mid, lo = split_bf16(w)
    assert hi.dtype == mid.dtype == lo.dtype == torch.bfloat16
    total = hi.double() + mid.double() + lo.double()
    assert torch.equal(total.float(), w)  # the whole fp32 significand is kept
    # and no shorter split would do: two terms leave an error (what `lo` holds)
    assert not torch.equal((hi.double() + mid.double()).float(), w)


def test_cpu_logits_are_the_fp32_and_fp64_products():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(700, 32, generator=g).to(torch.bfloat16)
    w = torch.randn(8, 32, generator=g)
    assert torch.equal(router_logits(x, w), torch.nn.functional.linear(x.float(), w))
    assert router_logits(x.double(), w).dtype == torch.float64


@pytest.mark.parametrize("M, E, H", [(1, 256, 200), (3, 40, 72), (4, 7, 513)])
def test_decode_router_gemv_is_the_fp32_product(M, E, H):
    """hyla.ops.triton.router_gemv (Triton's interpreter here, CUDA in tests/gpu): x widened to
    fp32 in the kernel, fp32 products and sums, within fp32 rounding of the fp64 product (a sum of
    H terms in another order: ~sqrt(H) 2^-24 relative); E and H off the block sizes."""
    mod, dev = triton_module("router_gemv")
    g = torch.Generator().manual_seed(M + E)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    w = torch.randn(E, H, generator=g) * 0.05
    got = mod.router_gemv(x.to(dev), w.to(dev)).cpu()
    ref = torch.nn.functional.linear(x.double(), w.double())
    assert got.dtype == torch.float32 and got.shape == (M, E)
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-6


def test_decode_router_gemv_checks_its_arguments():
    mod, dev = triton_module("router_gemv")
    x = torch.randn(mod.MAX_TOKENS + 1, 8, device=dev)
    with pytest.raises(ValueError, match="router_gemv"):
        mod.router_gemv(x, torch.randn(4, 8, device=dev))
    with pytest.raises(ValueError, match="fp32 weight"):
        mod.router_gemv(x[:1], torch.randn(4, 8, device=dev, dtype=torch.float64))


def test_router_logits_takes_the_gemv_for_decode_tokens_only(monkeypatch):
    """Under the Triton backend a step of <= MAX_TOKENS rows goes to the kernel, more rows and fp64
    stay on torch's GEMM."""
    mod, dev = triton_module("router_gemv")
    from hyla.ops import dispatch

    calls = []
    monkeypatch.setattr(mod, "router_gemv", lambda x, w: calls.append(x.shape[0]) or torch.zeros(x.shape[0], w.shape[0]))
    previous = dispatch.set_backend("triton")
    try:
        w = torch.randn(6, 16, device=dev)
        router_logits(torch.randn(2, 16, device=dev), w)
        router_logits(torch.randn(mod.MAX_TOKENS + 1, 16, device=dev), w)
        router_logits(torch.randn(2, 16, device=dev, dtype=torch.float64), w)
    finally:
        dispatch.set_backend(previous)
    assert calls == [2]
