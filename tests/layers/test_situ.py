"""SiTU (Kimi K3's activation) and the latent MoE's routed SiTU experts against loops."""

import torch

from hyla.layers.situ import situ_moe_experts, situ_mul

torch.set_num_threads(1)


def test_situ_formula_and_bounds():
    g = torch.linspace(-200, 200, 401, dtype=torch.float64)
    u = torch.linspace(-300, 300, 401, dtype=torch.float64)
    y = situ_mul(g, u, 4.0, 25.0)
    assert torch.allclose(y, 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25), atol=0, rtol=1e-15)
    assert y.abs().max() <= 4 * 25  # both factors are bounded
    assert torch.equal(situ_mul(g, u, 4.0, None), 4 * torch.tanh(g / 4) * torch.sigmoid(g) * u)
    bf = situ_mul(g.bfloat16(), u.bfloat16(), 4.0, 25.0)
    assert bf.dtype == torch.bfloat16


def test_routed_experts_equal_a_loop():
    gen = torch.Generator().manual_seed(0)
    M, H, I, E, k = 7, 12, 10, 5, 2
    x = torch.randn(M, H, generator=gen, dtype=torch.float64)
    w13 = torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64)
    w2 = torch.randn(E, H, I, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)])
    weights = torch.rand(M, k, generator=gen, dtype=torch.float64)
    got = situ_moe_experts(x, w13, w2, weights, ids, 4.0, 25.0)
    want = torch.zeros_like(x)
    for m in range(M):
        for j in range(k):
            e = int(ids[m, j])
            gu = w13[e] @ x[m]
            want[m] += weights[m, j] * (w2[e] @ situ_mul(gu[:I], gu[I:], 4.0, 25.0))
    assert (got - want).abs().max() <= 1e-12
