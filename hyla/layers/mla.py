"""Multi-head latent attention (DeepSeek-V2 MLA) without RoPE, as Kimi-Linear's `mla_use_nope`.

Per token, one latent is cached for all heads:
    c   = kv_a_layernorm(x W_kva[:r])        [r = kv_lora_rank]
    kpe = x W_kva[r:]                        [qk_rope_head_dim]; named "rope" but never rotated
    latent = c ++ kpe                        [r + rope]  (what the paged KV pool stores)
Expanded form (prefill): kv_b_proj(c) -> per-head k_nope [nope], v [v_dim]; k = k_nope ++ kpe.
Absorbed / MQA form (decode): fold kv_b_proj's K part into the query and its V part into the
output, so attention runs directly over the cached latents:
    score_h(t) = (q_nope_h W_UK_h) . c_t + q_pe_h . kpe_t,   o_h = W_UV_h (sum_t p_h(t) c_t)
Both equal softmax(q k^T * (nope + rope)^-1/2) v exactly (up to rounding).

Tensor names: q_proj (or q_a_proj, q_a_layernorm, q_b_proj when q_lora_rank is set),
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj.

`prepare_for_inference()` packs the two projections from x (q_proj or q_a_proj, and
kv_a_proj_with_mqa) into one weight (hyla.layers.delta_rule.PackedLinears; state_dict unchanged),
so an engine step runs them as one GEMM.

FP8 latents (an MLALayerCache with kv_scale, kv_cache_dtype "fp8": hyla.ops.kv_fp8): each new
latent is stored in e4m3 with a per-token scale for c and one for k_pe; every read dequantises
the rows to the model dtype first (the paged ops take the scales: hyla.ops.mla), so attention
runs as over a cache in the model dtype.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from hyla.contract import ForwardBatch, MLALayerCache
from hyla.layers.delta_rule import PackedLinears
from hyla.layers.norm import RMSNorm
from hyla.layers.prefix_attention import attend_built, attend_packed, expansion_groups, flash_fits
from hyla.ops import dispatch, kv_fp8
from hyla.ops.transfer import stage_long

# transformers builds q_a_layernorm / kv_a_layernorm with KimiLinearRMSNorm's default eps, not
# config.rms_norm_eps; the checkpoints were trained that way (GLM-5-Next passes its rms_norm_eps).
LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    """x: [B, T, hidden] -> [B, T, hidden] (full causal sequences), or packed [T_total, hidden]
    with a ForwardBatch and an MLALayerCache (forward_batch)."""

    def __init__(self, hidden_size: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None, bias: bool = False,
                 latent_norm_eps: float = LATENT_NORM_EPS):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scaling = qk_head_dim ** -0.5
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=latent_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=latent_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self._packed: PackedLinears | None = None

    def prepare_for_inference(self) -> None:
        """Pack q_proj (or q_a_proj) and kv_a_proj_with_mqa into one weight (one GEMM per step)."""
        q_in = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        if (q_in.bias is None) == (self.kv_a_proj_with_mqa.bias is None):  # else: keep them separate
            self._packed = PackedLinears([q_in, self.kv_a_proj_with_mqa])

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x -> (q_proj(x) or q_a_proj(x), kv_a_proj_with_mqa(x)): one GEMM once packed."""
        if self._packed is not None:
            q_in, kv = self._packed(x)
            return q_in, kv
        q_in = self.q_proj(x) if self.q_lora_rank is None else self.q_a_proj(x)
        return q_in, self.kv_a_proj_with_mqa(x)

    def _query_from(self, q_in: torch.Tensor) -> torch.Tensor:
        q = q_in if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q_in))
        return q.unflatten(-1, (self.num_heads, -1))

    def _latent_from(self, kv: torch.Tensor) -> torch.Tensor:
        c, kpe = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), kpe], dim=-1)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> q: [..., H, nope + rope]."""
        return self._query_from(self.q_proj(x) if self.q_lora_rank is None else self.q_a_proj(x))

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> latent: [..., r + rope] (normalised c_kv ++ k_pe), what the cache holds."""
        return self._latent_from(self.kv_a_proj_with_mqa(x))

    def expand(self, latent: torch.Tensor, pad_values: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """latent: [..., L, r + rope] -> k: [..., H, L, nope + rope], v: [..., H, L, v_dim].

        pad_values: v is nope + rope wide, its columns past v_dim zero (what the flash kernel
        takes, hyla.layers.prefix_attention), and neither k nor v is copied after the
        up-projection: it runs with a weight that leaves each head's key a gap for k_pe and its
        value a zero tail ([H, 2 (nope + rope), r], _padded_expansion), so its output [..., L, H,
        2 (nope + rope)] holds both as views once k_pe is written into the gaps. The keys and
        values are then strided views (rows of every head interleaved), which the flash kernel
        reads in place."""
        c, kpe = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        if pad_values:
            D = self.nope + self.rope
            kv = F.linear(c, self._padded_expansion()).unflatten(-1, (self.num_heads, 2 * D))  # [..., L, H, 2D]
            kv[..., self.nope:D] = kpe.unsqueeze(-2)  # every head's key ends with the shared k_pe
            return kv[..., :D].transpose(-2, -3), kv[..., D:].transpose(-2, -3)
        kv = self.kv_b_proj(c).unflatten(-1, (self.num_heads, -1)).transpose(-2, -3)  # [..., H, L, nope+v]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        kpe = kpe.unsqueeze(-3).expand(*k_nope.shape[:-1], self.rope)
        return torch.cat([k_nope, kpe], dim=-1), v

    def _padded_expansion(self) -> torch.Tensor:
        """kv_b_proj's weight with each head's rows as [k_nope (nope) | 0 (rope) | v (v_dim) |
        0 (nope + rope - v_dim)] -> [H * 2 (nope + rope), r]; built once per weight (the up-
        projection is never quantised: hyla.models.fp8_loading.RAW_WEIGHT_MODULES)."""
        w = self.kv_b_proj.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if getattr(self, "_padded", (None,))[0] != key:
            D = self.nope + self.rope
            heads = w.unflatten(0, (self.num_heads, self.nope + self.v_dim))  # [H, nope + v, r]
            padded = w.new_zeros(self.num_heads, 2 * D, w.shape[1])
            padded[:, :self.nope] = heads[:, :self.nope]
            padded[:, D:D + self.v_dim] = heads[:, self.nope:]
            self._padded = (key, padded.flatten(0, 1))
        return self._padded[1]

    def _pads_values(self, q: torch.Tensor) -> bool:
        """Whether the prefill expands with padded values (expand's pad_values): where the flash
        kernel runs the attention and the values fit the key width."""
        return self.v_dim <= self.nope + self.rope and flash_fits(q, self.v_dim)

    def _attend(self, q: torch.Tensor, latent: torch.Tensor, mask, causal: bool) -> torch.Tensor:
        """Expanded form. q: [B, T, H, D]; latent: [B, L, r + rope]; mask: [T, L] bool (True =
        attend), an attention bias (causal_lower_right) or None -> [B, T, H * v_dim]."""
        k, v = self.expand(latent)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, is_causal=causal,
                                           scale=self.scaling)
        return o.transpose(1, 2).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] whole sequences from position 0 -> [B, T, hidden]."""
        q_in, kv = self._project(x)
        return self.output(self._attend(self._query_from(q_in), self._latent_from(kv), None, causal=True), x)

    # -- engine step --------------------------------------------------------------------------

    def forward_batch(self, x: torch.Tensor, batch: ForwardBatch, cache: MLALayerCache) -> torch.Tensor:
        """x: [T_total, hidden]; batch: ForwardBatch; cache: MLALayerCache. Writes each new token's
        latent into its page, then attends over positions 0..context+new-1 of its sequence: decode
        and verify batches with equal new-token counts all at once in the absorbed form over the
        pages (hyla.ops.paged_mla_decode); otherwise sequences with one new token batched
        (absorbed), the others expanded in groups (prefix_attention.expansion_groups: one page
        gather and one up-projection a group), causal flash attention per sequence."""
        pre = self.step_pre(x)
        return self.step_post(self.step_core(pre, batch, cache), pre)

    # -- an engine step in three parts (hyla.models.prefill_program runs a prefill step so) ------

    # Whether `output` reads the layer input x (an output-gated variant's): step_pre then carries x.
    output_reads_input = False

    def step_pre(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T_total, hidden] -> (q_proj(x) or q_a_proj(x), kv_a_proj_with_mqa(x)[, x]): the
        token-wise part of a step (no pool, no batch)."""
        q_in, kv = self._project(x)  # one GEMM once packed
        return (q_in, kv, x) if self.output_reads_input else (q_in, kv)

    def step_core_like(self, pre) -> torch.Tensor:
        """An empty tensor shaped as step_core's output: [T_total, H * v_dim] in the model dtype."""
        return pre[0].new_empty(pre[0].shape[0], self.num_heads * self.v_dim)

    def step_post(self, attn: torch.Tensor, pre) -> torch.Tensor:
        """step_core's attention output [T_total, H * v_dim] -> the layer output [T_total, hidden]."""
        return self.output(attn, pre[2] if self.output_reads_input else None)

    def step_core(self, pre, batch: ForwardBatch, cache: MLALayerCache) -> torch.Tensor:
        """step_pre's tensors -> the attention output [T_total, H * v_dim]: the new latents
        written to their pages, the queries, the attention (forward_batch's docstring)."""
        q_in, kv = pre[0], pre[1]
        page_size = cache.kv.shape[1]
        w = batch.uniform_width
        batch.check_written_pages(page_size)
        dispatch.write_latents(kv, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cache.kv, batch.block_tables,
                               batch.positions, w if w is not None else batch.token_seq_ids(), kv_scale=cache.kv_scale)
        q = self._query_from(q_in)  # [T_total, H, D]
        if w is not None:  # no host -> device copies (CUDA-graph safe)
            # each query attends up to its own position: `positions` is that list already
            return self._absorbed(q, cache.kv, batch.block_tables, batch.positions, cache.kv_scale)
        out = q.new_empty(q.shape[0], self.num_heads * self.v_dim)
        rows, seqs = batch.single_token_rows()
        if rows.numel():
            out[rows] = self._absorbed(q[rows], cache.kv, batch.block_tables[seqs], batch.positions[rows],
                                       cache.kv_scale)
        cu = batch.cu_seqlens_list
        multi = [(n, ctx + new) for n, (new, ctx) in enumerate(zip(batch.seq_lens, batch.context_lens_list)) if new > 1]
        for group in expansion_groups(multi, self._bytes_per_position(q), page_size):
            if len(group) == 1:  # alone: attend_built may go a block of positions at a time
                n, L = group[0]
                pages = batch.context_pages(n, L, page_size)
                latents = functools.partial(self._cached_latents, cache, pages, dtype=q.dtype)
                out[cu[n]:cu[n + 1]] = self._attend_new(q[cu[n]:cu[n + 1]], L, latents)
                continue
            # several: their cached latents in one gather, back to back (exactly each sequence's
            # positions), one up-projection, and one attention call for them all
            # (prefix_attention.attend_packed): a prefill step of many prompts, a burst of
            # returning turns
            lat_rows, q_rows, q_bounds, k_bounds, host_bounds = batch.shared(
                ("mla_group", tuple(group), page_size), lambda b: _group_rows(b, group, page_size))
            k, v = self.expand(self._latents_at(cache, lat_rows, q.dtype)[None], pad_values=self._pads_values(q))
            o = attend_packed(q.index_select(0, q_rows), k[0].transpose(0, 1), v[0].transpose(0, 1), q_bounds,
                              k_bounds, host_bounds, self.scaling)  # [T_group, H, v_dim or wider]
            out.index_copy_(0, q_rows, o[..., :self.v_dim].flatten(-2))
        return out

    def _bytes_per_position(self, q: torch.Tensor) -> int:
        """What expanding one position builds: the up-projection's output, the concatenated key
        and a contiguous value, every head (with padded values: the up-projection's output alone)."""
        if self._pads_values(q):
            return q.element_size() * self.num_heads * 2 * (self.nope + self.rope)
        return q.element_size() * self.num_heads * (2 * self.nope + self.rope + 2 * self.v_dim)

    def _cached_latents(self, cache: MLALayerCache, pages: torch.Tensor, start: int, stop: int,
                        dtype: torch.dtype) -> torch.Tensor:
        """The cached latents of positions start..stop-1 of a sequence whose pages are `pages`
        -> [stop - start, r + rope] (FP8 latents dequantised to dtype). Only the pages holding
        them are gathered: at a long context a block's, not the whole context's."""
        page_size = cache.kv.shape[1]
        first, last = start // page_size, -(-stop // page_size)
        rows = slice(start - first * page_size, stop - first * page_size)
        lat = cache.kv[pages[first:last]].flatten(0, 1)[rows]
        if cache.kv_scale is not None:  # FP8 latents: the rows in the model dtype
            lat = kv_fp8.dequantize_rows(lat, cache.kv_scale[pages[first:last]].flatten(0, 1)[rows],
                                         kv_fp8.latent_groups(self.kv_lora_rank, self.rope), dtype)
        return lat

    def _latents_at(self, cache: MLALayerCache, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The cached latents at flat pool rows (page * page_size + offset) [n] -> [n, r + rope]
        (FP8 latents dequantised to dtype)."""
        lat = cache.kv.flatten(0, 1).index_select(0, rows)
        if cache.kv_scale is not None:
            lat = kv_fp8.dequantize_rows(lat, cache.kv_scale.flatten(0, 1).index_select(0, rows),
                                         kv_fp8.latent_groups(self.kv_lora_rank, self.rope), dtype)
        return lat

    def output(self, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """attn: [..., H * v_dim] attention output, x: the layer input [..., hidden] -> o_proj(attn)
        (the hook an output-gated variant overrides, hyla.layers.gated_mla)."""
        return self.o_proj(attn)

    def _attend_new(self, q: torch.Tensor, L: int, latents) -> torch.Tensor:
        """Expanded form for the new tokens of one sequence. q: [T, H, D] (positions L-T..L-1);
        latents(start, stop): the latents of positions start..stop-1 [stop - start, r + rope]
        -> [T, H * v_dim] (hyla.layers.prefix_attention: causal over the prefix and themselves,
        no [T, L] mask built where the kernel can avoid it; at long contexts the latents are
        gathered and expanded a block of positions at a time)."""
        pad = self._pads_values(q)
        o = attend_built(q.transpose(0, 1)[None], lambda start, stop: self.expand(latents(start, stop)[None], pad),
                         L - q.shape[0], self._bytes_per_position(q), self.scaling)  # k [1, H, n, nope + rope], v [1, H, n, v]
        return o[0, ..., :self.v_dim].transpose(0, 1).flatten(-2)

    def _absorbed(self, q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, last: torch.Tensor,
                  kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Absorbed form (queries meet the cached latents directly; kv_b_proj folded into them).
        q: [N, H, nope + rope], W = N / S consecutive query tokens of each of S sequences;
        kv: [num_pages, page_size, r + rope]; tables: [S, P] page ids; last: [N] the last
        position each query attends to; kv_scale: FP8 latents' scales or None -> [N, H * v_dim]
        in q's dtype."""
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, self.nope + self.v_dim))  # [H, nope+v, r]
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [N, H, r]
        return dispatch.paged_mla_decode(q_lat, q_pe, kv, tables, last, w_uv, self.scaling, kv_scale=kv_scale)


def _group_rows(batch: ForwardBatch, group: list[tuple[int, int]], page_size: int):
    """For sequences `group` [(index n, positions L)] of a step, attended together: the flat pool
    rows of their L cached-or-new positions back to back [sum L], their query rows in the packed
    step [sum new], the cumulative query and key counts [S + 1] (int32 on the device, and on the
    host), once a step for every MLA layer (one transfer each)."""
    tables = batch.host_block_tables()
    cu, lat, q_rows = batch.cu_seqlens_list, [], []
    for n, L in group:
        batch.context_pages(n, L, page_size)  # its check: a page for every position
        pages = torch.tensor(tables[n][:-(-L // page_size)], dtype=torch.long)
        lat.append((pages[:, None] * page_size + torch.arange(page_size)).flatten()[:L])
        q_rows.append(torch.arange(cu[n], cu[n + 1]))
    q_bounds = [0, *itertools.accumulate(cu[n + 1] - cu[n] for n, _ in group)]
    k_bounds = [0, *itertools.accumulate(L for _, L in group)]
    dev = batch.block_tables.device
    lat_rows, rows = stage_long([torch.cat(lat), torch.cat(q_rows)], dev)
    q_dev, k_dev = stage_long([q_bounds, k_bounds], dev, dtype=torch.int32)
    return lat_rows, rows, q_dev, k_dev, (q_bounds, k_bounds)
