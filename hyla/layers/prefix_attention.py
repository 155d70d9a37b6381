"""Causal attention of a sequence's new tokens over its cached prefix and themselves: the one
call the prefill paths of hyla.layers.mla and hyla.layers.attention make for each sequence of a
chunked prefill.

Two forms. `attend_after_prefix` takes the whole context's keys and values at once. At long
contexts those are too large to build: MLA expands each cached latent into every head's key and
value (Kimi-Linear-48B-A3B: ~37 KB a token with the up-projection's output, 38 GB at 1M tokens),
gated attention repeats each KV head for its query group. `attend_key_blocks` takes them a block of
positions at a time (the caller builds each block when asked) and merges the blocks' results by
their log-sum-exp, as split-KV decoding combines its splits:

    o = sum_b exp(lse_b - lse) o_b,  lse = log sum_b exp(lse_b)

exact up to the order of the additions. EXPAND_BYTES bounds a block; contexts whose keys and values
fit it keep the one call. `attend_built` makes that choice for the layers, which only say how to
build the keys and values of a range of positions.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from hyla.layers.masks import causal_after_prefix

# A plain causal call (no prefix) of at least CUDNN_MIN_TOKENS queries runs through cuDNN, its
# rows padded to a multiple of CUDNN_BUCKET (_bucketed_cudnn_causal): at a fixed shape cuDNN ran a
# fresh 8,192-token prompt's MLA attention at ~3x flash's rate on an H100, but it builds a plan for
# every new shape (38 ms), which the buckets bound (15 plans up to 8,192 tokens).
CUDNN_MIN_TOKENS = 1024
CUDNN_BUCKET = 512
# The most score memory one CPU call may build (see attend_after_prefix).
CPU_SCORE_BYTES = 256 << 20
# The most memory the keys and values of one block of positions may take, with what building
# them needs on the way (see attend_key_blocks); larger contexts go in blocks.
EXPAND_BYTES = 1 << 30


def attend_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, T, D]: the last T of L positions; k [B, H, L, D], v [B, H, L, Dv] -> [B, H, T, Dv],
    query i attending keys 0 .. L - T + i.

    CUDA in half precision: torch's flash kernel, whose causal mask is aligned lower right; a plain
    causal call (T = L) from CUDNN_MIN_TOKENS queries through cuDNN over bucketed rows.
    Elsewhere, without a prefix (T = L): one plain causal call; with one: the lower-right aligned
    causal bias, which CUDA's kernels apply without building a mask. torch's CPU kernels build that
    bias's [T, L] mask and every head's [T, L] scores (17 GB for 8192 new tokens over a
    131,072-token context at 4 heads), so there the query rows go in blocks whose scores stay
    under CPU_SCORE_BYTES, each block over the keys up to its last row: every row sees the same
    keys and takes the same softmax as in one call."""
    B, H, T, _ = q.shape
    L = k.shape[-2]
    if flash_fits(q, v.shape[-1]):  # CUDA, half precision: one kernel for both (see flash_fits)
        if T == L and T >= CUDNN_MIN_TOKENS and _cudnn_answers(q.device):
            return _bucketed_cudnn_causal(q, k, v, scale)
        return _flash_attention(q, k, v, scale, causal=True)[0]
    if T == L:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    rows = T if q.device.type != "cpu" else max(1, CPU_SCORE_BYTES // (B * H * L * 4))
    if rows >= T:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_after_prefix(T, L), scale=scale)
    out = []
    for start in range(0, T, rows):
        stop = min(T, start + rows)
        keys = L - T + stop
        out.append(F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :keys], v[:, :, :keys],
                                                  attn_mask=causal_after_prefix(stop - start, keys), scale=scale))
    return torch.cat(out, dim=2)


def attend_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_bounds: torch.Tensor, k_bounds: torch.Tensor,
                  host_bounds: tuple[list[int], list[int]], scale: float) -> torch.Tensor:
    """Several sequences at once. q [Tq, H, D]: their new tokens back to back; k [Lk, H, D], v [Lk,
    H, Dv]: all their positions back to back (each sequence's new ones last); q_bounds, k_bounds
    [S + 1] int32: cumulative query and key counts, on q's device and (host_bounds) as lists
    -> [Tq, H, Dv]: each sequence's attend_after_prefix. CUDA in half precision: one varlen call
    of torch's flash kernel (its causal mask aligned lower right per sequence); elsewhere one
    call per sequence."""
    qb, kb = host_bounds
    if flash_fits(q, v.shape[-1]):
        Dv = v.shape[-1]
        if Dv < q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - Dv))
        max_q = max(b - a for a, b in zip(qb, qb[1:]))
        max_k = max(b - a for a, b in zip(kb, kb[1:]))
        out = torch.ops.aten._flash_attention_forward(q, k, v, q_bounds, k_bounds, max_q, max_k, 0.0, True, False,
                                                      scale=scale)[0]
        return out[..., :Dv]
    return torch.cat([attend_after_prefix(q[qb[i]:qb[i + 1]].transpose(0, 1)[None], k[kb[i]:kb[i + 1]].transpose(0, 1)[None],
                                          v[kb[i]:kb[i + 1]].transpose(0, 1)[None], scale)[0].transpose(0, 1)
                      for i in range(len(qb) - 1)])


def attend_built(q: torch.Tensor, build, context: int, bytes_per_position: int, scale: float) -> torch.Tensor:
    """q [B, H, T, D]: T new positions after `context` cached ones; build(start, stop) -> the keys
    [B, H, n, D] and values [B, H, n, Dv] of positions start..stop-1, which take
    bytes_per_position each to build -> [B, H, T, Dv]: one attend_after_prefix over all of them
    when they fit EXPAND_BYTES, else attend_key_blocks over the blocks key_blocks gives (the one
    rule both prefill paths follow)."""
    blocks = key_blocks(context, q.shape[-2], bytes_per_position)
    if blocks is None:
        return attend_after_prefix(q, *build(0, context + q.shape[-2]), scale)
    return attend_key_blocks(q, (build(start, stop) for start, stop in blocks), scale)


def expansion_groups(sequences: list[tuple[int, int]], bytes_per_position: int,
                     page_size: int) -> list[list[tuple[int, int]]]:
    """sequences: (index, positions L) of a step's prefill sequences, in order -> consecutive
    groups whose keys and values, built together over whole pages (each sequence's L rounded up
    to a page), fit EXPAND_BYTES; a sequence that does not fit alone is a group of its own (for
    attend_built's blocks)."""
    groups: list[list[tuple[int, int]]] = []
    used = 0
    for n, L in sequences:
        size = -(-L // page_size) * page_size * bytes_per_position
        if groups and used + size <= EXPAND_BYTES:
            groups[-1].append((n, L))
            used += size
        else:
            groups.append([(n, L)])
            used = size
    return groups


def key_blocks(context: int, new: int, bytes_per_position: int) -> list[tuple[int, int]] | None:
    """The blocks of positions (start, stop) whose keys and values attend_key_blocks builds for
    `new` tokens after `context` cached ones: the prefix in blocks of at most EXPAND_BYTES (at
    bytes_per_position each), then the new positions. None when all context + new positions fit
    EXPAND_BYTES (one call)."""
    if (context + new) * bytes_per_position <= EXPAND_BYTES:
        return None
    size = max(1, EXPAND_BYTES // bytes_per_position)
    return [(s, min(context, s + size)) for s in range(0, context, size)] + [(context, context + new)]


def attend_key_blocks(q: torch.Tensor, blocks: Iterable[tuple[torch.Tensor, torch.Tensor]],
                      scale: float) -> torch.Tensor:
    """q [B, H, T, D]: the last T of the context's positions; blocks: the keys [B, H, L_b, D] and
    values [B, H, L_b, Dv] of consecutive blocks of positions from 0, built lazily, the last block
    exactly the T new positions (causal among themselves), every earlier one seen by every query
    -> [B, H, T, Dv] in q's dtype, what attend_after_prefix gives over all of them at once."""
    blocks = iter(blocks)
    q = q.contiguous()  # once for every block (attention_with_lse's kernel reads dense rows)
    out = lse = None
    k, v = next(blocks)
    for following in blocks:
        out, lse = _merge(out, lse, *attention_with_lse(q, k, v, scale, causal=False))
        k, v = following
    if k.shape[-2] != q.shape[-2]:
        raise ValueError(f"the last key block must be the {q.shape[-2]} new positions, got {k.shape[-2]}")
    out, _ = _merge(out, lse, *attention_with_lse(q, k, v, scale, causal=True))
    return out.to(q.dtype)


def _merge(out, lse, out_b: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' (outputs [B, H, T, Dv], log-sum-exps [B, H, T]) -> the union's, in fp32 (fp64
    for fp64); a first block (out None) as it is."""
    work = torch.float64 if out_b.dtype == torch.float64 else torch.float32
    out_b, lse_b = out_b.to(work), lse_b.to(work)
    if out is None:
        return out_b, lse_b
    total = torch.logaddexp(lse, lse_b)
    return (out * (lse - total).exp()[..., None] + out_b * (lse_b - total).exp()[..., None]), total


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, H, T, D] over k [B, H, L, D], v [B, H, L, Dv] (causal: T == L, query i
    sees keys 0..i) -> (out [B, H, T, Dv], the log-sum-exp of each query's scaled scores [B, H, T]).
    CUDA: torch's flash kernel in fp16 / bf16 (flash_fits), its memory-efficient kernel
    otherwise, asked for the log-sum-exp; elsewhere score blocks under CPU_SCORE_BYTES."""
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"a causal block is square: {q.shape[-2]} queries, {k.shape[-2]} keys")
    T = q.shape[-2]
    if flash_fits(q, v.shape[-1]):  # it reads rows at any stride (as attend_after_prefix hands it slices)
        return _flash_attention(q, k, v, scale, causal)
    if q.device.type == "cuda":
        # the memory-efficient kernel reads dense [B, H, L, D] rows (torch's sdpa checks a layout
        # before it calls it; this call skips that check): a query transposed from [T, H, D], an
        # expanded value (a view of the up-projection) are copied
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :T]  # (the kernel pads T to a multiple of 32)
    B, H, _, _ = q.shape
    L = k.shape[-2]
    rows = max(1, CPU_SCORE_BYTES // (B * H * L * 4))
    outs, lses = [], []
    for start in range(0, T, rows):
        stop = min(T, start + rows)
        scores = (q[:, :, start:stop] @ k.transpose(-1, -2)) * scale  # [B, H, rows, L]
        if causal:
            hidden = torch.arange(L, device=q.device)[None, :] > torch.arange(start, stop, device=q.device)[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(scores.float() if scores.dtype != torch.float64 else scores, dim=-1)
        outs.append(((scores - lse[..., None].to(scores.dtype)).exp() @ v))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def flash_fits(q: torch.Tensor, value_dim: int) -> bool:
    """Whether torch's flash kernel takes q [B, H, T, D] with values value_dim wide: fp16 / bf16
    on an sm80+ card, D <= 256 a multiple of 8, value_dim <= D (narrower values are padded to D).

    Why flash and not the kernels torch's sdpa picks for MLA's shapes, whose values are narrower
    than the keys (scripts/prefix_attention_bench.py, BENCHMARKS "Prefill steps", H100): the
    memory-efficient kernel (its choice for the lower-right bias) runs at half flash's rate; cuDNN's
    (its choice for a plain causal call) is faster at a fixed shape, but builds a plan for every
    new (queries, keys) pair, 38 ms for a 512-token prompt, and a server meets a new pair with
    nearly every prompt."""
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0 and value_dim <= q.shape[-1]
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, T, D], k [B, H, L, D], v [B, H, L, Dv] -> (out [B, H, T, Dv], lse [B, H, T]) by
    torch's flash kernel; causal aligns the mask lower right (query i sees keys 0 .. L - T + i),
    as the flash kernel does. Values narrower than D are padded with zeros (their columns of the
    output are zero and dropped)."""
    Dv = v.shape[-1]
    if Dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - Dv))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out[..., :Dv], lse


def _bucketed_cudnn_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [B, H, T, D] over k [B, H, T, D], v [B, H, T, Dv] by cuDNN, all three
    padded with zero rows to the next multiple of CUDNN_BUCKET: query i < T sees keys 0..i only,
    so the padding rows never reach the first T outputs, which are returned [B, H, T, Dv]."""
    T = q.shape[-2]
    pad = -T % CUDNN_BUCKET
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False, scale=scale)[0]
    return out[:, :, :T]


@functools.cache
def _cudnn_answers(device: torch.device) -> bool:
    """Whether cuDNN's attention runs on this device (cuDNN 9 and an sm80+ card): one probe a device."""
    q = torch.zeros(1, 1, CUDNN_BUCKET, 64, device=device, dtype=torch.bfloat16)
    try:
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, False, 0.0, True, False, scale=1.0)
    except (RuntimeError, NotImplementedError):
        return False
    return True
