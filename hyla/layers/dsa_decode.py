"""DSA for decode and verify batches (every sequence brings the same W new tokens), on the device
without reading a value back: the indexer scores every cached pooled key the block tables reach,
keeps the top index_topk / kpool visible pools per query (plus its tail), and the queries attend
in the absorbed MLA form to the gathered latents of the kept positions only.

Shapes (T = N * W query tokens, S = index_topk + kpool - 1 selected positions at most):
    selection: (positions [T, S] int64, valid [T, S] bool); a shared layer gets its full layer's.
Padding columns of the block tables (-1) read the pools' last page, which is never visible: a
pool is a candidate only when its last token is at or before the query's position.
"""

from __future__ import annotations

import torch

from hyla.contract import ForwardBatch


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


def select_uniform(indexer, x: torch.Tensor, q_resid: torch.Tensor, cache, batch: ForwardBatch,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, hidden], q_resid: [T, q_lora_rank] -> (positions [T, S], valid [T, S])."""
    P = indexer.kpool
    tables = batch.block_tables  # [N, MP]
    N = tables.shape[0]
    pooled = cache.index_pooled[tables].flatten(1, 2)  # [N, J, D], J = MP * page_size / P
    scores = indexer.scores(x.view(N, width, -1), q_resid.view(N, width, -1), pooled)  # [N, W, J]
    positions = batch.positions.view(N, width, 1)
    J = scores.shape[-1]
    ar = torch.arange(J * P, device=x.device)
    visible = (ar[P - 1::P] <= positions)  # [N, W, J]
    k = min(indexer.topk // P, J)
    top = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1)
    kept = top.values > float("-inf")  # [N, W, k] (fewer visible pools than k: the rest is padding)
    offs = torch.arange(P, device=x.device)
    sel = (top.indices[..., None] * P + offs).flatten(-2)  # [N, W, k * P]
    valid = kept[..., None].expand(*kept.shape, P).flatten(-2)
    if indexer.always_select_tail and P > 1:
        tail = (positions + 1) // P * P + offs[:-1]  # [N, W, P - 1]
        sel = torch.cat([sel, tail], -1)
        valid = torch.cat([valid, tail <= positions], -1)
    sel = torch.where(valid, sel, 0)  # invalid entries point at position 0 (masked below)
    return sel.flatten(0, 1), valid.flatten(0, 1)


def attend_selected(layer, q: torch.Tensor, kv: torch.Tensor, batch: ForwardBatch,
                    selection: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Absorbed MLA over the selected latents. q: [T, H, nope]; kv: [num_pages, page_size, r]
    -> [T, H * v_dim]. A query with nothing selected outputs zeros (as SDPA's fully masked row)."""
    sel, valid = selection
    page_size = kv.shape[1]
    pages = batch.block_tables[batch.token_seq_ids()[:, None], sel // page_size]  # [T, S]
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
