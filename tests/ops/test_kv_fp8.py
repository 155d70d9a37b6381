"""FP8 (e4m3) KV pages (hyla.ops.kv_fp8): the row format, the paged MLA and gated-attention ops
over FP8 pages on the torch path, and their Triton kernels (TRITON_INTERPRET=1 on the CPU) at
small awkward shapes.

Bounds. A stored value's rounding error is at most 2^-4 of its magnitude (e4m3: 3 mantissa
bits, half an ulp), or 2^-10 x its row's scale below e4m3's normal range (subnormal step 2^-9).
For attention over FP8 pages against the same attention over the exact (fp32) rows, with every
score moved by at most D = scale x max |q . dk| (dk the keys' rounding errors, measured) and
every value by at most max |dv|: the softmax weights move by at most e^(2D) - 1 in l1, so the
output moves by at most max |dv| + (e^(2D) - 1) max |v| (MLA: times the largest row sum of |W_UV|,
the latents being both keys and values). The tests measure the error and check it against that
bound computed from the data, plus fp32 rounding slack.
"""

from __future__ import annotations

import math

import pytest
import torch

from hyla.ops import kv_fp8
from hyla.ops import mla as ref_mla
from hyla.ops import paged_attention as ref_attn
from hyla.ops.fp8 import per_token_group_quant
from tests.ops.paged_tables import random_block_tables
from tests.ops.triton_env import triton_module

E4M3_REL = 2.0 ** -4  # half an ulp of a 3-bit mantissa, relative
E4M3_SUB = 2.0 ** -10  # half the subnormal step 2^-9, times the row's scale


def _rounding_ok(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, groups) -> bool:
    """|dequant - x| <= 2^-4 |x| + 2^-10 s for every element (s: its group's scale)."""
    back = kv_fp8.dequantize_rows(q, s, groups, torch.float64)
    scale = torch.cat([s[..., i:i + 1].double().expand(*s.shape[:-1], n) for i, n in enumerate(groups)], -1)
    return bool(((back - x.double()).abs() <= E4M3_REL * x.double().abs() + E4M3_SUB * scale + 1e-30).all())


def test_rows_quantise_per_group_with_per_token_group_quant_and_round_trip_within_half_an_ulp():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 40, generator=g) * torch.logspace(-6, 4, 5)[:, None, None]
    x[1, 2] = 0  # an all-zero row: scale floor, zeros back
    x[2, 0, 33:] *= 1000  # the second group of a row with its own magnitude
    for groups in ((40,), (33, 7)):
        q, s = kv_fp8.quantize_rows(x, groups)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (5, 3, len(groups))
        assert _rounding_ok(x, q, s, groups)
        assert torch.equal(kv_fp8.dequantize_rows(q, s, groups, torch.float32)[1, 2], torch.zeros(40))
        cols = 0
        for i, n in enumerate(groups):  # each group is hyla.ops.fp8's activation quantiser, bit for bit
            rq, rs = per_token_group_quant(x[..., cols:cols + n].reshape(-1, n), n)
            assert torch.equal(q[..., cols:cols + n].reshape(-1, n).view(torch.uint8), rq.view(torch.uint8))
            assert torch.equal(s[..., i].reshape(-1), rs[:, 0])
            cols += n
    # a k_pe group 1000x larger than c: with its own scale every c value down to 1/64 of c's
    # largest keeps e4m3's relative precision; under one shared scale they fall to subnormals
    row = x[2, 0].double()
    keep = row[:33].abs() >= row[:33].abs().max() / 64
    rel = {}
    for groups in ((40,), (33, 7)):
        q, s = kv_fp8.quantize_rows(x[2, 0], groups)
        back = kv_fp8.dequantize_rows(q, s, groups, torch.float64)
        rel[groups] = ((back - row).abs() / row.abs())[:33][keep].max().item()
    assert rel[(33, 7)] <= E4M3_REL < rel[(40,)]


@pytest.mark.parametrize("value", ["fp8_e5m2", "fp8_inc", "FP8", "bfloat16", None, 8])
def test_bad_kv_cache_dtype_names_the_field_and_the_values(value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\]"):
        kv_fp8.check_kv_cache_dtype(value)


# -- MLA --------------------------------------------------------------------------------------------


def _mla_case(S, W, H, r, rope, v, ps, lens, seed=0):
    """Projections of every token (written through write_latents), queries of the last W tokens
    of each sequence, W_UV and block tables."""
    g = torch.Generator().manual_seed(seed)
    tables, num_pages = random_block_tables(lens, ps, g)
    seq_ids = torch.tensor([s for s, n in enumerate(lens) for _ in range(n)])
    positions = torch.tensor([p for n in lens for p in range(n)])
    kv = torch.randn(len(positions), r + rope, generator=g)
    kv[:, r:] *= 4.0  # k_pe of another magnitude than the normalised c
    weight = 1 + 0.3 * torch.randn(r, generator=g)
    q_lat = torch.randn(S * W, H, r, generator=g) * 0.3
    q_pe = torch.randn(S * W, H, rope, generator=g) * 0.3
    w_uv = torch.randn(H, v, r, generator=g) / r ** 0.5
    last = torch.tensor([n - W + i for n in lens for i in range(W)])
    return dict(kv=kv, weight=weight, tables=tables, num_pages=num_pages, positions=positions, seq_ids=seq_ids,
                q_lat=q_lat, q_pe=q_pe, w_uv=w_uv, last=last, ps=ps, r=r)


def _mla_pages(ops, c, fp8: bool, dev="cpu"):
    """The pool written by ops.write_latents: (cache, kv_scale or None)."""
    C = c["kv"].shape[1]
    if fp8:
        cache, scale = kv_fp8.paged_pair((c["num_pages"], c["ps"], C), kv_fp8.latent_groups(c["r"], C - c["r"]), dev)
    else:
        cache, scale = torch.zeros(c["num_pages"], c["ps"], C, device=dev), None
    ops.write_latents(c["kv"].to(dev), c["weight"].to(dev), 1e-6, cache, c["tables"].to(dev), c["positions"].to(dev),
                      c["seq_ids"].to(dev), kv_scale=scale)
    return cache, scale


def _mla_decode(ops, c, cache, scale, dev="cpu", **kw):
    args = (c["q_lat"], c["q_pe"], cache, c["tables"], c["last"], c["w_uv"])
    return ops.paged_mla_decode(*(a.to(dev) for a in args), 0.3, kv_scale=scale, **kw)


MLA_CASES = [  # S, W, H, r, rope, v, page_size, lengths
    (2, 1, 3, 40, 12, 24, 4, [13, 6]),
    (2, 2, 5, 24, 0, 16, 8, [19, 4]),  # NoPE: one scale per token
]


@pytest.mark.parametrize("case", MLA_CASES)
def test_mla_fp8_pages_round_trip_within_the_e4m3_bound(case):
    c = _mla_case(*case)
    exact, _ = _mla_pages(ref_mla, c, fp8=False)
    pages, scale = _mla_pages(ref_mla, c, fp8=True)
    r, C = c["r"], exact.shape[2]
    groups = kv_fp8.latent_groups(r, C - r)
    assert scale.shape == (*pages.shape[:2], len(groups))
    written = exact.abs().sum(-1) > 0  # rows no token wrote stay zero in both pools
    assert _rounding_ok(exact[written], pages[written], scale[written], groups)
    # the decode reads exactly the dequantised rows: the op over fp32 pages holding them, bit for bit
    deq = kv_fp8.dequantize_rows(pages, scale, groups, torch.float32)
    got = _mla_decode(ref_mla, c, pages, scale)
    assert torch.equal(got, _mla_decode(ref_mla, c, deq, None))
    # against the exact latents: within the bound of the module docstring
    want = _mla_decode(ref_mla, c, exact, None)
    d = (deq - exact).double()
    q = torch.cat([c["q_lat"], c["q_pe"]], -1).double()  # [N, H, C]
    delta = 0.3 * torch.einsum("nhc,pc->nhp", q, d.flatten(0, 1)).abs().max().item()
    wsum = c["w_uv"].double().abs().sum(-1).max().item()
    bound = wsum * (d[..., :r].abs().max().item() + math.expm1(2 * delta) * exact[..., :r].abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= bound + 1e-5 * want.abs().max().item(), (err, bound)
    assert err / want.abs().max().item() < 0.05  # measured: 3.9%, 2.7% of the output's scale (bound: 130x, 64x)


@pytest.mark.parametrize("case", MLA_CASES)
def test_mla_triton_fp8_write_and_decode_match_the_torch_path(case):
    """Interpreter: the latents kernel writes the torch writer's rows: kpe codes (up to the sign
    of zero) and scales bit for bit; c's scale to its last fp32 bits (the norm's reciprocal
    square root may differ in its last bit, hyla.ops.triton.mla), hence a c value at most one
    e4m3 step off, and rarely. The decode kernels read pages as the torch path does (fp32: to
    rounding, 1e-5 relative)."""
    mla, dev = triton_module("mla")
    c = _mla_case(*case, seed=2)
    pages, scale = _mla_pages(ref_mla, c, fp8=True)
    tp, ts = _mla_pages(mla, c, fp8=True, dev=dev)
    tp, ts = tp.cpu(), ts.cpu()
    r = c["r"]
    assert torch.equal(tp[..., r:].float(), pages[..., r:].float())  # (up to the sign of zero)
    assert torch.equal(ts[..., 1:], scale[..., 1:])
    torch.testing.assert_close(ts[..., 0], scale[..., 0], rtol=4e-6, atol=0)
    a, b = tp[..., :r].double(), pages[..., :r].double()
    assert ((a - b).abs() <= 2 ** -3 * b.abs()).all() and (a != b).float().mean() < 0.01
    want = _mla_decode(ref_mla, c, pages, scale)
    got = _mla_decode(mla, c, pages.to(dev), scale.to(dev), dev, block_n=16, min_splits=3, max_splits=3, min_split=16).cpu()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_mla_fp8_scales_are_checked():
    c = _mla_case(*MLA_CASES[0])
    pages, scale = _mla_pages(ref_mla, c, fp8=True)
    with pytest.raises(ValueError, match="FP8 latents need their kv_scale"):
        _mla_decode(ref_mla, c, pages, None)
    with pytest.raises(ValueError, match="carry 2 scales per token"):
        _mla_decode(ref_mla, c, pages, scale[..., :1].contiguous())


# -- gated attention (GQA) ------------------------------------------------------------------------


def _gqa_case(S, W, H, Hkv, D, rot, ps, lens, seed=0):
    """Every token's q, k, v (the last W of each sequence query), norm weights, RoPE frequencies."""
    g = torch.Generator().manual_seed(seed)
    tables, num_pages = random_block_tables(lens, ps, g)
    T = sum(lens)
    q, k = (torch.randn(T, h, D, generator=g) for h in (H, Hkv))
    v = torch.randn(T, Hkv, D, generator=g) * torch.tensor([1.0, 30.0] * (Hkv // 2) + [1.0] * (Hkv % 2))[:, None]
    qw, kw = (torch.randn(D, generator=g) * 0.2 for _ in range(2))
    inv = 1.0 / (100.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    gate = torch.randn(S * W, H, D, generator=g)
    return dict(q=q, k=k, v=v, qw=qw, kw=kw, inv=inv, tables=tables, num_pages=num_pages, lens=lens, W=W, ps=ps,
                gate=gate)


def _gqa_write(ops, c, fp8: bool, dev="cpu"):
    """Every token written in one call of max(lens) tokens per sequence (a shorter sequence
    rewrites its last token) -> (queries of the last W tokens [S * W, H, D], pools k, v, scales
    or None)."""
    _, Hkv, D = c["k"].shape
    shape = (c["num_pages"], c["ps"], Hkv, D)
    if fp8:
        (ck, ks), (cv, vs) = (kv_fp8.paged_pair(shape, (D,), dev) for _ in range(2))
    else:
        (ck, cv), ks, vs = (torch.zeros(shape, device=dev) for _ in range(2)), None, None
    starts = [sum(c["lens"][:s]) for s in range(len(c["lens"]))]
    L = max(c["lens"])
    pos = torch.tensor([min(p, n - 1) for n in c["lens"] for p in range(L)])
    rows = torch.tensor([st for st in starts for _ in range(L)]) + pos
    kw = {} if not fp8 else {"k_scale": ks, "v_scale": vs}
    out = ops.qk_norm_rope_write(c["q"][rows].to(dev), c["k"][rows].to(dev), c["v"][rows].to(dev), c["qw"].to(dev),
                                 c["kw"].to(dev), 1e-6, c["inv"].to(dev), pos.to(dev), ck, cv, c["tables"].to(dev), L,
                                 **kw).cpu()
    W = c["W"]
    q = torch.stack([out[s * L + n - W + i] for s, n in enumerate(c["lens"]) for i in range(W)])
    return q, ck, cv, ks, vs


def _gqa_attend(ops, c, q, ck, cv, ks, vs, dev="cpu", **kw):
    ctx = torch.tensor([n - c["W"] for n in c["lens"]])
    extra = {} if ks is None else {"k_scale": ks, "v_scale": vs}
    return ops.paged_window_attention(q.to(dev), ck, cv, c["tables"].to(dev), ctx.to(dev), q.shape[2] ** -0.5,
                                      c["gate"].to(dev), **extra, **kw).cpu()


GQA_CASES = [  # S, W, H, Hkv, D, rotary dim, page size, lengths
    (2, 2, 6, 2, 40, 12, 8, [21, 5]),
    (2, 1, 3, 3, 24, 24, 4, [9, 14]),
]


@pytest.mark.parametrize("case", GQA_CASES)
def test_gqa_fp8_pages_round_trip_within_the_e4m3_bound(case):
    c = _gqa_case(*case)
    q, ek, ev, _, _ = _gqa_write(ref_attn, c, fp8=False)
    q8, pk, pv, ks, vs = _gqa_write(ref_attn, c, fp8=True)
    assert torch.equal(q, q8)  # the queries do not depend on the pools
    D = ek.shape[-1]
    written = ek.abs().sum(-1) > 0
    assert _rounding_ok(ek[written], pk[written], ks[written], (D,))
    assert _rounding_ok(ev[written], pv[written], vs[written], (D,))
    dk, dv = (kv_fp8.dequantize_rows(t, s, (D,), torch.float32) for t, s in ((pk, ks), (pv, vs)))
    got = _gqa_attend(ref_attn, c, q8, pk, pv, ks, vs)
    assert torch.equal(got, _gqa_attend(ref_attn, c, q, dk, dv, None, None))
    want = _gqa_attend(ref_attn, c, q, ek, ev, None, None)
    # the bound, before the gate (|sigmoid| <= 1 only shrinks it)
    H, Hkv = q.shape[1], ek.shape[2]
    err_k = (dk - ek).double().flatten(0, 1)  # [rows, Hkv, D]
    qg = q.double().view(q.shape[0], Hkv, H // Hkv, D)
    delta = D ** -0.5 * torch.einsum("nkgd,pkd->nkgp", qg, err_k).abs().max().item()
    bound = (dv - ev).abs().max().item() + math.expm1(2 * delta) * ev.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= bound + 1e-5 * ev.abs().max().item(), (err, bound)
    assert err / want.abs().max().item() < 0.05  # measured: 2.3%, 3.9% of the output's scale (bound: 29x, 22x)


@pytest.mark.parametrize("case,dtype", [(GQA_CASES[0], torch.float32), (GQA_CASES[1], torch.bfloat16)])
def test_gqa_triton_fp8_write_and_attention_match_the_torch_path(case, dtype):
    """Interpreter: the write kernel stores the torch writer's rows (codes up to the sign of
    zero, as hyla.ops.triton.fp8_gemm's quantiser): values bit for bit; keys
    (normed and rotated, rounded to the input dtype, then quantised) bit for bit in bf16, where
    every rounding is the torch path's; in fp32 the in-kernel cos / sin may move a key's last
    bits (hyla.ops.triton.paged_attention), hence its scale by an ulp and rarely a value by one
    e4m3 step. The attention kernel dequantises to the queries' dtype as the torch path does
    (fp32: 2e-6 of the scale; bf16: one bf16 step)."""
    tk, dev = triton_module("paged_attention")
    c = _gqa_case(*case, seed=5)
    c = {k: v.to(dtype) if isinstance(v, torch.Tensor) and k in ("q", "k", "v", "gate") else v for k, v in c.items()}
    q, pk, pv, ks, vs = _gqa_write(ref_attn, c, fp8=True)
    tq, tpk, tpv, tks, tvs = (t.cpu() for t in _gqa_write(tk, c, fp8=True, dev=dev))
    assert torch.equal(tpv.float(), pv.float()) and torch.equal(tvs, vs)  # (up to the sign of zero)
    if dtype == torch.bfloat16:
        assert torch.equal(tq, q) and torch.equal(tks, ks)
        assert torch.equal(tpk.float(), pk.float())
    else:
        torch.testing.assert_close(tq, q, rtol=0, atol=2e-6 * float(q.abs().max()))
        torch.testing.assert_close(tks, ks, rtol=4e-6, atol=0)
        a, b = tpk.double(), pk.double()
        assert ((a - b).abs() <= 2 ** -3 * b.abs()).all() and (a != b).float().mean() < 0.01
    want = _gqa_attend(ref_attn, c, q, pk, pv, ks, vs)
    for kw in ({"block_n": 16, "split": 32}, {}):  # several key slices (the combine kernel), then one
        got = _gqa_attend(tk, c, q, *(t.to(dev) for t in (pk, pv, ks, vs)), dev, **kw)
        tol = (2e-6 if dtype == torch.float32 else 2 ** -6) * float(want.float().abs().max())
        assert (got.float() - want.float()).abs().max() <= tol


def test_gqa_fp8_scales_are_checked():
    c = _gqa_case(*GQA_CASES[1])
    q, pk, pv, ks, vs = _gqa_write(ref_attn, c, fp8=True)
    with pytest.raises(ValueError, match="FP8 pools need float32 k_scale and v_scale"):
        _gqa_attend(ref_attn, c, q, pk, pv, None, None)
    with pytest.raises(ValueError, match="FP8 pools need float32 k_scale and v_scale"):
        _gqa_attend(ref_attn, c, q, pk, pv, ks[..., 0], vs[..., 0])


# -- the layers' engine step over FP8 pages: the Triton path (interpreter) against the torch path ---


def _fp8_pool(shape, groups, g, dev):
    """FP8 pages holding random rows (quantised) and their scales."""
    q, s = kv_fp8.quantize_rows(torch.randn(*shape, generator=g), groups)
    return q.to(dev), s.to(dev)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_layer_step_over_fp8_pages_triton_equals_torch(kind, monkeypatch):
    """A verify-shaped step (W = 2 tokens per sequence, shuffled pages) of GatedAttention / MLA
    with FP8 pages, HYLA_BACKEND=triton (the fused writes and paged kernels with their scales:
    hyla.ops.dispatch) against torch: the outputs agree to fp32
    rounding, the pages the step wrote too, up to a rare code one e4m3 step apart where a key's
    last fp32 bit moved its rounding (test_gqa_triton_fp8_write_and_attention_match_the_torch_path;
    none here)."""
    _, dev = triton_module("paged_attention")
    from hyla.contract import ForwardBatch, KVLayerCache, MLALayerCache
    from hyla.layers import GatedAttention
    from hyla.layers.mla import MLAAttention
    from tests.ops.helpers import use_backend

    torch.manual_seed(0)
    if kind == "gqa":
        layer = GatedAttention(40, 6, 2, 16, partial_rotary_factor=0.5, rope_theta=50.0)
    else:
        layer = MLAAttention(40, 3, 24, 16, 8, 16)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    layer = layer.to(dev)
    layer.prepare_for_inference()
    W, ctx, tables = 2, [13, 4], [[5, 2, 9, 11], [3, 7]]
    x = torch.randn(2 * W, 40).to(dev)
    outs, pools = [], []
    for backend in ("torch", "triton"):
        use_backend(monkeypatch, backend)
        g = torch.Generator().manual_seed(1)
        if kind == "gqa":
            (k, ks), (v, vs) = (_fp8_pool((13, 4, 2, 16), (16,), g, dev) for _ in range(2))
            cache = KVLayerCache(k, v, k_scale=ks, v_scale=vs)
        else:
            kv, s = _fp8_pool((13, 4, 32), (24, 8), g, dev)
            cache = MLALayerCache(kv, kv_scale=s)
        batch = ForwardBatch.build([W] * 2, ctx, tables, torch.tensor([[0, 1], [2, 3]]), num_accepted_tokens=[1, 1],
                                   device=dev)
        with torch.no_grad():
            outs.append(layer.forward_batch(x, batch, cache).cpu())
        pools.append([t.cpu().float() for t in cache.tensors()])
    assert (outs[0] - outs[1]).abs().max() <= 1e-5 * outs[0].abs().max()  # measured: 2e-7 (gqa), 3e-7 (mla)
    for a, b in zip(*pools):
        assert ((a - b).abs() <= 2 ** -3 * b.abs() + 1e-6).all() and (a != b).float().mean() < 0.01
