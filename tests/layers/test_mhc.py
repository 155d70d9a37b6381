"""mHC hyper-connections: the Sinkhorn combination is doubly stochastic, and one pre / post
round equals a per-token loop written from the formulas."""

import math

import torch

from hyla.layers.mhc import HyperConnection, expand_streams, hc_head


def test_sinkhorn_is_doubly_stochastic():
    hc = HyperConnection(4, sinkhorn_iters=30, eps=1e-9, norm_eps=1e-5)
    comb = hc.sinkhorn(torch.rand(5, 4, 4, dtype=torch.float64) + 0.1)
    assert torch.allclose(comb.sum(-1), torch.ones(5, 4, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(5, 4, dtype=torch.float64), atol=1e-8)


def test_pre_post_match_a_token_loop():
    m, hid = 3, 8
    gen = torch.Generator().manual_seed(0)
    hc = HyperConnection(m, sinkhorn_iters=4, eps=1e-6, norm_eps=1e-5)
    fn = torch.randn((2 + m) * m, m * hid, generator=gen, dtype=torch.float64) * 0.3
    base = torch.randn((2 + m) * m, generator=gen, dtype=torch.float64)
    scale = torch.rand(3, generator=gen, dtype=torch.float64) + 0.5
    h = torch.randn(2, 5, m, hid, generator=gen, dtype=torch.float64)
    y = torch.randn(2, 5, hid, generator=gen, dtype=torch.float64)
    post, comb, x = hc.pre(h, fn, base, scale)
    out = hc.post(y, post, comb, h)
    for b in range(2):
        for t in range(5):
            flat = h[b, t].flatten()
            z = fn @ (flat / math.sqrt(float(flat.square().mean()) + 1e-5))
            pre = torch.sigmoid(z[:m] * scale[0] + base[:m]) + 1e-6
            pst = 2 * torch.sigmoid(z[m:2 * m] * scale[1] + base[m:2 * m])
            c = torch.softmax((z[2 * m:] * scale[2] + base[2 * m:]).view(m, m), -1) + 1e-6
            c = c / (c.sum(0) + 1e-6)
            for _ in range(3):
                c = c / (c.sum(1, keepdim=True) + 1e-6)
                c = c / (c.sum(0) + 1e-6)
            assert torch.allclose(x[b, t], sum(pre[i] * h[b, t, i] for i in range(m)), atol=1e-12)
            for j in range(m):
                want = pst[j] * y[b, t] + sum(c[i, j] * h[b, t, i] for i in range(m))
                assert torch.allclose(out[b, t, j], want, atol=1e-12)
    assert torch.allclose(hc_head(expand_streams(y, m)), y, atol=1e-15)
