"""Qwen3-Next's gated attention against a literal loop (fp64): q/k zero-centred norms, partial
rotate-half RoPE, GQA, the per-head output gate; and its paged forward_batch against the full
forward."""

import math

import pytest
import torch

from hyla.contract import ForwardBatch, KVLayerCache
from hyla.layers import GatedAttention

HIDDEN = 24


def _layer(heads=4, kv_heads=2, head_dim=12, factor=0.5, theta=100.0, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = GatedAttention(HIDDEN, heads, kv_heads, head_dim, partial_rotary_factor=factor, rope_theta=theta,
                           bias=bias)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer.double()


def loop_reference(layer, x):
    """x: [T, hidden] fp64 -> [T, hidden], every formula spelled out per token and head."""
    H, Hkv, D, R = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.rotary.rotary_dim
    T = x.shape[0]

    def norm(t, w):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-6) * (1 + w)

    def rope(t, pos):  # the rotary angles are fp32, as transformers computes them
        out = t.clone()
        for i in range(R // 2):
            inv = 1.0 / (torch.tensor(layer.rotary.theta, dtype=torch.float32) ** torch.tensor(2 * i / R,
                                                                                               dtype=torch.float32))
            ang = torch.tensor(float(pos), dtype=torch.float32) * inv
            c, s = ang.cos().double(), ang.sin().double()
            out[..., i] = t[..., i] * c - t[..., i + R // 2] * s
            out[..., i + R // 2] = t[..., i + R // 2] * c + t[..., i] * s
        return out

    qg = layer.q_proj(x).reshape(T, H, 2 * D)
    q = torch.stack([rope(norm(qg[t, :, :D], layer.q_norm.weight), t) for t in range(T)])
    gate = qg[:, :, D:]
    k = layer.k_proj(x).reshape(T, Hkv, D)
    k = torch.stack([rope(norm(k[t], layer.k_norm.weight), t) for t in range(T)])
    v = layer.v_proj(x).reshape(T, Hkv, D)
    ys = []
    for t in range(T):
        o = torch.empty(H, D, dtype=x.dtype)
        for h in range(H):
            j = h // (H // Hkv)
            w = torch.softmax(torch.stack([q[t, h] @ k[s, j] / math.sqrt(D) for s in range(t + 1)]), 0)
            o[h] = sum(w[s] * v[s, j] for s in range(t + 1))
        ys.append(layer.o_proj((o * torch.sigmoid(gate[t])).reshape(H * D)))
    return torch.stack(ys)


@pytest.mark.parametrize("heads,kv_heads,factor,bias", [(4, 2, 0.5, True), (2, 2, 1.0, False), (3, 1, 0.25, True)])
def test_forward_equals_loop(heads, kv_heads, factor, bias):
    layer = _layer(heads, kv_heads, 16, factor, bias=bias)
    x = torch.randn(2, 19, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        y = layer(x)
        for b in range(2):
            assert torch.allclose(y[b], loop_reference(layer, x[b]), atol=1e-10, rtol=0)


@pytest.mark.parametrize("expand_bytes", [None, 5 * 2 * 8 * 4 * 12])
def test_paged_prefill_and_decode_equal_full_forward(expand_bytes, monkeypatch):
    """Three sequences over shuffled pages (size 4): prefill in uneven pieces, mixing one-token
    rows with longer ones and nonzero contexts, then batched decode steps. expand_bytes: the
    prefix's repeated keys and values built 5 positions at a time (hyla.layers.prefix_attention)."""
    if expand_bytes is not None:
        import hyla.layers.prefix_attention as pa

        monkeypatch.setattr(pa, "EXPAND_BYTES", expand_bytes)  # 2 x fp64 x 4 heads x 12 per position
    layer = _layer()
    cache = KVLayerCache(*(torch.full((24, 4, 2, 12), float("nan"), dtype=torch.float64) for _ in range(2)))
    xs = [torch.randn(n, HIDDEN, dtype=torch.float64) for n in (23, 9, 14)]
    tables = [[5, 2, 17, 9, 11, 0], [3, 21, 8], [14, 1, 20, 7]]
    steps = [[(0, 7), (1, 1), (2, 5)], [(0, 10), (1, 5), (2, 1)], [(0, 3), (1, 1), (2, 5)],
             [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (2, 1)]]
    done, got = [0, 0, 0], [[], [], []]
    with torch.no_grad():
        for step in steps:
            batch = ForwardBatch.build([n for _, n in step], [done[i] for i, _ in step], [tables[i] for i, _ in step],
                                       list(range(len(step))))
            out = layer.forward_batch(torch.cat([xs[i][done[i]:done[i] + n] for i, n in step]), batch, cache)
            start = 0
            for i, n in step:
                got[i].append(out[start:start + n])
                start += n
                done[i] += n
        for i in range(3):
            assert torch.allclose(torch.cat(got[i]), layer(xs[i][None])[0], atol=1e-12, rtol=0)
