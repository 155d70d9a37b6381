"""Paged multi-head latent attention (MLA) ops of an engine step, torch reference.

The KV pool of an MLA layer holds one latent per token, [num_pages, page_size, C] with
C = r + rope: the normalised compressed KV (r = kv_lora_rank) followed by the positional part
(rope dims, absent for NoPE). Two ops touch it:

- `write_latents`: the latent of every new token, from the projection x W_kva = [c | kpe]:
  cache[slot] = rms_norm_rounded(c) ++ kpe (the Kimi / DeepSeek latent norm: fp32
  normalisation rounded to c's dtype before the weight multiply);
- `paged_mla_decode`: absorbed-form attention of N query tokens over their sequences' pages,
  with kv_b_proj folded into the query (q_lat = q_nope W_UK, done by the caller) and into the
  output (W_UV, done here):
      score_h(t) = (q_lat_h . c_t + q_pe_h . kpe_t) * scale,   t <= last[n]
      out[n, h] = W_UV_h (sum_t softmax(score_h)(t) c_t)        -> [N, H * v]

hyla.ops.dispatch sends CUDA calls to hyla.ops.triton.mla (one kernel for the latents, a
split-KV kernel and a combine + W_UV kernel for attention); these are the contracts.

FP8 latents (kv_cache_dtype "fp8", hyla.ops.kv_fp8): both ops take `kv_scale`, the pages'
scales [num_pages, page_size, G] (G = 2: c and kpe scaled apart, or 1 over the row). The writer
rounds the latent to its dtype as above, then quantises each group of the row (per-token dynamic
scale); the reader dequantises the rows it gathers to q_lat's dtype and runs as over a cache in
that dtype.
"""

from __future__ import annotations

import torch

from hyla.ops import kv_fp8
from hyla.ops.norm import rms_norm_rounded
from hyla.ops.utils import work_dtype

__all__ = ["write_latents", "paged_mla_decode"]


def _check_latents(kv: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                   positions: torch.Tensor, seq_ids: torch.Tensor | int) -> int:
    T = kv.shape[0] if kv.ndim == 2 else -1
    if kv.ndim != 2 or cache.ndim != 3 or weight.ndim != 1 or positions.shape != (T,) or block_tables.ndim != 2:
        raise ValueError(f"write_latents expects kv [T, r + rope], weight [r], cache [pages, page_size, C], "
                         f"block_tables [S, P], positions [T]; got {tuple(kv.shape)}, {tuple(weight.shape)}, "
                         f"{tuple(cache.shape)}, {tuple(block_tables.shape)}, {tuple(positions.shape)}")
    if isinstance(seq_ids, int):
        if seq_ids < 1 or T != seq_ids * block_tables.shape[0]:
            raise ValueError(f"{T} tokens are not {seq_ids} per sequence of {block_tables.shape[0]}")
    elif seq_ids.shape != (T,):
        raise ValueError(f"seq_ids must be [T={T}] or an int, got {tuple(seq_ids.shape)}")
    if kv.shape[1] != cache.shape[2] or weight.shape[0] > kv.shape[1]:
        raise ValueError(f"latent width {kv.shape[1]} does not match the cache's {cache.shape[2]} "
                         f"(norm width {weight.shape[0]})")
    return weight.shape[0]


def _check_scale(cache: torch.Tensor, kv_scale: torch.Tensor | None, r: int) -> tuple[int, ...] | None:
    """The column groups of FP8 latents (None without kv_scale); ValueError for a bad pairing."""
    if kv_scale is None:
        if cache.dtype == kv_fp8.FP8_DTYPE:
            raise ValueError("FP8 latents need their kv_scale")
        return None
    if cache.dtype != kv_fp8.FP8_DTYPE or kv_scale.dtype != kv_fp8.SCALE_DTYPE or kv_scale.ndim != 3 \
            or kv_scale.shape[:2] != cache.shape[:2]:
        raise ValueError(f"kv_scale must be float32 [pages, page_size, groups] beside a float8_e4m3fn cache; got "
                         f"{kv_scale.dtype} {tuple(kv_scale.shape)} beside {cache.dtype} {tuple(cache.shape)}")
    groups = kv_fp8.latent_groups(r, cache.shape[2] - r)
    if kv_scale.shape[2] != len(groups):
        raise ValueError(f"FP8 latents of {r} + {cache.shape[2] - r} columns carry {len(groups)} scales per token "
                         f"(c{' and kpe' if len(groups) == 2 else ''}), kv_scale has {kv_scale.shape[2]}")
    return groups


def write_latents(kv: torch.Tensor, weight: torch.Tensor, eps: float, cache: torch.Tensor,
                  block_tables: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor | int,
                  kv_scale: torch.Tensor | None = None) -> None:
    """kv: [T, r + rope] (rows may be strided: a column block of a packed projection);
    weight: [r] the latent norm's weight; cache: [num_pages, page_size, r + rope];
    block_tables: [S, P] page ids; positions: [T] int64; seq_ids: [T] int64 the sequence of
    each token, or an int W when every sequence brings W tokens in order (token t is of
    sequence t // W). Token t goes to row positions[t] % page_size of page
    block_tables[seq, positions[t] // page_size]; a page id -1 counts from the end (the
    CUDA-graph runner's padding rows write the last page, its scratch). In place. kv_scale:
    with an FP8 cache, its scales [num_pages, page_size, G] (the module docstring), also written."""
    r = _check_latents(kv, weight, cache, block_tables, positions, seq_ids)
    groups = _check_scale(cache, kv_scale, r)
    seq = torch.arange(kv.shape[0], device=kv.device) // seq_ids if isinstance(seq_ids, int) else seq_ids
    ps = cache.shape[1]
    slots = block_tables[seq, positions // ps] * ps + positions % ps
    c, kpe = kv[:, :r], kv[:, r:]
    latent = torch.cat([rms_norm_rounded(c, weight, eps), kpe.to(torch.promote_types(weight.dtype, kv.dtype))], -1)
    if groups is not None:
        q, s = kv_fp8.quantize_rows(latent, groups)
        cache.view(-1, cache.shape[-1])[slots] = q
        kv_scale.view(-1, kv_scale.shape[-1])[slots] = s
        return
    cache.view(-1, cache.shape[-1])[slots] = latent.to(cache.dtype)


def _check_decode(q_lat, q_pe, cache, block_tables, last, w_uv) -> None:
    if q_lat.ndim != 3 or q_pe.ndim != 3 or q_pe.shape[:2] != q_lat.shape[:2]:
        raise ValueError(f"q_lat and q_pe must be [N, H, r] and [N, H, rope]; got {tuple(q_lat.shape)}, "
                         f"{tuple(q_pe.shape)}")
    N, H, r = q_lat.shape
    if cache.ndim != 3 or cache.shape[2] != r + q_pe.shape[2]:
        raise ValueError(f"cache must be [pages, page_size, r + rope = {r + q_pe.shape[2]}], got {tuple(cache.shape)}")
    if block_tables.ndim != 2 or block_tables.shape[0] == 0 or N % block_tables.shape[0]:
        raise ValueError(f"block_tables must be [S, P] with N={N} a multiple of S, got {tuple(block_tables.shape)}")
    if last.shape != (N,):
        raise ValueError(f"last must be [N={N}], got {tuple(last.shape)}")
    if w_uv.ndim != 3 or w_uv.shape[0] != H or w_uv.shape[2] != r:
        raise ValueError(f"w_uv must be [H={H}, v, r={r}], got {tuple(w_uv.shape)}")


def paged_mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     last: torch.Tensor, w_uv: torch.Tensor, scale: float,
                     kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA over paged latents for N = S * W query tokens (W consecutive queries per
    sequence: 1 for decode, 1 + k for a speculative verify).

    q_lat: [N, H, r] query already multiplied by W_UK; q_pe: [N, H, rope] (any strides);
    cache: [num_pages, page_size, r + rope]; block_tables: [S, P] page ids (-1 = none: read as
    page 0 and masked); last: [N] int64 the last position query n may attend to (its own);
    w_uv: [H, v, r] the value half of kv_b_proj -> [N, H * v] in q_lat's dtype.
    Softmax in fp32 (fp64 for fp64 inputs); probabilities rounded to the cache dtype before
    they weight the latents, as the expanded form's bf16 attention does. kv_scale: with FP8
    latents their scales [num_pages, page_size, G]: the gathered rows are dequantised to q_lat's
    dtype, which then stands for the cache dtype above."""
    _check_decode(q_lat, q_pe, cache, block_tables, last, w_uv)
    N, H, r = q_lat.shape
    S = block_tables.shape[0]
    groups = _check_scale(cache, kv_scale, r)
    pages = block_tables.clamp(min=0)
    lat = cache[pages].flatten(1, 2)  # [S, L, C]
    if groups is not None:
        lat = kv_fp8.dequantize_rows(lat, kv_scale[pages].flatten(1, 2), groups, q_lat.dtype)
    q = torch.cat([q_lat, q_pe.to(q_lat.dtype)], -1).view(S, N // S, H, -1)
    work = work_dtype(lat)
    scores = torch.einsum("swhc,slc->swhl", q.to(lat.dtype), lat).to(work) * scale
    valid = torch.arange(lat.shape[1], device=lat.device)[None, :] <= last[:, None]  # [N, L]
    scores = scores.masked_fill(~valid.view(S, N // S, 1, -1), float("-inf"))
    probs = scores.softmax(-1).to(lat.dtype)
    past = ~valid.view(S, N // S, -1)[:, -1]  # [S, L]: rows past each sequence's last query (0 * NaN)
    o_lat = torch.einsum("swhl,slr->swhr", probs, lat[..., :r].masked_fill(past[..., None], 0))
    return torch.einsum("swhr,hvr->swhv", o_lat, w_uv.to(o_lat.dtype)).reshape(N, -1).to(q_lat.dtype)
