"""GatedDeltaNet against a literal per-token loop written from transformers' formulas (fp64):
the head-interleaved fused projections, grouped value heads, one conv over q|k|v, the Mamba2
gate, the delta rule and the SiLU-gated output norm."""

import math

import pytest
import torch
import torch.nn.functional as F

from hyla.contract import ForwardBatch, GDNLayerCache
from hyla.layers import GatedDeltaNet

HIDDEN = 24


def _layer(h=2, hv=4, dk=8, dv=6, seed=0):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(HIDDEN, h, hv, dk, dv, conv_kernel_size=4)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.norm.weight.add_(1.0)
    return layer.double()


def loop_reference(layer, x, state=None, window=None):
    """x: [T, hidden] fp64 -> (y [T, hidden], state [HV, K, V], conv window [conv_dim, 3])."""
    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    r = HV // H
    state = torch.zeros(HV, K, V, dtype=x.dtype) if state is None else state.clone()
    window = torch.zeros(layer.conv_dim, 3, dtype=x.dtype) if window is None else window.clone()
    ys = []
    for t in range(x.shape[0]):
        qkvz = layer.in_proj_qkvz(x[t]).reshape(H, 2 * K + 2 * r * V)  # per key head: q, k, r v's, r z's
        ba = layer.in_proj_ba(x[t]).reshape(H, 2 * r)  # per key head: r b's, r a's
        q, k = qkvz[:, :K], qkvz[:, K:2 * K]
        v = qkvz[:, 2 * K:2 * K + r * V].reshape(HV, V)
        z = qkvz[:, 2 * K + r * V:].reshape(HV, V)
        b, a = ba[:, :r].reshape(HV), ba[:, r:].reshape(HV)
        full = torch.cat([window, torch.cat([q.flatten(), k.flatten(), v.flatten()])[:, None]], dim=1)
        mixed = F.silu((full * layer.conv1d.weight[:, 0]).sum(1))
        window = full[:, 1:]
        q, k, v = mixed[:H * K].reshape(H, K), mixed[H * K:2 * H * K].reshape(H, K), mixed[2 * H * K:].reshape(HV, V)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        g = -layer.A_log.exp() * torch.log1p(torch.exp(a + layer.dt_bias))
        beta = torch.sigmoid(b)
        o = torch.empty(HV, V, dtype=x.dtype)
        for j in range(HV):
            h = j // r  # grouped value heads: value head j reads key head j // r
            s = state[j] * g[j].exp()
            s = s + torch.outer(k[h], beta[j] * (v[j] - k[h] @ s))
            state[j] = s
            o[j] = (q[h] / math.sqrt(K)) @ s
        normed = o / torch.sqrt((o * o).mean(-1, keepdim=True) + layer.norm.eps) * layer.norm.weight
        ys.append(layer.out_proj((normed * F.silu(z)).reshape(HV * V)))
    return torch.stack(ys), state, window


@pytest.mark.parametrize("h,hv,dk,dv", [(2, 4, 8, 6), (3, 3, 8, 8), (1, 4, 16, 5)])
def test_forward_equals_loop(h, hv, dk, dv):
    layer = _layer(h, hv, dk, dv)
    x = torch.randn(2, 37, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        y = layer(x)
        for b in range(2):
            assert torch.allclose(y[b], loop_reference(layer, x[b])[0], atol=1e-10, rtol=0)


def _cache(layer, slots):
    state = torch.randn(slots, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, dtype=torch.float64)
    return GDNLayerCache(state, (torch.randn(slots, layer.conv_dim, 3, dtype=torch.float64),))


def test_forward_batch_prefill_decode_and_checkpoints_equal_loop():
    """Two sequences, slots full of garbage: varlen prefill in pieces (one of them with state
    checkpoints), then batched decode. Outputs, states, conv windows and checkpoints equal the loop."""
    layer = _layer()
    cache = _cache(layer, 6)
    xs = [torch.randn(31, HIDDEN, dtype=torch.float64), torch.randn(12, HIDDEN, dtype=torch.float64)]
    slots = [3, 1]
    pieces = [(0, 20, 0, 4), (20, 29, 4, 10), (29, 30, 10, 11), (30, 31, 11, 12)]  # (a0, a1, b0, b1)
    ys = [[], []]
    with torch.no_grad():
        for i, (a0, a1, b0, b1) in enumerate(pieces):
            ckpts = [[(2, 4), (9, 5)], [(6, 0)]] if i == 1 else None
            batch = ForwardBatch.build([a1 - a0, b1 - b0], [a0, b0], [[0], [1]], slots, checkpoints=ckpts)
            out = layer.forward_batch(torch.cat([xs[0][a0:a1], xs[1][b0:b1]]), batch, cache)
            ys[0].append(out[: a1 - a0])
            ys[1].append(out[a1 - a0:])
        for n in range(2):
            ref, state, window = loop_reference(layer, xs[n])
            assert torch.allclose(torch.cat(ys[n]), ref, atol=1e-10, rtol=0)
            assert torch.allclose(cache.state[slots[n]], state, atol=1e-10, rtol=0)
            assert torch.allclose(cache.conv[0][slots[n]], window, atol=1e-12, rtol=0)
        for n, p, dest in [(0, 22, 4), (0, 29, 5), (1, 10, 0)]:
            _, state, window = loop_reference(layer, xs[n][:p])
            assert torch.allclose(cache.state[dest], state, atol=1e-10, rtol=0)
            assert torch.allclose(cache.conv[0][dest], window, atol=1e-12, rtol=0)


def test_bad_head_counts():
    with pytest.raises(ValueError, match="multiple"):
        GatedDeltaNet(HIDDEN, 2, 3, 8, 8)
