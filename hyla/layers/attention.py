"""Gated full attention of Qwen3-Next (transformers' Qwen3NextAttention), over paged KV.

H query heads, Hkv key/value heads (GQA: query head h reads kv head h // (H / Hkv)), head dim D:

    q, gate = split_per_head(q_proj(x))        q_proj gives [H, D + D]: each head's q, then its gate
    q = RoPE(q_norm(q)), k = RoPE(k_norm(k_proj(x))), v = v_proj(x)
    o = softmax(q k^T * D^-1/2 + causal mask) v
    y = o_proj(o * sigmoid(gate))

q_norm / k_norm: zero-centred RMSNorm over D. RoPE is partial and in the rotate-half (NeoX)
layout: the first rotary_dim = int(D * partial_rotary_factor) channels of each head rotate, as
pairs (i, i + rotary_dim / 2), the rest pass through. The angles are computed exactly as
transformers does (fp32 inverse frequencies and positions, cos / sin cast to the input dtype), so
the fp32 logits match it; with fp64 weights they are still fp32-rounded angles, a fixed function
of the position, which batching and caching cannot change.

The paged pool (KVLayerCache) stores k after its norm and RoPE, and v: [num_pages, page_size,
Hkv, D] each. Tensor names: q_proj, k_proj, v_proj, o_proj, q_norm, k_norm.

`prepare_for_inference()` packs q_proj, k_proj and v_proj into one weight
(hyla.layers.delta_rule.PackedLinears; state_dict unchanged): one GEMM per step.

A decode or verify step on the Triton path (CUDA, no grad, not fp64: hyla.ops.dispatch.
gated_attention_kernels) runs everything between that GEMM and o_proj as two fused ops
(hyla.ops.paged_attention): norms, RoPE and the KV write in one launch, the paged attention and
the gate in one more (two past 512 keys). Elsewhere the torch code below runs.

FP8 pages (a KVLayerCache with k_scale / v_scale, kv_cache_dtype "fp8": hyla.ops.kv_fp8): each
new key head (normed, rotated, in the model dtype) and value head is stored in e4m3 with a
per-token scale, and every read dequantises the rows to the model dtype first, so the
attention below runs as over a cache in the model dtype (hyla.ops.dispatch gives the fused
kernels the scales).
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.contract import ForwardBatch, KVLayerCache
from hyla.layers.delta_rule import PackedLinears
from hyla.layers.norm import ZeroCentredRMSNorm
from hyla.layers.prefix_attention import attend_built
from hyla.ops import dispatch, kv_fp8
from hyla.ops.dtypes import work_dtype


class RotaryEmbedding(nn.Module):
    """Default RoPE on the first `rotary_dim` of head_dim channels.

    The inverse frequencies [rotary_dim / 2] are computed once, in fp32 on the CPU exactly as
    transformers does, and kept as a plain attribute rather than a buffer: they are not in the
    checkpoint, and neither meta-device construction nor `model.to(bf16)` may touch them. Their
    per-device tables (below) are made on first use (outside any CUDA-graph capture: the runner
    warms up first).

    The rotation runs over all head_dim channels at once, with no split and no concatenation
    (a handful of kernels, not a dozen):

        out = x * cos + x[..., perm] * sin

    with cos, sin [..., head_dim] (`cos_sin`): channel i < rotary_dim / 2 pairs with
    i + rotary_dim / 2 (perm swaps the two halves) and has its sin negated (rotate-half's -x2);
    the channels past rotary_dim have cos 1, sin 0 and perm the identity (x * 1 + x * 0 = x:
    they pass through, as long as x is finite). Every rotated channel is the product-and-sum
    transformers computes, in the same order and roundings."""

    def __init__(self, head_dim: int, partial_rotary_factor: float = 1.0, theta: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(f"rotary_dim = int(head_dim * partial_rotary_factor) must be even and >= 2, "
                             f"got {self.rotary_dim}")
        self.theta = theta
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device="cpu") / self.rotary_dim
        inv = 1.0 / (theta ** exponents)
        half, rest = self.rotary_dim // 2, head_dim - self.rotary_dim
        # per channel of a head: its inverse frequency (0 past rotary_dim: cos 1, sin 0), the sign
        # of its sin and the channel it pairs with
        cpu = {"device": "cpu"}  # not the meta device a model may be built under
        freq = torch.cat([inv, inv, torch.zeros(rest, **cpu)])
        sign = torch.cat([-torch.ones(half, **cpu), torch.ones(half + rest, **cpu)])
        perm = torch.cat([torch.arange(half, 2 * half, **cpu), torch.arange(half, **cpu),
                          torch.arange(2 * half, head_dim, **cpu)])
        self._tables = {torch.device("cpu"): (inv, freq, sign, perm)}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(inverse frequencies [rotary_dim / 2], per-channel frequency, sin sign [head_dim] fp32,
        pair index [head_dim] int64) on device."""
        if device not in self._tables:
            self._tables[device] = tuple(t.to(device) for t in self._tables[torch.device("cpu")])
        return self._tables[device]

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        return self.tables(device)[0]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [...] int -> cos, sin: [..., head_dim] in dtype (see the class docstring:
        sin signed, 1 / 0 past rotary_dim)."""
        _, freq, sign, _ = self.tables(positions.device)
        # int64 * fp32 promotes to fp32 inside the one kernel: float(position) * freq, as
        # transformers' fp32 positions times inverse frequencies
        p = positions[..., None]
        angles = (p if not p.is_floating_point() else p.float()) * freq
        return angles.cos().to(dtype), (angles.sin() * sign).to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [..., T, heads, head_dim]; cos, sin: [..., T, head_dim] (cos_sin) -> x with its first
        rotary_dim channels rotated."""
        perm = self.tables(x.device)[3]
        return x * cos.unsqueeze(-2) + x.index_select(-1, perm) * sin.unsqueeze(-2)


class GatedAttention(nn.Module):
    """x: [B, T, hidden] -> [B, T, hidden] (full causal sequences), or packed [T_total, hidden]
    with a ForwardBatch and a KVLayerCache (forward_batch)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 partial_rotary_factor: float = 1.0, rope_theta: float = 10000.0, bias: bool = False,
                 norm_eps: float = 1e-6):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = head_dim ** -0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(head_dim, eps=norm_eps)
        self.k_norm = ZeroCentredRMSNorm(head_dim, eps=norm_eps)
        self.rotary = RotaryEmbedding(head_dim, partial_rotary_factor, rope_theta)
        self._packed: PackedLinears | None = None

    def prepare_for_inference(self) -> None:
        """Pack q_proj, k_proj, v_proj into one weight (one GEMM per step); state_dict unchanged."""
        self._packed = PackedLinears([self.q_proj, self.k_proj, self.v_proj])

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [..., T, hidden] -> q [..., T, H, D], gate [..., T, H, D], k, v [..., T, Hkv, D]:
        views of the projections' outputs (one GEMM once packed), not normed or rotated."""
        return self._split(*self.step_pre(x))

    def _split(self, q_out: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections' outputs -> q, gate [..., T, H, D], k, v [..., T, Hkv, D] (views)."""
        q, gate = q_out.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        k = k_out.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v_out.unflatten(-1, (self.num_kv_heads, self.head_dim))
        return q, gate, k, v

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch | None = None):
        """x: [..., T, hidden]; positions: [..., T] -> q [..., T, H, D], k, v [..., T, Hkv, D]
        (q, k normed and rotated), gate [..., T, H * D]. batch: the engine step's, whose RoPE
        tables every attention layer of the step shares (computed once)."""
        return self._qkv_from(self._project(x), positions, batch)

    def _qkv_from(self, split: tuple[torch.Tensor, ...], positions: torch.Tensor, batch: ForwardBatch | None):
        """qkv's work after the projections (split: _split's q, gate, k, v)."""
        q, gate, k, v = split
        rope, dtype = self.rotary, q.dtype
        if batch is None:
            cos, sin = rope.cos_sin(positions, dtype)
        else:
            cos, sin = batch.shared(("rope", rope.head_dim, rope.rotary_dim, rope.theta, dtype),
                                    lambda b: rope.cos_sin(b.positions, dtype), per_token=True)
        qk = rope(torch.cat([self.q_norm(q), self.k_norm(k)], dim=-2), cos, sin)  # one rotation for both
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=-2)
        return q, k, v, gate.flatten(-2)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, H, D], the last T of L positions; k, v: [B, L, Hkv, D] -> [B, T, H * D], causal
        over the positions before them and among them (hyla.layers.prefix_attention; at long
        contexts each KV head is repeated for its query group a block of positions at a time)."""
        per_position = 2 * k.element_size() * self.num_heads * self.head_dim * q.shape[0]  # repeated k and v

        def heads(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:  # [B, H, n, D] each
            return tuple(t[:, start:stop].repeat_interleave(self.groups, dim=2).transpose(1, 2) for t in (k, v))
        o = attend_built(q.transpose(1, 2), heads, k.shape[1] - q.shape[1], per_position, self.scaling)
        return o.transpose(1, 2).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] whole sequences from position 0 -> [B, T, hidden]."""
        positions = torch.arange(x.shape[1], device=x.device)
        q, k, v, gate = self.qkv(x, positions)
        return self.o_proj(self._attend(q, k, v) * torch.sigmoid(gate))

    # -- engine step --------------------------------------------------------------------------

    def forward_batch(self, x: torch.Tensor, batch: ForwardBatch, cache: KVLayerCache) -> torch.Tensor:
        """x: [T_total, hidden]; batch: ForwardBatch; cache: KVLayerCache. Writes each new token's
        k, v into its page, then attends over positions 0..context+new-1 of its sequence: decode
        and verify batches with equal new-token counts all at once over their page windows;
        otherwise sequences with one new token batched, the others one by one with a causal mask
        offset by their context length."""
        pre = self.step_pre(x)
        return self.step_post(self.step_core(pre, batch, cache), pre)

    # -- an engine step in three parts (hyla.models.prefill_program runs a prefill step so) ------

    def step_pre(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T_total, hidden] -> (q_proj(x), k_proj(x), v_proj(x)): the token-wise part of a step
        (no pool, no batch; views of one GEMM's output once packed)."""
        if self._packed is not None:
            return tuple(self._packed(x))
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def step_core_like(self, pre) -> torch.Tensor:
        """An empty tensor shaped as step_core's output: [T_total, H * D] in the model dtype."""
        return pre[0].new_empty(pre[0].shape[0], self.num_heads * self.head_dim)

    def step_post(self, gated: torch.Tensor, pre) -> torch.Tensor:
        """step_core's gated attention output [T_total, H * D] -> o_proj of it [T_total, hidden]."""
        return self.o_proj(gated)

    def step_core(self, pre, batch: ForwardBatch, cache: KVLayerCache) -> torch.Tensor:
        """step_pre's projections -> the attention output times sigmoid(gate) [T_total, H * D]: q and
        k normed and rotated, k and v written to their pages, the attention (forward_batch's
        docstring)."""
        w = batch.uniform_width
        fp8 = cache.k_scale is not None
        if w is not None and dispatch.gated_attention_kernels(pre[0], cache.k, fp8):
            return self._fused_step(pre, batch, cache, w)
        q, k, v, gate = self._qkv_from(self._split(*pre), batch.positions, batch)  # [T_total, H | Hkv, D]
        page_size = cache.k.shape[1]
        rows = batch.kv_slot_mapping(page_size)
        if fp8:
            for pool, scales, t in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
                tq, ts = kv_fp8.quantize_rows(t, (self.head_dim,))
                pool.view(-1, self.num_kv_heads, self.head_dim)[rows] = tq
                scales.view(-1, self.num_kv_heads, 1)[rows] = ts
        else:
            cache.k.view(-1, self.num_kv_heads, self.head_dim)[rows] = k.to(cache.k.dtype)
            cache.v.view(-1, self.num_kv_heads, self.head_dim)[rows] = v.to(cache.v.dtype)
        if w is not None:  # no host -> device copies (CUDA-graph safe)
            out = self._windowed(q.unflatten(0, (batch.num_seqs, w)), cache, *batch.query_window(page_size))
            return out.flatten(0, 1).to(gate.dtype) * torch.sigmoid(gate)
        out = gate.new_empty(gate.shape[0], self.num_heads * self.head_dim)
        idx, _ = batch.single_token_rows()
        if idx.numel():
            out[idx] = self._windowed(q[idx][:, None], cache, *batch.decode_window(batch.single_token_seqs(), page_size)
                                      )[:, 0].to(out.dtype)
        cu = batch.cu_seqlens_list
        for n, (new, ctx) in enumerate(zip(batch.seq_lens, batch.context_lens_list)):
            if new <= 1:
                continue
            total = ctx + new
            pages = batch.context_pages(n, total, page_size)
            ks, vs = (t[pages].flatten(0, 1)[:total] for t in (cache.k, cache.v))  # [L, Hkv, D]
            if fp8:
                ks, vs = (kv_fp8.dequantize_rows(t, sc[pages].flatten(0, 1)[:total], (self.head_dim,), q.dtype)
                          for t, sc in ((ks, cache.k_scale), (vs, cache.v_scale)))
            out[cu[n]:cu[n + 1]] = self._attend(q[None, cu[n]:cu[n + 1]], ks[None], vs[None])[0]
        return out * torch.sigmoid(gate)

    def _fused_step(self, pre, batch: ForwardBatch, cache: KVLayerCache, w: int) -> torch.Tensor:
        """step_core for W new tokens per sequence on the Triton path (hyla.ops.paged_attention):
        one launch normalises and rotates q and k and writes k, v into the pages, one (two past
        512 keys) attends over each sequence's pages and applies the gate; no per-step tables,
        masks or gathered windows. pre: step_pre's projections of S * W tokens -> [S * W, H * D]."""
        q, gate, k, v = self._split(*pre)
        batch.check_written_pages(cache.k.shape[1])
        # FP8 pages: the same two ops with the pages' scales (None otherwise)
        q = dispatch.qk_norm_rope_write(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                        self.rotary.inv_freq(q.device), batch.positions, cache.k, cache.v,
                                        batch.block_tables, w, cache.k_scale, cache.v_scale)
        return dispatch.paged_window_attention(q, cache.k, cache.v, batch.block_tables, batch.context_lens,
                                               self.scaling, gate, cache.k_scale, cache.v_scale)

    def _windowed(self, q: torch.Tensor, cache: KVLayerCache, rows: torch.Tensor, masked: torch.Tensor,
                  unread: torch.Tensor) -> torch.Tensor:
        """W query tokens of each of S sequences over their page windows, batched.
        q: [S, W, H, D]; rows: [S, L] the windows' flat pool rows; masked: [S, W, L] which
        window tokens each query may not attend to; unread: [S, L] those no query attends to
        (ForwardBatch.query_window / decode_window) -> [S, W, H * D]."""
        ks, vs = (t.view(-1, *t.shape[2:])[rows] for t in (cache.k, cache.v))  # [S, L, Hkv, D]
        if cache.k_scale is not None:  # FP8 pages: the rows in the model dtype
            ks, vs = (kv_fp8.dequantize_rows(t, sc.view(-1, *sc.shape[2:])[rows], (self.head_dim,), q.dtype)
                      for t, sc in ((ks, cache.k_scale), (vs, cache.v_scale)))
        qg = q.unflatten(2, (self.num_kv_heads, self.groups))  # [S, W, Hkv, G, D]
        work = work_dtype(ks)  # softmax in >= fp32
        scores = torch.einsum("swkgd,sjkd->swkgj", qg, ks).to(work) * self.scaling  # [S, W, Hkv, G, L]
        probs = scores.masked_fill(masked[:, :, None, None, :], float("-inf")).softmax(-1).to(vs.dtype)
        vs = vs.masked_fill(unread[:, :, None, None], 0)  # rows past a length may hold anything (0 * NaN)
        return torch.einsum("swkgj,sjkd->swkgd", probs, vs).flatten(2)  # [S, W, H * D]
