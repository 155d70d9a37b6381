"""Gated full attention of an engine step over paged KV (Qwen3-Next / Qwen3.5), torch reference.

Two ops cover a decode or verify step, where every sequence brings the same number W of new
tokens (W = 1 for decode, 1 + k for a speculative verify):

- `qk_norm_rope_write`: each new token's query and key heads through the zero-centred RMSNorm
  and partial rotate-half RoPE, its key and value written to their rows of the paged pool; the
  query comes back.
- `paged_window_attention`: every query over its sequence's pages (positions 0 .. its own),
  softmax in fp32, the output times sigmoid(gate) when a gate is given.

hyla.ops.dispatch sends CUDA calls to hyla.ops.triton.paged_attention (one launch for the first
op instead of the norms, RoPE tables, rotation, slot arithmetic and two index_puts; one or two
for the second instead of the gather, two einsums, the masks and softmax and the gate). These
are the contracts; the roundings follow hyla.layers.attention (RoPE in the input dtype, cos and
sin from fp32 angles, as transformers computes them).

Pool layout: keys and values [num_pages, page_size, Hkv, D] each. Token t of the step belongs to
sequence t // W and sits at positions[t]; its row is
block_tables[seq, pos // page_size] * page_size + pos % page_size, where a page id -1 counts from
the end (the CUDA-graph runners' scratch page, which their padding rows write).

FP8 pages (kv_cache_dtype "fp8", hyla.ops.kv_fp8): both ops take `k_scale` and `v_scale`, one
fp32 scale per token and KV head, [pages, page_size, Hkv, 1]. The writer quantises each key head
(normed, rotated and rounded to q's dtype, as above) and value head with its own per-token
scale; the reader dequantises the rows it gathers to q's dtype, which then stands for the pool's
dtype below.
"""

from __future__ import annotations

import torch

from hyla.ops import kv_fp8
from hyla.ops.norm import rms_norm_zero_centred
from hyla.ops.utils import work_dtype

__all__ = ["qk_norm_rope_write", "paged_window_attention", "rope_tables"]


def rope_tables(inv_freq: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """inv_freq [rotary_dim / 2] fp32 -> (per-channel frequency [D] fp32, 0 past rotary_dim; the
    sign of each channel's sin [D] (-1 on the first half: rotate-half's -x2); the channel each
    pairs with [D] int64 (the two halves swapped, the rest itself))."""
    half = inv_freq.shape[0]
    rest = head_dim - 2 * half
    dev = inv_freq.device
    freq = torch.cat([inv_freq, inv_freq, inv_freq.new_zeros(rest)])
    sign = torch.cat([-torch.ones(half, device=dev), torch.ones(half + rest, device=dev)])
    perm = torch.cat([torch.arange(half, 2 * half, device=dev), torch.arange(half, device=dev),
                      torch.arange(2 * half, head_dim, device=dev)])
    return freq, sign, perm


def _check_write(q, k, v, q_weight, k_weight, inv_freq, positions, cache_k, cache_v, block_tables, width) -> None:
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k, v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    T, _, D = q.shape
    Hkv = k.shape[1]
    if q_weight.shape != (D,) or k_weight.shape != (D,):
        raise ValueError(f"q_weight and k_weight must be [D={D}], got {tuple(q_weight.shape)}, {tuple(k_weight.shape)}")
    if inv_freq.ndim != 1 or not 1 <= 2 * inv_freq.shape[0] <= D:
        raise ValueError(f"inv_freq must be [rotary_dim / 2] with rotary_dim <= D={D}, got {tuple(inv_freq.shape)}")
    if positions.shape != (T,):
        raise ValueError(f"positions must be [T={T}], got {tuple(positions.shape)}")
    if cache_k.ndim != 4 or cache_k.shape[2:] != (Hkv, D) or cache_v.shape != cache_k.shape:
        raise ValueError(f"cache_k and cache_v must be [pages, page_size, Hkv={Hkv}, D={D}], got "
                         f"{tuple(cache_k.shape)}, {tuple(cache_v.shape)}")
    if block_tables.ndim != 2 or width < 1 or T != width * block_tables.shape[0]:
        raise ValueError(f"{T} tokens are not {width} per sequence of block_tables {tuple(block_tables.shape)}")


def check_scales(cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> bool:
    """Whether the pools are FP8 with their scales (False: no scales, pools not FP8); ValueError
    for anything between."""
    fp8 = cache_k.dtype == kv_fp8.FP8_DTYPE or cache_v.dtype == kv_fp8.FP8_DTYPE
    if k_scale is None and v_scale is None and not fp8:
        return False
    want = (*cache_k.shape[:3], 1)
    if not (fp8 and cache_k.dtype == cache_v.dtype and k_scale is not None and v_scale is not None
            and k_scale.shape == want and v_scale.shape == want
            and k_scale.dtype == v_scale.dtype == kv_fp8.SCALE_DTYPE):
        raise ValueError(f"FP8 pools need float32 k_scale and v_scale {want} (and FP8 pools need them); got "
                         f"pools {cache_k.dtype} / {cache_v.dtype}, scales "
                         f"{None if k_scale is None else (k_scale.dtype, tuple(k_scale.shape))} / "
                         f"{None if v_scale is None else (v_scale.dtype, tuple(v_scale.shape))}")
    return True


def qk_norm_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, positions: torch.Tensor,
                       cache_k: torch.Tensor, cache_v: torch.Tensor, block_tables: torch.Tensor,
                       width: int, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D], k, v: [T, Hkv, D] (any strides: column blocks of a packed projection);
    q_weight, k_weight: [D] zero-centred norm weights (the norm multiplies 1 + w); inv_freq:
    [rotary_dim / 2] fp32; positions: [T] int64; cache_k, cache_v: [pages, page_size, Hkv, D];
    block_tables: [S, P]; width: the W new tokens of each of the S sequences (T = S * W)
    -> the normed, rotated queries [T, H, D] in q.dtype. Writes the normed, rotated keys and the
    values into their pool rows (in the pool's dtype). Rotation in q.dtype:
    x * cos + x[pair] * sin, cos / sin = cos / signed sin of fp32 angles position * frequency.
    k_scale, v_scale: with FP8 pools their scales [pages, page_size, Hkv, 1], also written."""
    _check_write(q, k, v, q_weight, k_weight, inv_freq, positions, cache_k, cache_v, block_tables, width)
    fp8 = check_scales(cache_k, cache_v, k_scale, v_scale)
    D = q.shape[2]
    freq, sign, perm = rope_tables(inv_freq.float(), D)
    angles = positions[:, None] * freq  # fp32: float(position) * frequency
    cos, sin = angles.cos().to(q.dtype)[:, None], (angles.sin() * sign).to(q.dtype)[:, None]
    qk = torch.cat([rms_norm_zero_centred(q, q_weight, eps), rms_norm_zero_centred(k, k_weight, eps)], dim=1)
    qk = qk * cos + qk.index_select(-1, perm) * sin
    H, Hkv = q.shape[1], k.shape[1]
    ps = cache_k.shape[1]
    seq = torch.arange(q.shape[0], device=q.device) // width
    rows = block_tables[seq, positions // ps] * ps + positions % ps  # page -1: the last page's rows
    if fp8:
        for pool, scales, x in ((cache_k, k_scale, qk[:, H:]), (cache_v, v_scale, v)):
            xq, xs = kv_fp8.quantize_rows(x, (D,))
            pool.view(-1, Hkv, D)[rows] = xq
            scales.view(-1, Hkv, 1)[rows] = xs
        return qk[:, :H].contiguous()
    cache_k.view(-1, Hkv, D)[rows] = qk[:, H:].to(cache_k.dtype)
    cache_v.view(-1, Hkv, D)[rows] = v.to(cache_v.dtype)
    return qk[:, :H].contiguous()


def _check_attend(q, cache_k, cache_v, block_tables, context_lens, gate) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got {tuple(q.shape)}")
    T, H, D = q.shape
    if cache_k.ndim != 4 or cache_k.shape[3] != D or cache_v.shape != cache_k.shape or H % cache_k.shape[2]:
        raise ValueError(f"cache_k and cache_v must be [pages, page_size, Hkv, D={D}] with H={H} a multiple of "
                         f"Hkv, got {tuple(cache_k.shape)}, {tuple(cache_v.shape)}")
    if block_tables.ndim != 2 or block_tables.shape[0] == 0 or T % block_tables.shape[0]:
        raise ValueError(f"block_tables must be [S, P] with T={T} a multiple of S, got {tuple(block_tables.shape)}")
    if context_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"context_lens must be [S={block_tables.shape[0]}], got {tuple(context_lens.shape)}")
    if gate is not None and gate.shape != (T, H, D):
        raise ValueError(f"gate must be [T={T}, H={H}, D={D}], got {tuple(gate.shape)}")


def paged_window_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           gate: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of W = T / S consecutive query tokens per sequence over their pages.

    q: [T, H, D] (query head h reads KV head h // (H / Hkv)); cache_k, cache_v:
    [pages, page_size, Hkv, D]; block_tables: [S, P]; context_lens: [S] int64, the position of
    each sequence's first query (query i attends to positions 0 .. context_lens[s] + i, all
    written: the step's own keys first); gate: [T, H, D] (any strides) or None
    -> [T, H * D] in q.dtype: softmax(q k^T * scale) v, times sigmoid(gate) in q.dtype.
    Scores and softmax in fp32 (fp64 for fp64 input), probabilities rounded to the pool's dtype
    before they weight the values. k_scale, v_scale: with FP8 pools their scales [pages,
    page_size, Hkv, 1]: the gathered rows are dequantised to q's dtype (the pool's dtype above)."""
    _check_attend(q, cache_k, cache_v, block_tables, context_lens, gate)
    fp8 = check_scales(cache_k, cache_v, k_scale, v_scale)
    T, H, D = q.shape
    S, P = block_tables.shape
    W, ps, Hkv = T // S, cache_k.shape[1], cache_k.shape[2]
    dev = q.device
    rows = (block_tables[:, :, None] * ps + torch.arange(ps, device=dev)).flatten(1)  # [S, L]
    ks, vs = (c.view(-1, Hkv, D)[rows] for c in (cache_k, cache_v))  # [S, L, Hkv, D]
    if fp8:
        ks, vs = (kv_fp8.dequantize_rows(t, sc.view(-1, Hkv, 1)[rows], (D,), q.dtype)
                  for t, sc in ((ks, k_scale), (vs, v_scale)))
    last = context_lens[:, None] + torch.arange(W, device=dev)  # [S, W]
    t = torch.arange(P * ps, device=dev)
    masked = t[None, None, :] > last[:, :, None]  # [S, W, L]
    qg = q.view(S, W, Hkv, H // Hkv, D).to(ks.dtype)
    work = work_dtype(ks)
    scores = torch.einsum("swkgd,sjkd->swkgj", qg.to(work), ks.to(work)) * scale
    probs = scores.masked_fill(masked[:, :, None, None, :], float("-inf")).softmax(-1).to(vs.dtype)
    vs = vs.masked_fill((t[None, :] > last[:, -1:])[:, :, None, None], 0)  # rows past a length (0 * NaN)
    out = torch.einsum("swkgj,sjkd->swkgd", probs, vs).reshape(T, H * D).to(q.dtype)
    return out if gate is None else out * torch.sigmoid(gate.reshape(T, H * D))
