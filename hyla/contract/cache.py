"""The pools a hybrid model reads and writes during `forward_batch` (hyla.contract).

Every layer cache is a LayerCache; two kinds, told apart by their base class (HybridCache counts
every LinearLayerCache as linear and every PagedLayerCache as attention):

- LinearLayerCache (KDA, Gated DeltaNet): a recurrent state slot pool `[num_slots, HV, K, V]`
  (fp32 by default, the delta rule accumulates into it every token; stored K-last, see
  `state_pool`) and one conv window pool per
  short conv, `[num_slots, D, W-1]`: the last W-1 pre-conv inputs, oldest first (model dtype).
  KDA has three convs (q, k, v); Gated DeltaNet one, over the concatenated q|k|v channels.
- PagedLayerCache: tensors `[num_pages, page_size, ...]`, one row per token.
  MLA: one compressed latent per token, `[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`,
  shared by all heads; with a DSA indexer (DSALayerCache) also per-token indexer keys and one
  pooled key per kpool tokens, under the same page ids. Full attention (GQA): keys and values, each `[num_pages, page_size, Hkv, D]`.
  With FP8 pages (kv_cache_dtype "fp8", hyla.ops.kv_fp8) the latents / keys / values are
  float8_e4m3fn and each has a paged fp32 scale tensor beside it (MLA `kv_scale` [num_pages,
  page_size, groups], GQA `k_scale` / `v_scale` [num_pages, page_size, Hkv, 1]), listed in
  tensors() so that page copies and byte counts include them; without FP8 they are None.

Replay inputs: a speculative verify step with rollback "replay" leaves, on each cache whose layer
keeps state, the per-token inputs its layer's `commit_replay` needs afterwards. Whoever runs the
model reads and hands them back through `replay_inputs()` / `set_replay_inputs()` (the CUDA-graph
runner does: a captured step's inputs live in the graph's buffers); a cache without replay
inputs (every PagedLayerCache) answers None.

The model owns these shapes; the engine owns which request holds which slot / page.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def state_pool(num_slots: int, heads: int, K: int, V: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed recurrent state pool: shape [num_slots, heads, K, V] (the layout every op takes,
    fla's), stored K-last: the memory is [num_slots, heads, V, K] and this is its transposed view
    (strides (heads * V * K, V * K, 1, K)).

    Why K-last. A decode step reads and writes every live slot's states and nothing else of size,
    and the K reduction (S^T k, S^T q) must finish before a tile can be written back. With K
    contiguous, a tile of 16 value columns x K rows is one contiguous run of 16 * K * 4 bytes and
    its reduction stays inside one warp; with V contiguous the same tile is K strided 64-byte row
    pieces, which HBM serves at ~80% of copy bandwidth instead of ~94% (BENCHMARKS.md
    "Recurrent decode and verify"). Torch ops and the Triton kernels accept either layout;
    everything else indexes slots."""
    return torch.zeros(num_slots, heads, V, K, dtype=dtype, device=device).transpose(-1, -2)


def as_k_last(states: torch.Tensor) -> torch.Tensor:
    """states [..., K, V] -> the same values in K-last memory (state_pool's layout), a copy."""
    return states.transpose(-1, -2).contiguous().transpose(-1, -2)


class LayerCache:
    """The pools of one layer. Every tensor is indexed by slot (LinearLayerCache) or page
    (PagedLayerCache) on its first dim."""

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def replay_inputs(self) -> dict | None:
        """What the last "replay" verify step kept for `commit_replay` (None: nothing to commit)."""
        return None

    def set_replay_inputs(self, inputs: dict | None) -> None:
        """Hand back (or, with None, clear) the inputs `commit_replay` will read. A cache of a
        layer without state keeps none: only None is accepted."""
        if inputs is not None:
            raise ValueError(f"{type(self).__name__} keeps no replay inputs")


class LinearLayerCache(LayerCache):
    """A layer with per-request state: `state` [num_slots, HV, K, V] and `conv`, a tuple of
    [num_slots, D, W-1] windows; `replay` holds the per-token inputs of the last "replay" verify
    step (commit_replay). Every tensor is indexed by slot on its first dim."""

    state: torch.Tensor
    conv: tuple[torch.Tensor, ...]
    replay: dict | None

    def tensors(self) -> list[torch.Tensor]:
        return [self.state, *self.conv]

    def replay_inputs(self) -> dict | None:
        return self.replay

    def set_replay_inputs(self, inputs: dict | None) -> None:
        self.replay = inputs


class PagedLayerCache(LayerCache):
    """A layer with per-token rows in pages: every tensor is [num_pages, page_size, ...]."""

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """Copy the first `rows` token rows of page src into page dst (copy-on-write)."""
        for t in self.tensors():
            t[dst, :rows].copy_(t[src, :rows])


@dataclass
class KDALayerCache(LinearLayerCache):
    """state: [num_slots, H, K, V]; conv: (q, k, v) windows, each [num_slots, D, W-1]."""

    state: torch.Tensor
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    replay: dict | None = None  # per-token inputs of the last "replay" verify step (commit_replay)


@dataclass
class GDNLayerCache(LinearLayerCache):
    """state: [num_slots, HV, K, V]; conv: one window [num_slots, 2*H*K + HV*V, W-1] over the
    concatenated pre-conv q|k|v channels (Gated DeltaNet's single conv1d)."""

    state: torch.Tensor
    conv: tuple[torch.Tensor]
    replay: dict | None = None


@dataclass
class MLALayerCache(PagedLayerCache):
    """kv: [num_pages, page_size, kv_lora_rank + qk_rope_head_dim] latents (normed c_kv ++ k_pe);
    kv_scale: None, or with FP8 latents (kv e4m3) their scales [num_pages, page_size, groups] fp32
    (hyla.ops.kv_fp8: groups c and k_pe, or c alone without a positional part)."""

    kv: torch.Tensor
    kv_scale: torch.Tensor | None = field(default=None, kw_only=True)

    def tensors(self) -> list[torch.Tensor]:
        return [self.kv] if self.kv_scale is None else [self.kv, self.kv_scale]


@dataclass
class DSALayerCache(MLALayerCache):
    """An MLA layer with a DSA indexer (GLM-5-Next), all paged with one page table:
    kv: [num_pages, page_size, kv_lora_rank] latents; index_tokens: [num_pages, page_size, 2D]
    each token's indexer key ++ pooling logits (read until its pool of kpool tokens is complete);
    index_pooled: [num_pages, page_size // kpool, D] one pooled key per complete pool."""

    index_tokens: torch.Tensor
    index_pooled: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [*super().tensors(), self.index_tokens, self.index_pooled]

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """Token rows as MLALayerCache; pooled keys of the pools complete within those rows."""
        for t in (*super().tensors(), self.index_tokens):
            t[dst, :rows].copy_(t[src, :rows])
        pools = rows * self.index_pooled.shape[1] // self.kv.shape[1]
        self.index_pooled[dst, :pools].copy_(self.index_pooled[src, :pools])


@dataclass
class KVLayerCache(PagedLayerCache):
    """k, v: [num_pages, page_size, Hkv, D] (keys after their norm and RoPE; values); k_scale,
    v_scale: None, or with FP8 pages (k, v e4m3) one fp32 scale per token and KV head each,
    [num_pages, page_size, Hkv, 1] (hyla.ops.kv_fp8)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = field(default=None, kw_only=True)
    v_scale: torch.Tensor | None = field(default=None, kw_only=True)

    def tensors(self) -> list[torch.Tensor]:
        if self.k_scale is None:
            return [self.k, self.v]
        return [self.k, self.v, self.k_scale, self.v_scale]


class HybridCache:
    """Per-layer pools, indexed by the model's layer index (`layers[i]` is a LinearLayerCache for
    a linear layer, e.g. KDALayerCache, and a PagedLayerCache for an attention layer, e.g.
    MLALayerCache)."""

    def __init__(self, layers: list[LayerCache], num_slots: int, num_pages: int, page_size: int):
        self.layers = layers
        self.num_slots = num_slots
        self.num_pages = num_pages
        self.page_size = page_size

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    @property
    def linear_layers(self) -> list[LinearLayerCache]:
        return [c for c in self.layers if isinstance(c, LinearLayerCache)]

    @property
    def attention_layers(self) -> list[PagedLayerCache]:
        return [c for c in self.layers if isinstance(c, PagedLayerCache)]

    def _check_slot(self, name: str, slot: int) -> None:
        if not 0 <= int(slot) < self.num_slots:
            raise ValueError(f"{name} slot {slot} is outside 0..{self.num_slots - 1}")

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy every linear layer's recurrent state and conv windows from slot src to slot dst
        (e.g. restore a prefix checkpoint into a running request's slot, or fork a request)."""
        self._check_slot("src", src)
        self._check_slot("dst", dst)
        for layer in self.linear_layers:
            for t in layer.tensors():
                t[dst].copy_(t[src])

    def copy_page_rows(self, src: int, dst: int, rows: int) -> None:
        """Copy the first `rows` token rows of KV page src into page dst in every attention layer
        (copy-on-write of a partially shared page)."""
        for name, page in (("src", src), ("dst", dst)):
            if not 0 <= int(page) < self.num_pages:
                raise ValueError(f"{name} page {page} is outside 0..{self.num_pages - 1}")
        if not 0 <= rows <= self.page_size:
            raise ValueError(f"rows must lie in 0..{self.page_size}, got {rows}")
        for layer in self.attention_layers:
            layer.copy_rows(src, dst, rows)

    def zero_slot(self, slot: int) -> None:
        """Reset slot `slot` of every linear layer (forward_batch does not need this: a sequence
        with context_len 0 never reads its slot)."""
        self._check_slot("slot", slot)
        for layer in self.linear_layers:
            for t in layer.tensors():
                t[slot].zero_()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())
