"""hyla.layers.prefix_attention: the new tokens of a sequence over its prefix and themselves,
against a built [T, L] mask in fp64, in one call and in CPU query blocks (a score budget small
enough for blocks of 1, 3 and 7 rows, and for T and L not multiples of them)."""

import pytest
import torch
import torch.nn.functional as F

import hyla.layers.prefix_attention as pa


def _reference(q, k, v, scale):
    T, L = q.shape[-2], k.shape[-2]
    mask = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]  # query i sees keys 0 .. L - T + i
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("T,L", [(5, 5), (1, 40), (13, 13 + 29), (29, 31)])
@pytest.mark.parametrize("rows", [None, 1, 3, 7])
def test_blocks_equal_one_masked_call(monkeypatch, T, L, rows):
    B, H, D, Dv = 2, 3, 8, 6
    if rows is not None:  # the budget that gives `rows` query rows a block
        monkeypatch.setattr(pa, "CPU_SCORE_BYTES", rows * B * H * L * 4)
    gen = torch.Generator().manual_seed(T * 100 + L)
    q, k = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64), torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, L, Dv, generator=gen, dtype=torch.float64)
    got = pa.attend_after_prefix(q, k, v, 0.3)
    torch.testing.assert_close(got, _reference(q, k, v, 0.3), rtol=0, atol=1e-12)


def test_score_memory_stays_under_the_budget(monkeypatch):
    """Every block's [T', L'] scores fit CPU_SCORE_BYTES (4-byte scores, 1 x 4 heads)."""
    seen = []
    real = pa.causal_after_prefix

    def spy(new, total):
        seen.append(4 * new * total * 4)
        return real(new, total)
    monkeypatch.setattr(pa, "causal_after_prefix", spy)
    monkeypatch.setattr(pa, "CPU_SCORE_BYTES", 1 << 16)
    q, k, v = torch.randn(1, 4, 300, 8), torch.randn(1, 4, 1000, 8), torch.randn(1, 4, 1000, 8)
    pa.attend_after_prefix(q, k, v, 0.5)
    assert len(seen) > 1 and max(seen) <= 1 << 16


@pytest.mark.parametrize("T,L,cuts", [(5, 5, []), (1, 40, [17]), (13, 42, [1, 2, 28]), (7, 100, [33, 66])])
@pytest.mark.parametrize("rows", [None, 2])
def test_key_blocks_equal_one_masked_call(monkeypatch, T, L, cuts, rows):
    """The prefix in blocks at the cut positions (awkward sizes, a 1-position block), then the T
    new positions: the log-sum-exp merge gives the one call's output (fp64: the same sums in
    another order). rows: CPU score blocks of 2 query rows inside each key block too."""
    B, H, D, Dv = 2, 3, 8, 6
    if rows is not None:
        monkeypatch.setattr(pa, "CPU_SCORE_BYTES", rows * B * H * L * 4)
    gen = torch.Generator().manual_seed(T * 1000 + L)
    q, k = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64), torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, L, Dv, generator=gen, dtype=torch.float64)
    bounds = [0, *cuts, L - T, L]
    built = []

    def blocks():  # built lazily, one at a time
        for s, e in zip(bounds, bounds[1:]):
            if e > s:
                built.append(e - s)
                yield k[:, :, s:e], v[:, :, s:e]
    got = pa.attend_key_blocks(q, blocks(), 0.3)
    torch.testing.assert_close(got, _reference(q, k, v, 0.3), rtol=0, atol=1e-12)
    assert sum(built) == L and built[-1] == T


def test_attention_with_lse():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, d, generator=gen, dtype=torch.float64) for n, d in ((6, 4), (9, 4), (9, 3)))
    out, lse = pa.attention_with_lse(q, k, v, 0.7, causal=False)
    scores = q @ k.transpose(-1, -2) * 0.7
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, scores.softmax(-1) @ v, rtol=0, atol=1e-12)
    out, lse = pa.attention_with_lse(q, k[:, :, :6], v[:, :, :6], 0.7, causal=True)
    scores = (q @ k[:, :, :6].transpose(-1, -2) * 0.7).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, scores.softmax(-1) @ v[:, :, :6], rtol=0, atol=1e-12)


def test_key_block_errors_and_sizes():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="causal block is square"):
        pa.attention_with_lse(q, torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4), 1.0, causal=True)
    with pytest.raises(ValueError, match="last key block must be the 3 new positions"):
        pa.attend_key_blocks(q, iter([(torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4))]), 1.0)
    assert pa.key_blocks(100, 10, pa.EXPAND_BYTES // 200) is None  # 110 positions fit
    assert pa.key_blocks(450, 10, pa.EXPAND_BYTES // 200) == [(0, 200), (200, 400), (400, 450), (450, 460)]
    assert pa.key_blocks(0, 300, pa.EXPAND_BYTES // 200) == [(0, 300)]  # no prefix: the new positions alone
