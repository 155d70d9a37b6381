"""Triton kernels for gated attention over paged KV in a decode / verify step (contracts:
hyla.ops.paged_attention).

`qk_norm_rope_write`, grid (T,): one program per new token normalises its query and key heads
(zero-centred RMSNorm, fp32, rounded to the input dtype), rotates them with cos / sin of the
fp32 angles computed in the kernel (no per-step tables), stores the queries and writes the key
and value rows of its page (found from the block table and its position): one launch instead of
two norms, the RoPE tables, the rotation's four element-wise ops, the slot arithmetic and two
index_puts. Every rounding is the torch path's (each product and the sum of the rotation
rounded to the input dtype).

`paged_window_attention`, grid (S, Hkv, splits): one program takes the W queries x G heads of
one sequence and KV head (W * G rows of one tl.dot) over one slice of SPLIT keys of the
sequence, BLOCK_N keys at a time straight from the pages, with an online softmax. The slices
follow the sequence's *actual* length (read on the device): a CUDA graph captured for the
widest table does no work for pages a short sequence lacks, and the split boundaries, hence the
numbers, depend on the length alone (not on the batch, the table width or the split count).
With one slice the program finishes the output itself (divide, round, times sigmoid(gate));
otherwise each writes (max, sum, partial output) and `_combine_kernel` finishes.

FP8 pages (k_scale / v_scale given; hyla.ops.kv_fp8): the write kernel quantises each key head
(after its rounding to the input dtype) and value head with a per-token scale (the torch
writer's codes, hyla.ops.triton.kv_fp8); the attention kernel loads e4m3 rows and their scales and
dequantises them to the queries' dtype in registers before the dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.paged_attention import _check_attend, _check_write, check_scales
from hyla.ops.triton import _interpreter, interpreting
from hyla.ops.triton.kv_fp8 import compute_dtype, quantize_groups
from hyla.ops.triton.norm import _sigmoid, to_dtype
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

SPLIT = 512  # keys per slice of paged_window_attention (a multiple of its BLOCK_N)


@triton.jit
def _norm_rope(x_ptr, rows, hm, c, perm, D, w, w_perm, cos, sin, eps, DT: tl.constexpr):
    """Heads at x_ptr + rows[:, None] + channel: zero-centred RMSNorm rounded to DT, then
    x * cos + x[perm] * sin with each product and the sum rounded to DT -> [BH, BD] fp32."""
    cm = c < D
    m = hm[:, None] & cm[None, :]
    x = tl.load(x_ptr + rows[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    n = to_dtype(x * r * (1.0 + w[None, :]), DT).to(tl.float32)
    xp = tl.load(x_ptr + rows[:, None] + perm[None, :], mask=m, other=0.0).to(tl.float32)
    n_p = to_dtype(xp * r * (1.0 + w_perm[None, :]), DT).to(tl.float32)
    a = to_dtype(n * cos[None, :], DT).to(tl.float32)
    b = to_dtype(n_p * sin[None, :], DT).to(tl.float32)
    return a + b


@triton.jit
def _qk_rope_write_kernel(q, k, v, qw, kw, inv_freq, positions, tables, q_out, cache_k, cache_v, k_scale, v_scale,
                          s_q0, s_q1, s_k0, s_k1, s_v0, s_v1, s_t, s_pos, W, H, HKV, D, HALF, num_pages, eps,
                          PS: tl.constexpr, BH: tl.constexpr, BKV: tl.constexpr, BD: tl.constexpr,
                          DT: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    t = tl.program_id(0).to(tl.int64)
    seq = t // W
    pos = tl.load(positions + t * s_pos)
    page = tl.load(tables + seq * s_t + pos // PS)
    page = tl.where(page < 0, page + num_pages, page)
    row = page * PS + pos % PS
    c = tl.arange(0, BD)
    cm = c < D
    lo = c < HALF
    rot = c < 2 * HALF
    freq = tl.load(inv_freq + tl.where(lo, c, c - HALF), mask=rot, other=0.0)
    ang = pos.to(tl.float32) * freq  # 0 past the rotary channels: cos 1, sin 0
    cos = to_dtype(tl.cos(ang), DT).to(tl.float32)
    s = tl.sin(ang)
    sin = to_dtype(tl.where(lo, -s, s), DT).to(tl.float32)
    perm = tl.where(lo, c + HALF, tl.where(rot, c - HALF, c))
    qwv = tl.load(qw + c, mask=cm, other=0.0).to(tl.float32)
    qwp = tl.load(qw + perm, mask=cm, other=0.0).to(tl.float32)
    h = tl.arange(0, BH)
    hm = h < H
    out = _norm_rope(q + t * s_q0, h * s_q1, hm, c, perm, D, qwv, qwp, cos, sin, eps, DT)
    tl.store(q_out + t * H * D + h[:, None] * D + c[None, :], to_dtype(out, DT), mask=hm[:, None] & cm[None, :])
    kwv = tl.load(kw + c, mask=cm, other=0.0).to(tl.float32)
    kwp = tl.load(kw + perm, mask=cm, other=0.0).to(tl.float32)
    g = tl.arange(0, BKV)
    gm = g < HKV
    m = gm[:, None] & cm[None, :]
    kr = to_dtype(_norm_rope(k + t * s_k0, g * s_k1, gm, c, perm, D, kwv, kwp, cos, sin, eps, DT), DT)
    dst = row * HKV * D + g[:, None] * D + c[None, :]
    vv = tl.load(v + t * s_v0 + g[:, None] * s_v1 + c[None, :], mask=m, other=0.0)
    if FP8:  # each head's row with its own per-token scale
        kq, ks = quantize_groups(kr.to(tl.float32))  # masked lanes hold 0
        vq, vs = quantize_groups(vv.to(tl.float32))
        tl.store(cache_k + dst, kq.to(cache_k.dtype.element_ty), mask=m)
        tl.store(cache_v + dst, vq.to(cache_v.dtype.element_ty), mask=m)
        tl.store(k_scale + row * HKV + g, ks, mask=gm)
        tl.store(v_scale + row * HKV + g, vs, mask=gm)
    else:
        tl.store(cache_k + dst, kr.to(cache_k.dtype.element_ty), mask=m)
        tl.store(cache_v + dst, vv.to(cache_v.dtype.element_ty), mask=m)


def _torch_to_tl(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def qk_norm_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, positions: torch.Tensor,
                       cache_k: torch.Tensor, cache_v: torch.Tensor, block_tables: torch.Tensor,
                       width: int, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of hyla.ops.paged_attention.qk_norm_rope_write (one launch)."""
    _check_write(q, k, v, q_weight, k_weight, inv_freq, positions, cache_k, cache_v, block_tables, width)
    fp8 = check_scales(cache_k, cache_v, k_scale, v_scale)
    T, H, D = q.shape
    Hkv = k.shape[1]
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(T, H, D, device=q.device, dtype=q.dtype)
    if T == 0:
        return out
    BD = triton.next_power_of_2(D)
    BH = triton.next_power_of_2(H)
    _qk_rope_write_kernel[(T,)](
        q, k, v, q_weight.contiguous(), k_weight.contiguous(), inv_freq.float().contiguous(), positions, block_tables,
        out, cache_k, cache_v, k_scale if fp8 else cache_k, v_scale if fp8 else cache_v, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        block_tables.stride(0), positions.stride(0), width, H, Hkv, D, inv_freq.shape[0], cache_k.shape[0],
        float(eps), PS=cache_k.shape[1], BH=BH, BKV=triton.next_power_of_2(Hkv), BD=BD, DT=_torch_to_tl(q.dtype),
        FP8=fp8, num_warps=max(1, min(8, BH * BD // 256)), **pdl_launch(q.device))
    return out


@triton.jit
def _window_kernel(q, cache_k, cache_v, k_scale, v_scale, tables, context_lens, gate, out, m_out, l_out, acc_out,
                   s_q0, s_q1, s_t, s_ctx, s_g0, s_g1, W, H, HKV, G, D, num_pages, scale,
                   PS: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT_N: tl.constexpr, SINGLE: tl.constexpr, HAS_GATE: tl.constexpr, IEEE: tl.constexpr,
                   DT: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, CT: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    s = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(context_lens + s * s_ctx).to(tl.int32)
    length = ctx + W  # keys 0 .. ctx + W - 1
    start = sp * SPLIT_N
    end = tl.minimum(start + SPLIT_N, length)
    r = tl.arange(0, BM)
    wq = r // G
    rm = r < W * G
    head = kh * G + r % G
    qrow = s * W + wq
    c = tl.arange(0, BD)
    cm = c < D
    qv = tl.load(q + qrow[:, None] * s_q0 + head[:, None] * s_q1 + c[None, :], mask=rm[:, None] & cm[None, :],
                 other=0.0).to(CT)
    limit = ctx + wq  # [BM] the last key each query row attends to
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tm = t < end
        page = tl.load(tables + s * s_t + t // PS, mask=tm, other=0)
        page = tl.where(page < 0, page + num_pages, page)
        krow = (page.to(tl.int64) * PS + t % PS) * HKV * D + kh * D
        km = tm[:, None] & cm[None, :]
        kv = tl.load(cache_k + krow[:, None] + c[None, :], mask=km, other=0.0)
        if FP8:  # dequantised to the queries' dtype: q x s in fp32, rounded once
            srow = (page.to(tl.int64) * PS + t % PS) * HKV + kh
            kv = to_dtype(kv.to(tl.float32) * tl.load(k_scale + srow, mask=tm, other=0.0)[:, None], CT)
        if UPCAST:  # the interpreter's low-precision dots are wrong: the same products in fp32
            kv = kv.to(tl.float32)
            qv = qv.to(tl.float32)
        if IEEE:
            sc = tl.dot(qv, tl.trans(kv), input_precision="ieee")
        else:
            sc = tl.dot(qv, tl.trans(kv))
        valid = (t[None, :] <= limit[:, None]) & tm[None, :]
        sc = tl.where(valid, sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vv = tl.load(cache_v + krow[:, None] + c[None, :], mask=km, other=0.0)
        if FP8:
            vv = to_dtype(vv.to(tl.float32) * tl.load(v_scale + srow, mask=tm, other=0.0)[:, None], CT)
        pv = p.to(vv.dtype)
        if UPCAST:
            pv = pv.to(tl.float32)
            vv = vv.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pv, vv, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pv, vv)
        m_i = m_new
    om = rm[:, None] & cm[None, :]
    if SINGLE:
        o = to_dtype(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], DT)
        if HAS_GATE:
            gv = tl.load(gate + qrow[:, None] * s_g0 + head[:, None] * s_g1 + c[None, :], mask=om, other=0.0)
            o = to_dtype(o.to(tl.float32) * to_dtype(_sigmoid(gv.to(tl.float32)), DT).to(tl.float32), DT)
        tl.store(out + qrow[:, None] * H * D + head[:, None] * D + c[None, :], o, mask=om)
    else:
        nsp = tl.num_programs(2)
        base = ((s * HKV + kh) * nsp + sp) * BM + r  # [BM]
        tl.store(m_out + base, m_i)
        tl.store(l_out + base, l_i)
        tl.store(acc_out + base[:, None] * BD + c[None, :], acc)


@triton.jit
def _combine_kernel(m_in, l_in, acc_in, gate, out, s_g0, s_g1, W, H, HKV, G, D, NSP,
                    BM: tl.constexpr, BD: tl.constexpr, HAS_GATE: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    s = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    r = tl.arange(0, BM)
    c = tl.arange(0, BD)
    base = (s * HKV + kh) * NSP * BM + r
    m_all = tl.full((BM,), float("-inf"), tl.float32)
    for sp in range(NSP):
        m_all = tl.maximum(m_all, tl.load(m_in + base + sp * BM))
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    denom = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    for sp in range(NSP):
        f = tl.exp(tl.load(m_in + base + sp * BM) - m_all)  # 0 for a slice with no key (max -inf)
        lv = tl.load(l_in + base + sp * BM)
        denom += lv * f
        a = tl.load(acc_in + (base + sp * BM)[:, None] * BD + c[None, :], mask=(lv > 0)[:, None], other=0.0)
        acc += a * f[:, None]
    wq = r // G
    head = kh * G + r % G
    qrow = s * W + wq
    om = (r < W * G)[:, None] & (c < D)[None, :]
    o = to_dtype(acc / tl.where(denom > 0, denom, 1.0)[:, None], DT)
    if HAS_GATE:
        gv = tl.load(gate + qrow[:, None] * s_g0 + head[:, None] * s_g1 + c[None, :], mask=om, other=0.0)
        o = to_dtype(o.to(tl.float32) * to_dtype(_sigmoid(gv.to(tl.float32)), DT).to(tl.float32), DT)
    tl.store(out + qrow[:, None] * H * D + head[:, None] * D + c[None, :], o, mask=om)


def paged_window_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           gate: torch.Tensor | None = None, block_n: int = 64, split: int = SPLIT,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of hyla.ops.paged_attention.paged_window_attention. Keys are cut into
    slices of `split` (a multiple of block_n) from position 0; as many programs per sequence and
    KV head as the table's width can need (P * page_size / split), those past a sequence's
    length idle. k_scale, v_scale: FP8 pages' scales (hyla.ops.paged_attention)."""
    _check_attend(q, cache_k, cache_v, block_tables, context_lens, gate)
    fp8 = check_scales(cache_k, cache_v, k_scale, v_scale)
    if split % block_n:
        raise ValueError(f"split ({split}) must be a multiple of block_n ({block_n})")
    T, H, D = q.shape
    S, P = block_tables.shape
    _, PS, Hkv, _ = cache_k.shape
    W, G = T // S, H // Hkv
    if q.stride(2) != 1:
        q = q.contiguous()
    if gate is not None and gate.stride(2) != 1:
        gate = gate.contiguous()
    out = torch.empty(T, H * D, device=q.device, dtype=q.dtype)
    if T == 0:
        return out
    BM = max(16, triton.next_power_of_2(W * G))
    BD = max(16, triton.next_power_of_2(D))  # tl.dot needs K >= 16; the columns past D are masked
    nsp = triton.cdiv(P * PS, split)
    dt = _torch_to_tl(q.dtype)
    ct = compute_dtype(cache_k, q)  # the dtype rows are read in (FP8: the queries')
    ieee = bool(ct == tl.float32)
    single = nsp == 1
    if single:
        m = l = acc = out  # unused
    else:
        m = torch.empty(S, Hkv, nsp, BM, device=q.device, dtype=torch.float32)
        l = torch.empty_like(m)
        acc = torch.empty(S, Hkv, nsp, BM, BD, device=q.device, dtype=torch.float32)
    g = gate if gate is not None else out.view(T, H, D)
    _window_kernel[(S, Hkv, nsp)](
        q, cache_k, cache_v, k_scale if fp8 else cache_k, v_scale if fp8 else cache_v, block_tables, context_lens, g,
        out, m, l, acc,
        q.stride(0), q.stride(1), block_tables.stride(0), context_lens.stride(0), g.stride(0), g.stride(1), W, H, Hkv, G, D, cache_k.shape[0],
        float(scale), PS=PS, BM=BM, BD=BD, BLOCK_N=block_n, SPLIT_N=split, SINGLE=single,
        HAS_GATE=gate is not None, IEEE=ieee, DT=dt, UPCAST=interpreting() and ieee is False, FP8=fp8, CT=ct,
        num_warps=4, num_stages=2, **pdl_launch(q.device))
    if not single:
        _combine_kernel[(S, Hkv)](m, l, acc, g, out, g.stride(0), g.stride(1), W, H, Hkv, G, D, nsp, BM=BM, BD=BD,
                                  HAS_GATE=gate is not None, DT=dt, num_warps=4, **pdl_launch(m.device))
    return out
