"""hyla.ops.router: the three-term bf16 split is the fp32 weight, and the router op's fp32 path."""

import torch

from hyla.ops.router import router_logits, split_bf16


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
