"""What every hybrid causal LM in hyla shares (Kimi-Linear, Qwen3-Next): the model <-> engine API.

A family subclasses HybridForCausalLM, builds `self.config`, `self.model` (embed_tokens, layers,
norm, and `forward_layers(h, batch=None, caches=None)`: every layer then the final norm, the
residual adds fused into the norms) and `self.lm_head` in its __init__, and implements
`allocate_cache`.

- `model(input_ids [B, T]) -> logits [B, T, V]`: whole sequences, no cache;
- `model.forward_batch(input_ids [T_total], batch, cache) -> hidden [T_total, hidden]`, then
  `model.compute_logits(hidden[rows])`: one engine step over the pools of `allocate_cache`;
- `commit_replay`, `state_bytes_per_slot`, `kv_bytes_per_token`, `weight_bytes`, `memory_report`.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.contract import ForwardBatch, HybridCache
from hyla.models import memory
from hyla.ops import kv_fp8


class LanguageModelHolder(nn.Module):
    """`model` of a multimodal checkpoint layout (Qwen3.5, GLM-5-Next): the text model under
    `language_model` (its tensors are model.language_model.*; the vision tower is not built),
    seen by HybridForCausalLM through the attributes a text model has. Subclasses name the text
    model's class in `text_model_cls`."""

    text_model_cls: type[nn.Module]

    def __init__(self, config):
        super().__init__()
        self.language_model = self.text_model_cls(config)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def norm(self) -> nn.Module:
        return self.language_model.norm

    def forward_layers(self, h: torch.Tensor, batch: ForwardBatch | None = None, caches=None) -> torch.Tensor:
        """h: [..., hidden] embeddings -> final-norm hidden states (the text model's forward_layers)."""
        return self.language_model.forward_layers(h, batch, caches)


class HybridForCausalLM(nn.Module):
    config: object
    model: nn.Module
    lm_head: nn.Linear
    # How attention KV pages are stored (EngineConfig.kv_cache_dtype, which the engine sets here
    # before it sizes the pools): "auto" = the model dtype, "fp8" / "fp8_e4m3" = e4m3 with per-token
    # scales (hyla.ops.kv_fp8). allocate_cache and kv_bytes_per_token read it unless given one.
    kv_cache_dtype: str = "auto"

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, T] int64, whole sequences from position 0 -> logits [B, T, V] fp32."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        h = self.model.embed_tokens(input_ids)
        return self.compute_logits(self.model.forward_layers(h))  # residual adds fused into the norms

    def forward_batch(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        """input_ids: [T_total] new tokens of batch's sequences, packed -> final-norm hidden
        states [T_total, hidden]. Reads and writes `cache` at batch.state_slots / block_tables."""
        if input_ids.ndim != 1 or input_ids.shape[0] != batch.num_tokens:
            raise ValueError(f"input_ids must be [T_total={batch.num_tokens}], got {tuple(input_ids.shape)}")
        if len(cache.layers) != len(self.model.layers):
            raise ValueError(f"cache has {len(cache.layers)} layers, the model {len(self.model.layers)}")
        h = self.model.embed_tokens(input_ids)
        return self.model.forward_layers(h, batch, cache.layers)

    def prepare_for_inference(self) -> None:
        """Run once the weights are in place (the loader and the benches' random models call it):
        each submodule with a `prepare_for_inference` method may pack its weights for fast
        inference (e.g. one GEMM over several projections). The official tensor names stay in
        `state_dict()`."""
        for module in self.modules():
            if module is not self and hasattr(module, "prepare_for_inference"):
                module.prepare_for_inference()

    def commit_replay(self, cache: HybridCache, accepted: list[int] | torch.Tensor) -> None:
        """After a verify step with rollback "replay": advance every linear layer's state by the
        first accepted[n] verified tokens of each sequence (see ShortConvDeltaRule.commit_replay).
        Each layer whose cache holds replay inputs (LayerCache.replay_inputs) commits them."""
        for layer, layer_cache in zip(self.model.layers, cache.layers):
            if layer_cache.replay_inputs() is not None:  # only a stateful layer's verify keeps them
                layer.token_mixer.commit_replay(layer_cache, accepted)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden] final-norm states -> [..., V] fp32 (lm_head in the model dtype)."""
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden] final-norm states -> [...] int64, the argmax of compute_logits
        (an MTP head's greedy drafts), without the fp32 copy of the logits: widening the model
        dtype to fp32 is exact, so the argmax is the same, ties included."""
        return self.lm_head(hidden).argmax(-1)

    def allocate_cache(self, num_slots: int, num_pages: int, page_size: int = 16,
                       state_dtype: torch.dtype = torch.float32, device=None, dtype=None,
                       kv_cache_dtype: str | None = None) -> HybridCache:
        """Zeroed pools; kv_cache_dtype None = self.kv_cache_dtype (FP8 pages: hyla.ops.kv_fp8)."""
        raise NotImplementedError

    def _kv_fp8(self, kv_cache_dtype: str | None) -> bool:
        """Whether attention pages are FP8 (kv_cache_dtype, or the model's when None)."""
        return kv_fp8.is_fp8_kv(self.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype)

    def load_mtp_head(self, path, shard=None) -> nn.Module | None:
        """The checkpoint's multi-token-prediction head for this model (loaded from `path`, the
        checkpoint this model was loaded from; shard: the rank's tensor-parallel plan), in the
        family's own layout; None for a family without one (the default). Speculative method
        "mtp" (hyla.engine.spec.mtp) loads it through here."""
        return None

    @staticmethod
    def _check_pool_sizes(num_slots: int, num_pages: int, page_size: int) -> None:
        for name, value in (("num_slots", num_slots), ("num_pages", num_pages), ("page_size", page_size)):
            if not isinstance(value, int) or value < (0 if name != "page_size" else 1):
                raise ValueError(f"{name} must be a non-negative integer (page_size >= 1), got {value!r}")

    def state_bytes_per_slot(self, state_dtype: torch.dtype = torch.float32) -> int:
        """Bytes one state slot takes across all linear layers: recurrent state + conv windows."""
        return memory.state_bytes_per_slot(self.config, state_dtype, self.dtype)

    def kv_bytes_per_token(self, kv_cache_dtype: str | None = None) -> int:
        """Bytes of cached KV per token across all attention layers (kv_cache_dtype None: the
        model's; FP8 pages count their scales)."""
        return memory.kv_bytes_per_token(self.config, self.dtype, self._kv_name(kv_cache_dtype))

    def _kv_name(self, kv_cache_dtype: str | None) -> str:
        return kv_fp8.check_kv_cache_dtype(self.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype)

    def weight_bytes(self) -> int:
        """Bytes of the checkpoint's tensors as loaded (tied tensors once; derived buffers such as
        RoPE frequencies, which are not in the checkpoint, not counted)."""
        seen = {}
        for t in self.state_dict(keep_vars=True).values():
            seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    def memory_report(self, state_dtype: torch.dtype = torch.float32) -> memory.MemoryReport:
        return memory.memory_report(self.config, self.dtype, state_dtype, weight_bytes=self.weight_bytes(),
                                    kv_cache_dtype=self._kv_name(None))
