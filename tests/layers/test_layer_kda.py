"""KimiDeltaAttention against a literal per-token loop written from the formulas (fp64)."""

import math

import pytest
import torch

from hyla.contract import ForwardBatch, KDALayerCache
from hyla.layers import KimiDeltaAttention


def _layer(lower_bound=None, full_rank_gate=False, heads=2, head_dim=8, hidden=24, seed=0):
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(hidden, heads, head_dim, 4, lower_bound=lower_bound, full_rank_gate=full_rank_gate)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.o_norm.weight.add_(1.0)
    return layer.double()


def loop_reference(layer, x, state=None, window=None):
    """x: [T, hidden] fp64 -> (y [T, hidden], state [H, K, K], conv windows (q, k, v) [D, 3]).
    Everything spelled out token by token: conv, gate, L2 norm, delta rule, gated norm."""
    H, K = layer.num_heads, layer.head_dim
    D = H * K
    state = torch.zeros(H, K, K, dtype=x.dtype) if state is None else state.clone()
    windows = [torch.zeros(D, 3, dtype=x.dtype) for _ in range(3)] if window is None else [w.clone() for w in window]
    a = layer.A_log.reshape(H, 1).exp()
    ys = []
    for t in range(x.shape[0]):
        xt = x[t]
        qkv = []
        for i, (proj, conv) in enumerate(zip(layer.project_qkv(xt), layer.convs())):
            full = torch.cat([windows[i], proj[:, None]], dim=1)  # [D, 4], oldest first
            qkv.append(torch.nn.functional.silu((full * conv.weight[:, 0]).sum(1)))
            windows[i] = full[:, 1:]
        q, k, v = (t_.reshape(H, K) for t_ in qkv)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        f = (layer.f_b_proj(layer.f_a_proj(xt)) + layer.dt_bias).reshape(H, K)
        if layer.lower_bound is None:
            g = -a * torch.log1p(torch.exp(f))
        else:
            g = layer.lower_bound * torch.sigmoid(a * f)
        beta = torch.sigmoid(layer.b_proj(xt))
        o = torch.empty(H, K, dtype=x.dtype)
        for h in range(H):
            s = state[h] * g[h].exp()[:, None]
            err = beta[h] * (v[h] - k[h] @ s)
            s = s + torch.outer(k[h], err)
            state[h] = s
            o[h] = (q[h] / math.sqrt(K)) @ s
        gate = layer.g_proj(xt) if layer.full_rank_gate else layer.g_b_proj(layer.g_a_proj(xt))
        normed = o / torch.sqrt((o * o).mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight
        ys.append(layer.o_proj((normed * torch.sigmoid(gate.reshape(H, K))).reshape(D)))
    return torch.stack(ys), state, windows


@pytest.mark.parametrize("lower_bound,full_rank", [(None, False), (-5.0, False), (None, True), (-2.5, True)])
def test_forward_equals_loop(lower_bound, full_rank):
    layer = _layer(lower_bound, full_rank)
    x = torch.randn(2, 37, 24, dtype=torch.float64)
    with torch.no_grad():
        y = layer(x)
        for b in range(2):
            ref, _, _ = loop_reference(layer, x[b])
            assert torch.allclose(y[b], ref, atol=1e-10, rtol=0)


def test_safe_gate_bounds_decay():
    layer = _layer(lower_bound=-5.0)
    with torch.no_grad():
        layer.dt_bias.fill_(8.0)  # v1 would give g ~ -8 * exp(A_log), below -5 for most heads
        g = layer.forget_gate(torch.randn(1, 9, 24, dtype=torch.float64))
    assert g.min() >= -5.0 and g.max() < 0


def _cache(layer, slots):
    D = layer.num_heads * layer.head_dim
    state = torch.randn(slots, layer.num_heads, layer.head_dim, layer.head_dim, dtype=torch.float64)
    return KDALayerCache(state, tuple(torch.randn(slots, D, 3, dtype=torch.float64) for _ in range(3)))


def test_forward_batch_prefill_then_decode_equals_loop():
    """Two sequences: varlen chunk prefill in two pieces, then batched decode; slots start with
    garbage, which context_len 0 must ignore. Outputs, states and conv windows equal the loop."""
    layer = _layer(-5.0)
    cache = _cache(layer, 4)
    xs = [torch.randn(30, 24, dtype=torch.float64), torch.randn(9, 24, dtype=torch.float64)]
    slots = [3, 1]
    pieces = [(0, 20, 0, 4), (20, 28, 4, 9), (28, 29, 9, 10), (29, 30, 10, 11)]  # (a0, a1, b0, b1)
    ys = [[], []]
    xs[1] = torch.cat([xs[1], torch.randn(2, 24, dtype=torch.float64)])
    with torch.no_grad():
        for a0, a1, b0, b1 in pieces:
            batch = ForwardBatch.build([a1 - a0, b1 - b0], [a0, b0], [[0], [1]], slots)
            out = layer.forward_batch(torch.cat([xs[0][a0:a1], xs[1][b0:b1]]), batch, cache)
            ys[0].append(out[: a1 - a0])
            ys[1].append(out[a1 - a0:])
        for n in range(2):
            ref, state, windows = loop_reference(layer, xs[n][: sum(p[2 * n + 1] - p[2 * n] for p in pieces)])
            assert torch.allclose(torch.cat(ys[n]), ref, atol=1e-10, rtol=0)
            assert torch.allclose(cache.state[slots[n]], state, atol=1e-10, rtol=0)
            for pool, w in zip(cache.conv, windows):
                assert torch.allclose(pool[slots[n]], w, atol=1e-12, rtol=0)


def test_one_token_prompt_decode_ignores_stale_slot():
    layer = _layer()
    cache = _cache(layer, 2)
    x = torch.randn(1, 24, dtype=torch.float64)
    with torch.no_grad():
        out = layer.forward_batch(x, ForwardBatch.build([1], [0], [[0]], [1]), cache)
        ref, state, _ = loop_reference(layer, x)
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)
    assert torch.allclose(cache.state[1], state, atol=1e-10, rtol=0)


def test_checkpoints_equal_a_run_stopped_there():
    layer = _layer(-5.0)
    cache = _cache(layer, 6)
    x = torch.randn(23, 24, dtype=torch.float64)
    with torch.no_grad():
        layer.forward_batch(x[:5], ForwardBatch.build([5], [0], [[0]], [0]), cache)
        batch = ForwardBatch.build([18], [5], [[0]], [0], checkpoints=[[(1, 2), (11, 3), (18, 4)]])
        layer.forward_batch(x[5:], batch, cache)
        for p, dest in [(1, 2), (11, 3), (18, 4)]:
            _, state, windows = loop_reference(layer, x[: 5 + p])
            assert torch.allclose(cache.state[dest], state, atol=1e-10, rtol=0)
            for pool, w in zip(cache.conv, windows):
                assert torch.allclose(pool[dest], w, atol=1e-12, rtol=0)


def test_checkpoints_of_several_sequences_in_one_step():
    """Three sequences resuming in one step, the first and last exporting checkpoints (windows
    partly from the initial conv window at p = 1, 2), the middle one none: every state and window
    written at once equals a run stopped there."""
    layer = _layer(-5.0)
    cache = _cache(layer, 12)
    xs = [torch.randn(n, 24, dtype=torch.float64) for n in (21, 9, 30)]
    ckpts = [[(1, 6), (2, 7), (16, 8)], [], [(3, 9), (24, 10)]]
    with torch.no_grad():
        for n, x in enumerate(xs):  # a context of 4, 5 and 6 tokens in slots 0, 1, 2
            layer.forward_batch(x[:4 + n], ForwardBatch.build([4 + n], [0], [[0]], [n]), cache)
        new = [x.shape[0] - 4 - n for n, x in enumerate(xs)]
        batch = ForwardBatch.build(new, [4, 5, 6], [[0], [0], [0]], [0, 1, 2], checkpoints=ckpts)
        layer.forward_batch(torch.cat([x[4 + n:] for n, x in enumerate(xs)]), batch, cache)
        for n, pairs in enumerate(ckpts):
            for p, dest in pairs:
                _, state, windows = loop_reference(layer, xs[n][: 4 + n + p])
                assert torch.allclose(cache.state[dest], state, atol=1e-10, rtol=0)
                for pool, w in zip(cache.conv, windows):
                    assert torch.allclose(pool[dest], w, atol=1e-12, rtol=0)


def test_decode_step_checkpoint():
    layer = _layer()
    cache = _cache(layer, 4)
    x = torch.randn(4, 24, dtype=torch.float64)
    with torch.no_grad():
        layer.forward_batch(x[:3], ForwardBatch.build([3], [0], [[0]], [0]), cache)
        layer.forward_batch(x[3:], ForwardBatch.build([1], [3], [[0]], [0], checkpoints=[[(1, 2)]]), cache)
        _, state, windows = loop_reference(layer, x)
    assert torch.allclose(cache.state[2], state, atol=1e-10, rtol=0)
    for pool, w in zip(cache.conv, windows):
        assert torch.allclose(pool[2], w, atol=1e-12, rtol=0)


@pytest.mark.parametrize("full_rank_gate", [False, True], ids=["kimi-linear", "kimi-k3"])
def test_fp8_projections_pack_into_one_gemm_at_the_released_head_layout(full_rank_gate):
    """At the released layouts (32 heads x 128: q, k, v 4096 rows, f_a and g_a 128, or K3's full
    g_proj 4096, b 32) block-FP8 packing needs every part but the last to fill whole 128-row
    blocks: with b last the six projections run as one GEMM, with the outputs of the six."""
    from hyla.layers.fp8_linear import quantized_like

    layer = KimiDeltaAttention(64, 32, 128, 4, full_rank_gate=full_rank_gate)
    gate = "g_proj" if full_rank_gate else "g_a_proj"
    for name in ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", gate):
        setattr(layer, name, quantized_like(getattr(layer, name)))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    apart = layer.project_all(x)
    layer.prepare_for_inference()
    assert layer._packed.weight() is not None
    together = layer.project_all(x)
    for a, b in zip(apart, together):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)  # fp32 sums over the same products
    assert [t.shape[-1] for t in together] == [4096, 4096, 4096, 128, 4096 if full_rank_gate else 128, 32]
