"""DSA over the engine's pages: the indexer scores the cached pooled keys, every query keeps its
top index_topk / kpool visible pools (plus its tail) as a list of positions, and attends in the
absorbed MLA form to the gathered latents of those positions only. No [T, L] mask is built, so a
step's memory grows with the selection budget S, not with the context.

Shapes (T query tokens; S = index_topk + kpool - 1 selected positions at most):
    selection: (positions [T, S] int64, valid [T, S] bool); a shared layer gets its full layer's.
Decode / verify batches (every sequence brings W tokens) run all sequences at once and read no
value back (CUDA-graph safe); a prefill walks its sequences in blocks of queries. Padding
columns of the block tables (-1) read the pools' last page, which is never visible: a pool is a
candidate only when its last token is at or before the query's position.
"""

from __future__ import annotations

import torch

from hyla.contract import ForwardBatch
from hyla.ops import kv_fp8


def write_pooled_keys(indexer, cache, batch: ForwardBatch, page_size: int) -> None:
    """For every new token, re-pool its pool from the cached token rows (this step's included)
    and store it. Tokens of one pool compute the same value from the same rows, so duplicate
    writes agree; an incomplete pool's entry is never read before the token completing it
    rewrites it (it is not yet a candidate)."""
    P = indexer.kpool
    pos, seq = batch.positions, batch.token_seq_ids()
    page = batch.block_tables[seq, pos // page_size]  # [T]; a pool never straddles pages (P | page_size)
    members = pos // P * P % page_size  # first row of the token's pool in its page
    rows = members[:, None] + torch.arange(P, device=pos.device)  # [T, P]
    raw = cache.index_tokens[page[:, None], rows]  # [T, P, 2D]
    cache.index_pooled[page, pos % page_size // P] = indexer.pool(raw).to(cache.index_pooled.dtype)


def select_from_pooled(indexer, x: torch.Tensor, q_resid: torch.Tensor, pooled: torch.Tensor,
                       positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, W, hidden], q_resid: [N, W, q_lora_rank] queries of N sequences; pooled: [N, J, D]
    each sequence's pooled keys (pool j = positions jP .. jP+P-1); positions: [N, W] ->
    (positions [N*W, S], valid [N*W, S]), S = index_topk + P - 1 (index_topk without the tail)."""
    P, N, W = indexer.kpool, x.shape[0], x.shape[1]
    scores = indexer.scores(x, q_resid, pooled)  # [N, W, J]
    pos = positions[..., None]
    J = scores.shape[-1]
    visible = torch.arange(P - 1, J * P, P, device=x.device) <= pos  # [N, W, J]
    k = min(indexer.topk // P, J)
    top = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1)
    kept = top.values > float("-inf")  # [N, W, k] (fewer visible pools than k: the rest is padding)
    offs = torch.arange(P, device=x.device)
    sel = (top.indices[..., None] * P + offs).flatten(-2)  # [N, W, k * P]
    valid = kept[..., None].expand(*kept.shape, P).flatten(-2)
    short = indexer.topk - k * P  # pad to a fixed width, so selections of several sequences stack
    if short:
        sel = torch.cat([sel, sel.new_zeros(N, W, short)], -1)
        valid = torch.cat([valid, valid.new_zeros(N, W, short)], -1)
    if indexer.always_select_tail and P > 1:
        tail = (pos + 1) // P * P + offs[:-1]  # [N, W, P - 1]
        sel = torch.cat([sel, tail], -1)
        valid = torch.cat([valid, tail <= pos], -1)
    sel = torch.where(valid, sel, 0)  # invalid entries point at position 0 (masked when attending)
    return sel.flatten(0, 1), valid.flatten(0, 1)


def select_uniform(indexer, x: torch.Tensor, q_resid: torch.Tensor, cache, batch: ForwardBatch,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode / verify batch: x [T, hidden], q_resid [T, q_lora_rank] -> (positions [T, S],
    valid [T, S]), every sequence's queries against every pool its block table reaches."""
    tables = batch.block_tables  # [N, MP]
    N = tables.shape[0]
    pooled = cache.index_pooled[tables].flatten(1, 2)  # [N, MP * page_size / P, D]
    return select_from_pooled(indexer, x.view(N, width, -1), q_resid.view(N, width, -1), pooled,
                              batch.positions.view(N, width))


def attend_selected(layer, q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, seq_ids: torch.Tensor,
                    selection: tuple[torch.Tensor, torch.Tensor], kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA over the selected latents. q: [T, H, nope]; kv: [num_pages, page_size, r];
    tables: [N, MP] page ids; seq_ids: [T] each query's row of `tables`; kv_scale: FP8 latents'
    scales [num_pages, page_size, 1] or None -> [T, H * v_dim]. A query with nothing selected
    outputs zeros (as SDPA's fully masked row)."""
    sel, valid = selection
    page_size = kv.shape[1]
    pages = tables[seq_ids[:, None], sel // page_size]  # [T, S]
    if kv_scale is not None:  # FP8 latents: the gathered rows dequantised to the model dtype
        lat = kv_fp8.dequantize_rows(kv[pages, sel % page_size], kv_scale[pages, sel % page_size],
                                     (kv.shape[2],), q.dtype)
    else:
        lat = kv[pages, sel % page_size].to(q.dtype)  # [T, S, r]
    w = layer.kv_b_proj.weight.unflatten(0, (layer.num_heads, layer.nope + layer.v_dim))  # [H, nope + v, r]
    w_uk, w_uv = w[:, :layer.nope], w[:, layer.nope:]
    q_lat = torch.einsum("thn,hnr->thr", q, w_uk)
    logits = torch.einsum("thr,tsr->ths", q_lat, lat) * layer.scaling
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1)
    p = torch.where(valid.any(-1)[:, None, None], p, 0)  # all-masked rows: NaN -> 0
    o = torch.einsum("thr,hvr->thv", torch.einsum("ths,tsr->thr", p, lat), w_uv)
    return o.flatten(-2)


def write_completed_pools(indexer, cache, pages: torch.Tensor, ctx: int, length: int) -> None:
    """One sequence of a prefill step (new tokens at ctx..length-1, pages covering them): pool
    and store every pool that ends in this step (pools [ctx // P, length // P))."""
    P = indexer.kpool
    first, last = ctx // P, length // P
    if last <= first:
        return
    per_page = cache.index_pooled.shape[1]
    raw = cache.index_tokens[pages].flatten(0, 1)[first * P:last * P]  # [(last - first) * P, 2D]
    fresh = indexer.pool(raw.unflatten(0, (last - first, P))).to(cache.index_pooled.dtype)
    j = torch.arange(first, last, device=pages.device)
    cache.index_pooled[pages[j // per_page], j % per_page] = fresh
