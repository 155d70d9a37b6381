"""Paged MLA ops (hyla.ops.mla): the torch reference against a per-query fp64 loop, and the
Triton kernels (TRITON_INTERPRET=1 on the CPU) against the reference, at awkward sizes: head
counts that do not fill a head block, widths that are not powers of two, no positional part
(NoPE), padding pages (-1), several query tokens per sequence and more splits than tokens."""

from __future__ import annotations

import pytest
import torch

from hyla.ops import mla as ref
from hyla.ops.norm import rms_norm_rounded
from tests.ops.paged_tables import random_block_tables
from tests.ops.test_fused_decode import assert_ulps
from tests.ops.triton_env import triton_module



def _triton():
    return triton_module("mla")


def _inputs(S, W, H, r, rope, v, ps, lens, dtype, seed):
    """Random queries, a random pool and block tables: sequence s holds lens[s] tokens in pages
    drawn without replacement, padded with -1; its W queries sit at the last W positions."""
    g = torch.Generator().manual_seed(seed)
    tables, num_pages = random_block_tables(lens, ps, g)
    cache = torch.randn(num_pages, ps, r + rope, generator=g, dtype=torch.float64).to(dtype)
    q_lat = torch.randn(S * W, H, r, generator=g, dtype=torch.float64).to(dtype)
    q_pe = torch.randn(S * W, H, rope, generator=g, dtype=torch.float64).to(dtype)
    w_uv = (torch.randn(H, v, r, generator=g, dtype=torch.float64) / r ** 0.5).to(dtype)
    last = torch.tensor([n - W + i for n in lens for i in range(W)], dtype=torch.long)
    return q_lat, q_pe, cache, tables, last, w_uv


def _loop(q_lat, q_pe, cache, tables, last, w_uv, scale):
    """fp64 oracle: each query and head on its own over its gathered positions."""
    N, H, r = q_lat.shape
    W = N // tables.shape[0]
    ps = cache.shape[1]
    out = torch.zeros(N, H * w_uv.shape[1], dtype=torch.float64)
    for n in range(N):
        length = int(last[n]) + 1
        rows = [int(tables[n // W, t // ps]) * ps + t % ps for t in range(length)]
        lat = cache.view(-1, cache.shape[-1])[rows].double()
        for h in range(H):
            q = torch.cat([q_lat[n, h], q_pe[n, h]]).double()
            p = torch.softmax(lat @ q * scale, 0)
            out[n, h * w_uv.shape[1]:(h + 1) * w_uv.shape[1]] = w_uv[h].double() @ (p @ lat[:, :r])
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


CASES = [  # S, W, H, r, rope, v, page_size, lengths
    (2, 1, 3, 32, 16, 24, 4, [1, 13]),
    (3, 3, 5, 48, 0, 16, 8, [3, 20, 9]),   # NoPE, verify-shaped queries
    (1, 1, 17, 16, 16, 16, 16, [37]),      # 17 heads: two head blocks, the second nearly empty
    (6, 3, 2, 16, 16, 16, 4, [5, 9, 3, 12, 7, 4]),  # 18 queries: two query blocks in the combine
]


@pytest.mark.parametrize("S,W,H,r,rope,v,ps,lens", CASES)
def test_reference_matches_loop_fp64(S, W, H, r, rope, v, ps, lens):
    args = _inputs(S, W, H, r, rope, v, ps, lens, torch.float64, seed=S + W)
    got = ref.paged_mla_decode(*args, scale=0.3)
    assert _rel(got, _loop(*args, scale=0.3)) < 1e-12


SPLITS = [  # min_splits, split_tokens, max_splits: one slice; a fixed count; one per 16 tokens up to 5;
    (1, 1 << 20, 1), (4, 1 << 20, 7), (2, 16, 5), (20, 1 << 20, 20)]  # 20: two steps of the combine, most empty


@pytest.mark.parametrize("S,W,H,r,rope,v,ps,lens", CASES)
@pytest.mark.parametrize("splits", SPLITS)
def test_triton_decode_matches_loop(S, W, H, r, rope, v, ps, lens, splits):
    mla, dev = _triton()
    args = _inputs(S, W, H, r, rope, v, ps, lens, torch.float32, seed=3 * S + W)
    want = _loop(*(a.double() if a.is_floating_point() else a for a in args), scale=0.3)
    lo, tokens, hi = splits
    got = mla.paged_mla_decode(*(a.to(dev) for a in args), scale=0.3, block_n=16, min_splits=lo,
                               split_tokens=tokens, max_splits=hi, min_split=16)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert _rel(got.cpu(), want) < 1e-5  # fp32 throughout (ieee dots): rounding only


def test_triton_decode_ignores_unused_table_columns():
    """A CUDA graph passes every block-table column, an eager step only the columns in use:
    the same numbers, bit for bit (the split of a sequence follows its length, not the table)."""
    mla, dev = _triton()
    q_lat, q_pe, cache, tables, last, w_uv = _inputs(2, 1, 3, 32, 16, 16, 4, [37, 170], torch.float32, seed=4)
    wide = torch.cat([tables, torch.full((2, 20), -1)], 1)
    # a slice per 40 tokens, up to 8: 37 tokens in 1 slice, 170 in 5 of 48 tokens (the last empty); the
    # narrow table's grid (43 pages) has room for 5 slices, the wide one's (63 pages) for 7
    cut = dict(scale=0.3, block_n=16, min_split=16, min_splits=1, split_tokens=40, max_splits=8)
    a = mla.paged_mla_decode(*(t.to(dev) for t in (q_lat, q_pe, cache, tables, last, w_uv)), **cut)
    b = mla.paged_mla_decode(*(t.to(dev) for t in (q_lat, q_pe, cache, wide, last, w_uv)), **cut)
    assert torch.equal(a, b)
    padded = [torch.cat([t, t[:1]]) for t in (q_lat, q_pe, tables, last)]  # one more (padding) sequence
    c = mla.paged_mla_decode(*(t.to(dev) for t in (padded[0], padded[1], cache, padded[2], padded[3], w_uv)), **cut)
    assert torch.equal(a, c[:2])
    # the graph runner's lengths and tables are strided columns of one buffer
    meta = torch.cat([torch.zeros(2, 2, dtype=torch.long), last[:, None], wide], 1)
    d = mla.paged_mla_decode(*(t.to(dev) for t in (q_lat, q_pe, cache, meta[:, 3:], meta[:, 2], w_uv)), **cut)
    assert torch.equal(a, d)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_rows_past_a_length_never_reach_the_output(path):
    """Page rows past each sequence's last position hold NaN (what a request whose activations
    overflowed leaves in pages a later request gets): the output equals the one over a zeroed
    pool, in the reference (0 x NaN is NaN in its value product) and in the kernel."""
    S, W, H, r, rope, v, ps, lens = 3, 2, 3, 32, 16, 24, 4, [5, 13, 2]
    q_lat, q_pe, cache, tables, last, w_uv = _inputs(S, W, H, r, rope, v, ps, lens, torch.float32, seed=11)
    used = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for s, n in enumerate(lens):
        for t in range(n):
            used[tables[s, t // ps], t % ps] = True
    nan = cache.masked_fill(~used[..., None], float("nan"))
    clean = cache.masked_fill(~used[..., None], 0.0)
    if path == "reference":
        a = ref.paged_mla_decode(q_lat, q_pe, nan, tables, last, w_uv, scale=0.3)
        b = ref.paged_mla_decode(q_lat, q_pe, clean, tables, last, w_uv, scale=0.3)
    else:
        mla, dev = _triton()
        a, b = (mla.paged_mla_decode(*(t.to(dev) for t in (q_lat, q_pe, c, tables, last, w_uv)), scale=0.3,
                                     block_n=16).cpu() for c in (nan, clean))
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_triton_decode_split_counts_are_checked():
    mla, dev = _triton()
    args = _inputs(1, 1, 2, 16, 16, 16, 4, [5], torch.float32, seed=1)
    with pytest.raises(ValueError, match="min_splits"):
        mla.paged_mla_decode(*(a.to(dev) for a in args), scale=0.5, min_splits=8, max_splits=4)


def test_triton_decode_query_without_positions_gives_zeros():
    """A CUDA-graph padding row may ask for no position at all (last = -1): zeros, not NaN."""
    mla, dev = _triton()
    q_lat, q_pe, cache, tables, last, w_uv = _inputs(2, 1, 2, 16, 16, 16, 4, [5, 6], torch.float32, seed=1)
    last[1] = -1
    got = mla.paged_mla_decode(*(a.to(dev) for a in (q_lat, q_pe, cache, tables, last, w_uv)), scale=0.5)
    assert torch.isfinite(got).all() and got[1].abs().max() == 0


def test_decode_shapes_are_checked():
    q_lat, q_pe, cache, tables, last, w_uv = _inputs(2, 1, 2, 16, 16, 16, 4, [5, 6], torch.float32, seed=1)
    with pytest.raises(ValueError, match="last must be"):
        ref.paged_mla_decode(q_lat, q_pe, cache, tables, last[:1], w_uv, 0.5)
    with pytest.raises(ValueError, match="cache must be"):
        ref.paged_mla_decode(q_lat, q_pe, cache[..., :-1], tables, last, w_uv, 0.5)


@pytest.mark.parametrize("rope", [16, 0])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32, torch.float32),
                                    (torch.float32, torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("uniform", [True, False])
def test_write_latents_triton_matches_reference(rope, dtypes, uniform):
    """Every token lands at its page and offset (a -1 page: the last page, as graph padding)
    with the reference's roundings: the normalised c rounded to its dtype before the weight."""
    mla, dev = _triton()
    x_dtype, w_dtype, cache_dtype = dtypes
    g = torch.Generator().manual_seed(rope + uniform)
    r, ps = 40, 4
    tables = torch.tensor([[3, 0, -1], [5, 1, 2], [-1, -1, -1]])
    if uniform:  # 2 tokens for each of 3 sequences; positions a strided column, as in a graph
        positions, seq_ids = torch.tensor([[4, 99], [5, 99], [9, 99], [10, 99], [0, 99], [1, 99]])[:, 0], 2
    else:
        positions, seq_ids = torch.tensor([7, 0, 1, 2, 11, 3]), torch.tensor([0, 1, 1, 1, 1, 2])
    T = positions.shape[0]
    kv = torch.randn(T, r + rope + 8, generator=g).to(x_dtype)[:, :r + rope]  # strided rows
    weight = (1 + 0.1 * torch.randn(r, generator=g)).to(w_dtype)
    want = torch.zeros(6, ps, r + rope, dtype=cache_dtype)
    got = want.clone().to(dev)
    ref.write_latents(kv, weight, 1e-6, want, tables, positions, seq_ids)
    mla.write_latents(kv.to(dev), weight.to(dev), 1e-6, got, tables.to(dev), positions.to(dev),
                      seq_ids if uniform else seq_ids.to(dev))
    assert_ulps(got.cpu(), want)  # the reciprocal square root may differ in its last fp32 bit
    assert torch.equal(got.cpu()[..., r:], want[..., r:])  # kpe copied as is
    last_seq = T - 1  # sequence 2 has no pages: its token went to the last page
    assert torch.equal(want[-1, int(positions[last_seq]) % ps, :r],
                       rms_norm_rounded(kv[last_seq, :r], weight, 1e-6).to(cache_dtype))
    assert int((want.abs().sum(-1) > 0).sum()) == T  # one row per token, nothing else written


def test_write_latents_shapes_are_checked():
    kv, w = torch.zeros(4, 24), torch.ones(16)
    cache, tables = torch.zeros(3, 4, 24), torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="not 3 per sequence"):
        ref.write_latents(kv, w, 1e-6, cache, tables, torch.zeros(4, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="does not match the cache"):
        ref.write_latents(kv, w, 1e-6, cache[..., :20], tables, torch.zeros(4, dtype=torch.long), 2)
