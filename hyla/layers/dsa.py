"""DSA-indexed sparse attention (GLM-5-Next): a lightweight indexer picks, for every query, which
earlier positions a NoPE MLA layer attends to.

Indexer, per token t (kpool = P tokens pooled into one key; D = index_head_dim, Hi heads):
    k_t    = LayerNorm(wk(x_t))                          [D]  (weight and bias, eps 1e-6)
    s_t    = x_t @ index_kpool_compress_gate^T           [D]  per-channel pooling logits
    pool j = tokens jP .. jP+P-1 (complete pools only):
             K_j = sum_i softmax_i(s_{jP+i} + ape[i]) * k_{jP+i}     (softmax over i, per channel)
    q_t    = wq_b(q_resid_t)                             [Hi, D]  q_resid = the MLA's q latent
    w_t    = weights_proj(x_t) * Hi^-1/2                 [Hi]
    score(t, j) = sum_h w_t[h] * relu(q_t[h] . K_j * D^-1/2)
Selection for the query at position p: pool j is a candidate when its last token jP+P-1 <= p;
keep the index_topk / P best candidates (all of them when there are fewer), expand them to their
tokens, and (index_kpool_always_select_tail) add the tokens of p's incomplete pool,
floor((p+1)/P)*P .. p. The MLA layer then attends only to the selected positions (a query with
none selected outputs zeros, as SDPA does for a fully masked row). A "shared" layer has no
indexer and reuses the selection of the nearest earlier full layer (hyla.models.glm5_next).

Tensor names (under self_attn): indexer.wq_b, indexer.wk, indexer.k_norm (weight, bias),
indexer.weights_proj, indexer.index_kpool_compress_ape [P, D], indexer.index_kpool_compress_gate
[D, hidden]; the MLA's q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj (hyla.layers.mla).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.contract import ForwardBatch, MLALayerCache
from hyla.layers.dsa_paged import (
    attend_selected, select_from_pooled, select_uniform, write_completed_pools, write_pooled_keys,
)
from hyla.layers.mla import MLAAttention
from hyla.ops import kv_fp8

INDEXER_NORM_EPS = 1e-6  # transformers builds the indexer's k_norm with LayerNorm(eps=1e-6)


class DSAIndexer(nn.Module):
    """Scores pooled key groups for every query (see the module docstring)."""

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, kpool: int, topk: int,
                 always_select_tail: bool):
        super().__init__()
        self.n_heads, self.head_dim, self.kpool, self.topk = n_heads, head_dim, kpool, topk
        self.always_select_tail = always_select_tail
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(kpool, head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(head_dim, hidden_size))

    def token_keys(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> [..., 2D]: each token's key k ++ its pooling logits s (what the
        engine caches per token until its pool is complete)."""
        return torch.cat([self.k_norm(self.wk(x)), F.linear(x, self.index_kpool_compress_gate)], dim=-1)

    def pool(self, raw: torch.Tensor) -> torch.Tensor:
        """raw: [..., J, P, 2D] token_keys of J complete pools -> pooled keys [..., J, D] (work dtype)."""
        k, s = raw.split(self.head_dim, dim=-1)
        work = torch.float64 if raw.dtype == torch.float64 else torch.float32
        p = torch.softmax(s.to(work) + self.index_kpool_compress_ape.to(work), dim=-2)
        return (p.to(k.dtype) * k).sum(-2)

    def pooled_keys(self, raw: torch.Tensor) -> torch.Tensor:
        """raw: [..., L, 2D] token_keys of positions 0..L-1 -> [..., L // P, D]."""
        j = raw.shape[-2] // self.kpool
        return self.pool(raw[..., :j * self.kpool, :].unflatten(-2, (j, self.kpool)))

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """x: [..., T, hidden], q_resid: [..., T, q_lora_rank], pooled: [..., J, D] -> [..., T, J] fp32."""
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        q = self.wq_b(q_resid).unflatten(-1, (self.n_heads, self.head_dim)).to(work)  # [..., T, Hi, D]
        logits = torch.relu((q @ pooled.to(work).unsqueeze(-3).transpose(-1, -2)) * self.head_dim ** -0.5)
        w = self.weights_proj(x).to(work) * self.n_heads ** -0.5  # [..., T, Hi]
        return (w.unsqueeze(-2) @ logits).squeeze(-2)  # [..., T, J]

    def select(self, scores: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """scores: [..., T, J]; positions: [T] of the queries; length: L keys -> bool [..., T, L]
        (True = attend)."""
        return select_positions(scores, positions, length, self.kpool, self.topk, self.always_select_tail)


def select_positions(scores: torch.Tensor, positions: torch.Tensor, length: int, kpool: int, topk: int,
                     always_select_tail: bool) -> torch.Tensor:
    """The top `topk // kpool` candidate pools of every query, as a key mask.

    scores: [..., T, J] pool scores; positions: [T] int64 each query's position (< length);
    -> bool [..., T, length]: the tokens of the kept pools, plus (always_select_tail) the
    query's own incomplete pool."""
    J = scores.shape[-1]
    pool_end = torch.arange(J, device=scores.device) * kpool + kpool - 1
    visible = pool_end[None, :] <= positions[:, None]  # [T, J]
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    k = min(topk // kpool, J)
    if k > 0:
        masked = scores.masked_fill(~visible, float("-inf"))
        best = masked.topk(k, dim=-1).indices
        keep.scatter_(-1, best, True)
        keep &= visible
    mask = keep.repeat_interleave(kpool, dim=-1)  # [..., T, J * kpool]
    pad = length - mask.shape[-1]
    mask = F.pad(mask, (0, pad), value=False) if pad >= 0 else mask[..., :length]
    if always_select_tail:
        cols = torch.arange(length, device=scores.device)
        tail_start = (positions + 1) // kpool * kpool
        tail = (cols[None, :] >= tail_start[:, None]) & (cols[None, :] <= positions[:, None])  # [T, L]
        mask = mask | tail
    return mask


class DSAAttention(MLAAttention):
    """NoPE MLA with q_lora whose queries attend to the positions an indexer selected.

    forward(x [B, T, hidden], selection=None) -> (out [B, T, hidden], selection bool [B, T, T]):
    a layer with an indexer computes the selection itself, a shared layer is handed one.
    forward_batch: one engine step over the paged caches (hyla.layers.dsa_paged)."""

    # CUDA graphs capture decode / verify steps only, and their path (hyla.layers.dsa_paged) reads
    # nothing back and has fixed shapes: a top-k of min(index_topk / kpool, pools reached) with
    # invisible pools at -inf, index gathers, no boolean compaction (replay == eager on an H200;
    # tests/engine/test_glm5_next_graph.py runs it with syncs failing; the prefill walk is never captured).
    graph_safe = True
    uniform_path = True  # decode / verify all sequences at once (False: the prefill walk, for tests)
    prefill_block = 256  # queries per block of the prefill walk

    def __init__(self, hidden_size: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, v_head_dim: int,
                 q_lora_rank: int, indexer: DSAIndexer | None, bias: bool = False, norm_eps: float = 1e-5):
        super().__init__(hidden_size, num_heads, kv_lora_rank, qk_nope_head_dim, 0, v_head_dim,
                         q_lora_rank=q_lora_rank, bias=bias, latent_norm_eps=norm_eps)
        self.indexer = indexer

    def project_query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [..., hidden] -> (q [..., H, nope], q_resid [..., q_lora_rank], kv_a output [..., r])."""
        q_in, kv = self._project(x)
        q_resid = self.q_a_layernorm(q_in)
        return self.q_b_proj(q_resid).unflatten(-1, (self.num_heads, -1)), q_resid, kv

    def forward(self, x: torch.Tensor, selection: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        T = x.shape[-2]
        q, q_resid, kv = self.project_query(x)
        latent = self._latent_from(kv)  # [B, T, r]
        if self.indexer is not None:
            pooled = self.indexer.pooled_keys(self.indexer.token_keys(x))
            scores = self.indexer.scores(x, q_resid, pooled)
            selection = self.indexer.select(scores, torch.arange(T, device=x.device), T)
        elif selection is None:
            raise ValueError("a shared DSA layer needs the selection of an earlier full indexer layer")
        out = self._attend(q, latent, selection[:, None], causal=False)  # mask broadcast over heads
        return self.o_proj(out), selection

    # -- engine step --------------------------------------------------------------------------

    def forward_batch(self, x: torch.Tensor, batch: ForwardBatch, cache: MLALayerCache,
                      selection: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x: [T_total, hidden]; cache: DSALayerCache (a layer with an indexer) or MLALayerCache
        (shared); selection: a shared layer's selection from its full layer -> (out [T_total,
        hidden], selection: positions [T_total, S] and valid [T_total, S]; hyla.layers.dsa_paged).

        Writes each new token's latent (and indexer row) into its page, then the pooled key of
        every pool this step completes, so a pooled row is final once its pool is: a prefix-cache
        hit restores the pooled keys with the latents of the same pages, and a rejected draft
        token's rows are rewritten (pool included) before any query can see them. Decode /
        verify batches run every sequence at once without a host sync; a prefill walks its
        sequences in blocks of `prefill_block` queries."""
        page_size = cache.kv.shape[1]
        batch.check_written_pages(page_size)
        rows = batch.kv_slot_mapping(page_size)  # [T_total] flat page rows of the new tokens
        q, q_resid, kv = self.project_query(x)
        if cache.kv_scale is not None:  # FP8 latents (hyla.ops.kv_fp8): one scale per token (NoPE: c only)
            lq, ls = kv_fp8.quantize_rows(self._latent_from(kv), (cache.kv.shape[-1],))
            cache.kv.view(-1, cache.kv.shape[-1])[rows] = lq
            cache.kv_scale.view(-1, 1)[rows] = ls
        else:
            cache.kv.view(-1, cache.kv.shape[-1])[rows] = self._latent_from(kv).to(cache.kv.dtype)
        if self.indexer is not None:
            cache.index_tokens.view(-1, cache.index_tokens.shape[-1])[rows] = \
                self.indexer.token_keys(x).to(cache.index_tokens.dtype)
        elif selection is None:
            raise ValueError("a shared DSA layer needs the selection of an earlier full indexer layer")
        w = batch.uniform_width
        if w is not None and self.uniform_path:
            if self.indexer is not None:
                write_pooled_keys(self.indexer, cache, batch, page_size)
                selection = select_uniform(self.indexer, x, q_resid, cache, batch, w)
            out = attend_selected(self, q, cache.kv, batch.block_tables, batch.token_seq_ids(), selection,
                                  cache.kv_scale)
            return self.o_proj(out), selection
        return self._prefill(x, q, q_resid, batch, cache, selection)

    def _prefill(self, x, q, q_resid, batch: ForwardBatch, cache, selection):
        """Sequence by sequence, query block by query block (memory ~ block x S, not new x L)."""
        page_size = cache.kv.shape[1]
        out = x.new_empty(x.shape[0], self.num_heads * self.v_dim)
        sels = []
        cu = batch.cu_seqlens_list
        for n, (new, ctx) in enumerate(zip(batch.seq_lens, batch.context_lens_list)):
            if new == 0:
                continue
            L = ctx + new
            pages = batch.context_pages(n, L, page_size)
            if self.indexer is not None:
                write_completed_pools(self.indexer, cache, pages, ctx, L)
                pooled = cache.index_pooled[pages].flatten(0, 1)[None]  # [1, J, D]
            for b in range(cu[n], cu[n + 1], self.prefill_block):
                blk = slice(b, min(b + self.prefill_block, cu[n + 1]))
                if self.indexer is not None:
                    sel = select_from_pooled(self.indexer, x[blk][None], q_resid[blk][None], pooled,
                                             batch.positions[blk][None])
                else:
                    sel = (selection[0][blk], selection[1][blk])
                sels.append(sel)
                seq0 = torch.zeros(blk.stop - blk.start, dtype=torch.long, device=x.device)
                out[blk] = attend_selected(self, q[blk], cache.kv, pages[None], seq0, sel, cache.kv_scale)
        if self.indexer is not None:
            selection = (torch.cat([s for s, _ in sels]), torch.cat([v for _, v in sels]))
        return self.o_proj(out), selection
