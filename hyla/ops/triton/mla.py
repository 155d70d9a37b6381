"""Triton kernels for paged MLA (contracts: hyla.ops.mla).

`write_latents`: one program per new token finds its cache row (block table, position),
normalises c, appends kpe and stores the latent: one launch instead of the slot arithmetic,
norm, cat and index_put.

`paged_mla_decode`, split-KV ("flash decoding") in two launches:
1. `_decode_split_kernel`, grid (N, head blocks, splits): BLOCK_H heads of one query token
   stream one slice of the sequence's latents, BLOCK_N tokens at a time (page ids from the
   block table), scores as two dots (q_lat . c and q_pe . kpe, fp32 accumulation), an online
   softmax, and the unnormalised sum of p * c; writes (max, sum, partial output) per split.
   The slices follow the sequence's *actual* length (read on the device): a CUDA graph
   captured for the longest window does no work for pages a short sequence lacks, and the
   numbers do not depend on the batch size or the table width.
2. `_combine_kernel`, grid (query blocks, H): rescales and sums the splits, divides by the
   softmax sum, rounds to the value dtype and multiplies by W_UV of its head (a dot per 128
   latent columns), storing [N, H * v] ready for o_proj. The splits' maxima and sums are read
   as one tile, their partials up to 16 splits a step ([16 queries, splits, latent columns]
   tiles) rather than one split a step: one 48B layer at batch 1 and 128K (64 slices) 0.244 ->
   0.221 ms on an H100 (BENCHMARKS.md "Long contexts: the 48B shape's decode at 128K and a 1M
   prompt").
The latents are read once per head block straight from the pages (no gathered copy). The 48B's
32 heads are two blocks of 16: one block of 32 (8 warps), reading the latents once, ran the split
kernel 1.3-1.5x slower on an H100 (same section).

FP8 latents (kv_scale given; hyla.ops.kv_fp8): the writer rounds each latent to its dtype, then
quantises c and kpe with a scale each (hyla.ops.triton.kv_fp8: the torch writer's codes);
the split kernel loads e4m3 rows and their scales and dequantises them to the queries' dtype
in registers (half the bytes of a bf16 page read; the dots as over a bf16 / fp32 cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.mla import _check_decode, _check_latents, _check_scale
from hyla.ops.triton import _interpreter
from hyla.ops.triton.kv_fp8 import compute_dtype, quantize_groups
from hyla.ops.triton.norm import to_dtype
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

@triton.jit(do_not_specialize=["num_pages"])  # only added to a negative (scratch) page id
def _latents_kernel(kv, s_kv, w, cache, scales, tables, s_t, positions, s_pos, seq_ids, W, num_pages, eps, R, C,
                    PS: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr, HAS_PE: tl.constexpr,
                    MID_BF16: tl.constexpr, UNIFORM: tl.constexpr, FP8: tl.constexpr, G: tl.constexpr,
                    LAT_DT: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    t = tl.program_id(0).to(tl.int64)
    if UNIFORM:
        seq = t // W
    else:
        seq = tl.load(seq_ids + t)
    pos = tl.load(positions + t * s_pos)
    page = tl.load(tables + seq * s_t + pos // PS)
    page = tl.where(page < 0, page + num_pages, page)
    row = page * PS + pos % PS
    o = tl.arange(0, BR)
    m = o < R
    c = tl.load(kv + t * s_kv + o, mask=m, other=0.0)
    cf = c.to(tl.float32)
    n = cf * tl.math.rsqrt(tl.sum(cf * cf, axis=0) / R + eps)
    y = tl.load(w + o, mask=m, other=0.0).to(tl.float32) * to_dtype(n, c.dtype).to(tl.float32)
    if MID_BF16:  # weight * normed is computed in bf16 before the cache's dtype
        y = to_dtype(y, tl.bfloat16).to(tl.float32)
    if FP8:  # the latent in its dtype, then c and kpe quantised with a scale each
        yq, ys = quantize_groups(to_dtype(y, LAT_DT).to(tl.float32)[None, :])  # masked lanes hold 0
        tl.store(cache + row * C + o[None, :], yq.to(cache.dtype.element_ty), mask=m[None, :])
        tl.store(scales + row * G + tl.arange(0, 1), ys)
    else:
        tl.store(cache + row * C + o, to_dtype(y, cache.dtype.element_ty), mask=m)
    if HAS_PE:
        op = tl.arange(0, BP)
        mp = op < C - R
        pe = tl.load(kv + t * s_kv + R + op, mask=mp, other=0.0)
        if FP8:
            pq, p_s = quantize_groups(to_dtype(pe.to(tl.float32), LAT_DT).to(tl.float32)[None, :])
            tl.store(cache + row * C + R + op[None, :], pq.to(cache.dtype.element_ty), mask=mp[None, :])
            tl.store(scales + row * G + 1 + tl.arange(0, 1), p_s)
        else:
            tl.store(cache + row * C + R + op, pe.to(cache.dtype.element_ty), mask=mp)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def write_latents(kv: torch.Tensor, weight: torch.Tensor, eps: float, cache: torch.Tensor,
                  block_tables: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor | int,
                  kv_scale: torch.Tensor | None = None) -> None:
    """The Triton version of hyla.ops.mla.write_latents (the cache row of each token found in
    the kernel: no slot tensor is built)."""
    r = _check_latents(kv, weight, cache, block_tables, positions, seq_ids)
    groups = _check_scale(cache, kv_scale, r)
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    T, C = kv.shape
    if T == 0:
        return
    uniform = isinstance(seq_ids, int)
    lat_dtype = torch.promote_types(weight.dtype, kv.dtype)
    mid_bf16 = lat_dtype == torch.bfloat16 and cache.dtype != torch.bfloat16
    fp8 = groups is not None
    _latents_kernel[(T,)](kv, kv.stride(0), weight.contiguous(), cache, kv_scale if fp8 else cache, block_tables,
                          block_tables.stride(0), positions, positions.stride(0), positions if uniform else seq_ids,
                          seq_ids if uniform else 1, cache.shape[0],
                          float(eps), r, C, PS=cache.shape[1], BR=triton.next_power_of_2(r),
                          BP=max(16, triton.next_power_of_2(C - r)), HAS_PE=C > r, MID_BF16=mid_bf16,
                          UNIFORM=uniform, FP8=fp8, G=len(groups) if fp8 else 1,
                          LAT_DT=_TL[lat_dtype] if fp8 else tl.float32, num_warps=4, **pdl_launch(kv.device))


@triton.jit
def _decode_split_kernel(q_lat, q_pe, cache, scales, tables, last, m_out, l_out, acc_out,
                         s_qn, s_qh, s_pn, s_ph, s_t, s_last, P, H, R, ROPE, W, scale,
                         PS: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr,
                         HAS_PE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, MIN_SPLITS: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
                         MIN_SPLIT: tl.constexpr, IEEE: tl.constexpr,
                         FP8: tl.constexpr, G: tl.constexpr, CT: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    n = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    seq = n // W
    length = tl.minimum(tl.load(last + n * s_last) + 1, P * PS)
    # the sequence's own cut, from its length alone: NUM_SPLITS (the grid) holds every length the table can
    splits = tl.minimum(tl.maximum(tl.cdiv(length, SPLIT_TOKENS), MIN_SPLITS), NUM_SPLITS)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)
    start = sp * per_split
    end = tl.minimum(start + per_split, length)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    o_r = tl.arange(0, BR)
    q1 = tl.load(q_lat + n * s_qn + h[:, None] * s_qh + o_r[None, :], mask=hm[:, None] & (o_r[None, :] < R),
                 other=0.0).to(CT)
    if HAS_PE:
        o_p = tl.arange(0, BP)
        q2 = tl.load(q_pe + n * s_pn + h[:, None] * s_ph + o_p[None, :], mask=hm[:, None] & (o_p[None, :] < ROPE),
                     other=0.0).to(CT)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BR), tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tm = t < end
        page = tl.maximum(tl.load(tables + seq * s_t + t // PS, mask=tm, other=0), 0)
        row = page.to(tl.int64) * PS + t % PS
        c = tl.load(cache + row[:, None] * C + o_r[None, :], mask=tm[:, None] & (o_r[None, :] < R), other=0.0)
        if FP8:  # dequantised to the queries' dtype: q x s in fp32, rounded once
            c = to_dtype(c.to(tl.float32) * tl.load(scales + row * G, mask=tm, other=0.0)[:, None], CT)
        if IEEE:
            s = tl.dot(q1, tl.trans(c), input_precision="ieee")
        else:
            s = tl.dot(q1, tl.trans(c))
        if HAS_PE:
            pe = tl.load(cache + row[:, None] * C + R + o_p[None, :], mask=tm[:, None] & (o_p[None, :] < ROPE),
                         other=0.0)
            if FP8:
                pe = to_dtype(pe.to(tl.float32) * tl.load(scales + row * G + 1, mask=tm, other=0.0)[:, None], CT)
            if IEEE:
                s += tl.dot(q2, tl.trans(pe), input_precision="ieee")
            else:
                s += tl.dot(q2, tl.trans(pe))
        s = tl.where(tm[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new
    base = (n * H + h) * NUM_SPLITS + sp  # [BLOCK_H]
    tl.store(m_out + base, m_i, mask=hm)
    tl.store(l_out + base, l_i, mask=hm)
    if start < end:  # an empty split leaves its partial unwritten: the combine does not read it
        tl.store(acc_out + base[:, None] * BR + o_r[None, :], acc, mask=hm[:, None])


@triton.jit
def _combine_kernel(m_in, l_in, acc_in, w_uv, out, N, H, V, R, s_wh, s_wv,
                    BR: tl.constexpr, BV: tl.constexpr, RC: tl.constexpr, BQ: tl.constexpr, SB: tl.constexpr,
                    SP: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    nb = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    n = (nb * BQ + tl.arange(0, BQ)).to(tl.int64)
    nm = n < N
    base = (n * H + h) * NUM_SPLITS  # [BQ]
    o_s = tl.arange(0, SP)
    sm = nm[:, None] & (o_s[None, :] < NUM_SPLITS)
    m_t = tl.load(m_in + base[:, None] + o_s[None, :], mask=sm, other=float("-inf"))
    m_all = tl.max(m_t, axis=1)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # a query with nothing to attend to: zeros
    l_t = tl.load(l_in + base[:, None] + o_s[None, :], mask=sm, other=0.0)
    denom = tl.sum(l_t * tl.exp(m_t - m_all[:, None]), axis=1)
    denom = tl.where(denom > 0, denom, 1.0)
    o_v = tl.arange(0, BV)
    res = tl.zeros((BQ, BV), tl.float32)
    for r0 in range(0, BR, RC):
        o_r = r0 + tl.arange(0, RC)
        part = tl.zeros((BQ, RC), tl.float32)
        for s0 in range(0, NUM_SPLITS, SB):
            idx = base[:, None] + s0 + tl.arange(0, SB)[None, :]  # [BQ, SB]
            bm = nm[:, None] & (s0 + tl.arange(0, SB)[None, :] < NUM_SPLITS)
            f = tl.exp(tl.load(m_in + idx, mask=bm, other=float("-inf")) - m_all[:, None])
            used = bm & (tl.load(l_in + idx, mask=bm, other=0.0) > 0)  # an empty split's partial is unwritten
            a = tl.load(acc_in + idx[:, :, None] * BR + o_r[None, None, :], mask=used[:, :, None], other=0.0)
            part += tl.sum(a * f[:, :, None], axis=1)
        part = to_dtype(part / denom[:, None], w_uv.dtype.element_ty)  # o_lat in the value dtype
        wt = tl.load(w_uv + h * s_wh + o_v[None, :] * s_wv + o_r[:, None], mask=(o_v[None, :] < V) & (o_r[:, None] < R),
                     other=0.0)  # [RC, BV]
        if IEEE:
            res += tl.dot(part, wt, input_precision="ieee")
        else:
            res += tl.dot(part, wt)
    tl.store(out + n[:, None] * (H * V) + h * V + o_v[None, :], to_dtype(res, out.dtype.element_ty),
             mask=nm[:, None] & (o_v[None, :] < V))


def paged_mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     last: torch.Tensor, w_uv: torch.Tensor, scale: float, block_h: int = 16,
                     block_n: int = 32, min_splits: int = 4, split_tokens: int = 2048, max_splits: int = 128,
                     min_split: int = 128, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of hyla.ops.mla.paged_mla_decode. block_h / block_n: tile sizes.

    A sequence of L tokens is cut into s(L) = clamp(ceil(L / split_tokens), min_splits, max_splits)
    slices of max(min_split, L / s(L)) tokens (rounded up to block_n), each its own program, then
    combined. The cut depends on L alone, not on the batch size or the table width, so a CUDA-graph
    replay (padded batch, every table column) gives the eager step's numbers bit for bit. Short
    contexts keep min_splits slices; long ones get one slice per split_tokens, so that a single
    sequence at 128K still spreads over the SMs (4 slices read one layer's latents at batch 1 and
    128K in 2.37 ms, 2,048-token slices in 0.24 ms), and up to 128 of them at 1M (64 of 16K tokens:
    1.28 ms at batch 1, 128: 0.86 ms, batch 16 3% slower: BENCHMARKS.md "Long contexts: the 48B
    shape's decode at 128K and a 1M prompt"). More, shorter slices at 2K-16K sped batch 1 up to
    2x there but slowed batch 16-64 by up to 40%: the cut cannot follow the batch size. The grid
    and the partials' buffers [N, H, splits, R] hold the most slices a length in the table can
    need. kv_scale: FP8 latents' scales (hyla.ops.mla)."""
    _check_decode(q_lat, q_pe, cache, block_tables, last, w_uv)
    groups = _check_scale(cache, kv_scale, q_lat.shape[2])
    N, H, R = q_lat.shape
    ROPE = q_pe.shape[2]
    _, PS, C = cache.shape
    S, P = block_tables.shape
    V = w_uv.shape[1]
    if w_uv.stride(2) != 1:
        w_uv = w_uv.contiguous()
    if q_lat.stride(2) != 1:
        q_lat = q_lat.contiguous()
    if ROPE and q_pe.stride(2) != 1:
        q_pe = q_pe.contiguous()
    block_h = max(16, min(block_h, triton.next_power_of_2(H)))
    hb = triton.cdiv(H, block_h)
    BR = triton.next_power_of_2(R)
    dev = q_lat.device
    if not 1 <= min_splits <= max_splits or split_tokens < 1:
        raise ValueError(f"split counts need 1 <= min_splits ({min_splits}) <= max_splits ({max_splits}) "
                         f"and split_tokens >= 1 ({split_tokens})")
    num_splits = min(max(triton.cdiv(P * PS, split_tokens), min_splits), max_splits)
    m = torch.empty(N, H, num_splits, device=dev, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(N, H, num_splits, BR, device=dev, dtype=torch.float32)
    ct = compute_dtype(cache, q_lat)  # the dtype rows are read in (FP8: the queries')
    ieee = bool(ct == tl.float32)
    fp8 = groups is not None
    _decode_split_kernel[(N, hb, num_splits)](
        q_lat, q_pe, cache, kv_scale if fp8 else cache, block_tables, last, m, l, acc,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), block_tables.stride(0), last.stride(0), P, H, R, ROPE,
        N // S, float(scale), PS=PS, C=C, BR=BR, BP=max(16, triton.next_power_of_2(ROPE)), HAS_PE=ROPE > 0,
        BLOCK_H=block_h, BLOCK_N=block_n, NUM_SPLITS=num_splits, MIN_SPLITS=min_splits, SPLIT_TOKENS=split_tokens,
        MIN_SPLIT=max(min_split, block_n), IEEE=ieee,
        FP8=fp8, G=len(groups) if fp8 else 1, CT=ct, num_warps=4, num_stages=2, **pdl_launch(q_lat.device))
    out = torch.empty(N, H * V, device=dev, dtype=q_lat.dtype)
    BQ = 16
    sp = triton.next_power_of_2(num_splits)
    sb = min(sp, 16)  # splits a step of the combine reads: [BQ, sb, RC] fp32 tiles of at most 8,192 values
    _combine_kernel[(triton.cdiv(N, BQ), H)](
        m, l, acc, w_uv, out, N, H, V, R, w_uv.stride(0), w_uv.stride(1), BR=BR,
        BV=max(16, triton.next_power_of_2(V)), RC=min(BR, 128, 512 // sb), BQ=BQ, SB=sb, SP=sp, NUM_SPLITS=num_splits,
        IEEE=ieee, num_warps=4, **pdl_launch(m.device))
    return out
