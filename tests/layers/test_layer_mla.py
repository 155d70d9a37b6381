"""MLAAttention: expanded form vs explicit attention, and the paged absorbed decode vs full forward."""

import pytest
import torch

from hyla.contract import ForwardBatch, MLALayerCache
from hyla.layers import MLAAttention


def _layer(q_lora_rank=None, bias=False, seed=0):
    torch.manual_seed(seed)
    layer = MLAAttention(32, 3, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10,
                         q_lora_rank=q_lora_rank, bias=bias)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer.double()


def reference(layer, x):
    """x: [T, hidden] -> [T, hidden], causal softmax attention written out per head."""
    T = x.shape[0]
    q = layer.query(x)  # [T, H, 18]
    c, kpe = layer.kv_a_proj_with_mqa(x).split([16, 6], dim=-1)
    c = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.kv_a_layernorm.weight
    kv = layer.kv_b_proj(c).view(T, 3, 22)
    k = torch.cat([kv[..., :12], kpe[:, None].expand(T, 3, 6)], dim=-1)
    v = kv[..., 12:]
    scores = torch.einsum("thd,shd->hts", q, k) / 18 ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shv->thv", scores.softmax(-1), v)
    return layer.o_proj(o.reshape(T, 30))


@pytest.mark.parametrize("q_lora_rank,bias", [(None, False), (8, True)])
def test_forward_equals_reference(q_lora_rank, bias):
    layer = _layer(q_lora_rank, bias)
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    with torch.no_grad():
        y = layer(x)
        for b in range(2):
            assert torch.allclose(y[b], reference(layer, x[b]), atol=1e-12, rtol=0)


@pytest.mark.parametrize("q_lora_rank", [None, 8])
def test_paged_prefill_and_absorbed_decode_equal_full_forward(q_lora_rank):
    """Two sequences on scattered pages (page_size 4): chunked prefill, a mixed step (one
    sequence prefilling while the other decodes), then batched absorbed decode."""
    layer = _layer(q_lora_rank)
    cache = MLALayerCache(torch.randn(16, 4, 22, dtype=torch.float64))  # garbage in unused rows
    xs = [torch.randn(14, 32, dtype=torch.float64), torch.randn(12, 32, dtype=torch.float64)]
    tables = [[9, 2, 14, 5], [0, 11, 7]]
    # (new tokens of seq 0, new tokens of seq 1) per step
    steps = [(6, 3), (1, 5), (5, 1), (1, 1), (1, 1), (0, 1)]
    done, outs = [0, 0], [[], []]
    with torch.no_grad():
        for step in steps:
            seqs = [n for n in range(2) if step[n]]
            batch = ForwardBatch.build([step[n] for n in seqs], [done[n] for n in seqs],
                                       [tables[n] for n in seqs], seqs)
            y = layer.forward_batch(torch.cat([xs[n][done[n]:done[n] + step[n]] for n in seqs]), batch, cache)
            start = 0
            for n in seqs:
                outs[n].append(y[start:start + step[n]])
                start += step[n]
                done[n] += step[n]
        for n in range(2):
            assert torch.allclose(torch.cat(outs[n]), layer(xs[n][None])[0], atol=1e-12, rtol=0)


def test_cache_holds_one_latent_per_token():
    layer = _layer()
    cache = MLALayerCache(torch.zeros(4, 4, 22, dtype=torch.float64))
    x = torch.randn(6, 32, dtype=torch.float64)
    with torch.no_grad():
        layer.forward_batch(x, ForwardBatch.build([6], [0], [[2, 0]], [0]), cache)
        lat = layer.latent(x)
    assert torch.equal(cache.kv[2], lat[:4]) and torch.equal(cache.kv[0, :2], lat[4:])
    assert cache.kv[0, 2:].abs().sum() == 0 and cache.kv[1].abs().sum() == 0


def test_missing_page_is_an_error():
    layer = _layer()
    cache = MLALayerCache(torch.zeros(4, 4, 22, dtype=torch.float64))
    with pytest.raises(ValueError, match="page"):
        layer.forward_batch(torch.randn(6, 32, dtype=torch.float64), ForwardBatch.build([6], [0], [[2]], [0]), cache)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("expand_bytes", [1 << 30, 40 * 864])
def test_many_prompts_in_one_step_equal_each_alone(monkeypatch, expand_bytes, padded):
    """Seven sequences at awkward lengths, five after a cached prefix, prefilled in one step on
    scattered pages: each sequence's output equals its full forward, through the grouped path
    (one gather and one up-projection for a group's pages). The small bound (40 positions of 864
    bytes, fp64 x 3 heads x 36) splits the step into several groups and leaves a 45-position
    sequence alone, in key blocks.
    Unused page rows hold NaN (what a request that overflowed leaves in pages a later one gets):
    no row past a sequence's length may reach its output, in the prefill or the absorbed path.
    padded: the expansion CUDA's flash path takes (values padded to the key width, keys and
    values views of one up-projection), forced on the CPU."""
    import hyla.layers.prefix_attention as pa

    monkeypatch.setattr(pa, "EXPAND_BYTES", expand_bytes)
    monkeypatch.setattr(MLAAttention, "_pads_values", lambda self, q: padded)
    layer = _layer(8)
    page = 4
    lens = [(0, 5), (3, 9), (7, 2), (0, 13), (11, 34), (1, 1), (6, 7)]  # (cached, new)
    tables, first = [], 0
    for ctx, new in lens:
        n_pages = -(-(ctx + new) // page)
        tables.append(list(range(first, first + n_pages))[::-1])  # scattered, in reverse
        first += n_pages
    cache = MLALayerCache(torch.full((first, page, 22), float("nan"), dtype=torch.float64))
    xs = [torch.randn(ctx + new, 32, dtype=torch.float64) for ctx, new in lens]
    with torch.no_grad():
        prefix = [n for n, (ctx, _) in enumerate(lens) if ctx]
        layer.forward_batch(torch.cat([xs[n][:lens[n][0]] for n in prefix]),
                            ForwardBatch.build([lens[n][0] for n in prefix], [0] * len(prefix),
                                               [tables[n] for n in prefix], prefix), cache)
        batch = ForwardBatch.build([new for _, new in lens], [ctx for ctx, _ in lens], tables, list(range(len(lens))))
        y = layer.forward_batch(torch.cat([x[ctx:] for x, (ctx, _) in zip(xs, lens)]), batch, cache)
        start = 0
        for x, (ctx, new) in zip(xs, lens):
            assert torch.allclose(y[start:start + new], layer(x[None])[0, ctx:], atol=1e-12, rtol=0)
            start += new



def test_padded_expansion_is_the_plain_one_widened():
    """expand(pad_values=True): the same keys, the values followed by zero columns up to the key
    width, from one up-projection; rebuilt when the weight changes."""
    layer = _layer()
    latent = torch.randn(2, 7, 22, dtype=torch.float64)
    with torch.no_grad():
        k, v = layer.expand(latent)
        kp, vp = layer.expand(latent, pad_values=True)
        assert kp.shape == k.shape and vp.shape == (2, 3, 7, 18)
        torch.testing.assert_close(kp, k, rtol=0, atol=1e-13)
        torch.testing.assert_close(vp[..., :10], v, rtol=0, atol=1e-13)
        assert (vp[..., 10:] == 0).all()
        layer.kv_b_proj.weight.mul_(2)
        torch.testing.assert_close(layer.expand(latent, pad_values=True)[1][..., :10], layer.expand(latent)[1],
                                   rtol=0, atol=1e-13)


def test_expansion_groups_fit_the_bound_in_order():
    from hyla.layers.prefix_attention import EXPAND_BYTES, expansion_groups

    per = EXPAND_BYTES // 100  # 100 positions fit
    seqs = [(0, 30), (1, 50), (2, 30), (3, 250), (4, 10), (5, 15)]
    assert expansion_groups(seqs, per, 10) == [[(0, 30), (1, 50)], [(2, 30)], [(3, 250)], [(4, 10), (5, 15)]]
    assert expansion_groups([], per, 10) == []
