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
