"""Manifold-constrained hyper-connections (mHC), as GLM-5-Next uses them around every block.

The residual stream is widened to m = hc_mult streams, h: [..., m, hidden]. Around a block f
(attention or MLP), per token:

    z          = rms(flatten(h)) @ fn^T                      [(2 + m) * m]  (fp32, no norm weight)
    pre        = sigmoid(z_pre * scale[0] + base_pre) + eps              [m]
    post       = 2 * sigmoid(z_post * scale[1] + base_post)               [m]
    comb       = sinkhorn(softmax(z_comb * scale[2] + base_comb) + eps)   [m, m], rows and cols ~ 1
    x          = sum_i pre[i] h[i]                           the block's input   [hidden]
    h'[j]      = post[j] f(x) + sum_i comb[i, j] h[i]        the new streams     [m, hidden]

Sinkhorn: columns normalised first, then (rows, columns) `iters - 1` more times; each division
adds eps to the sum. The model's final hidden state is the plain mean of the streams (`hc_head`).

Tensor names (the checkpoint's, on the decoder layer): hc_attn_fn [(2+m)*m, m*hidden],
hc_attn_base [(2+m)*m], hc_attn_scale [3]; hc_ffn_* alike. base and scale are kept in fp32.
"""

from __future__ import annotations

import torch
from torch import nn


class HyperConnection(nn.Module):
    """Holds nothing but sizes: the parameters live on the decoder layer under the official names
    and are passed in, so that `state_dict()` keeps them there."""

    def __init__(self, hc_mult: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.m, self.iters, self.eps, self.norm_eps = hc_mult, sinkhorn_iters, eps, norm_eps

    @staticmethod
    def new_parameters(hc_mult: int, hidden_size: int) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
        """(fn, base, scale) at transformers' init: fn ~ N(0, 0.02), base 0, scale 1."""
        n = (2 + hc_mult) * hc_mult
        fn = nn.Parameter(torch.randn(n, hc_mult * hidden_size) * 0.02)
        return fn, nn.Parameter(torch.zeros(n, dtype=torch.float32)), nn.Parameter(torch.ones(3, dtype=torch.float32))

    def sinkhorn(self, comb: torch.Tensor) -> torch.Tensor:
        """comb: [..., m, m] positive -> approximately doubly stochastic (same shape)."""
        comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        return comb

    def pre(self, h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
            scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [..., m, hidden] -> (post [..., m] fp32, comb [..., m, m] fp32, block input x
        [..., hidden] in h.dtype)."""
        m = self.m
        work = torch.float64 if h.dtype == torch.float64 else torch.float32
        flat = h.flatten(-2).to(work)
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        z = flat @ fn.to(work).t()  # [..., (2 + m) * m]
        z_pre, z_post, z_comb = z.split([m, m, m * m], dim=-1)
        b = base.to(work)
        s = scale.to(work)
        pre = torch.sigmoid(z_pre * s[0] + b[:m]) + self.eps
        post = 2 * torch.sigmoid(z_post * s[1] + b[m:2 * m])
        logits = z_comb.unflatten(-1, (m, m)) * s[2] + b[2 * m:].view(m, m)
        comb = self.sinkhorn(torch.softmax(logits, dim=-1) + self.eps)
        x = (pre.unsqueeze(-1) * h).sum(-2).to(h.dtype)
        return post, comb, x

    @staticmethod
    def post(y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """y: [..., hidden] block output; post [..., m]; comb [..., m, m]; h: [..., m, hidden] the
        streams the block read -> new streams [..., m, hidden]: post[j] y + sum_i comb[i, j] h[i]."""
        dt = h.dtype
        return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + comb.to(dt).transpose(-1, -2) @ h


def hc_head(h: torch.Tensor) -> torch.Tensor:
    """h: [..., m, hidden] -> [..., hidden]: the mean of the streams (GLM-5-Next's final collapse)."""
    return h.mean(dim=-2)


def expand_streams(x: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """x: [..., hidden] embeddings -> [..., m, hidden]: every stream starts as the embedding."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], hc_mult, x.shape[-1]).contiguous()
