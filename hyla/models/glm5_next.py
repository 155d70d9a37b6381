"""GLM-5-Next (GLM-5.3-Flash) text model: KDA (safe gate) and DSA-indexed NoPE-MLA layers, mHC
hyper-connections around every block, dense first layers then MoE with clamped SwiGLU.

Module names mirror the checkpoint transformers' `save_pretrained` writes (the released layout),
so `state_dict()` keys are the official tensor names: model.language_model.embed_tokens,
model.language_model.layers.{i}.{hc_attn_fn, hc_attn_base, hc_attn_scale, input_layernorm,
self_attn (KDA: q/k/v_proj, q/k/v_conv1d, f_a_proj, f_b_proj, dt_bias, A_log [H], b_proj,
g_a_proj, g_b_proj, o_norm, o_proj | DSA: hyla.layers.dsa), hc_ffn_*, post_attention_layernorm,
mlp}, model.language_model.norm, lm_head. transformers renames some of them in memory
(forget_gate.*, attn_hc.*, one fused conv1d; Glm5NextConfig.TRANSFORMERS_NAMES); the vision
tower (model.visual.*) is not built and its tensors are skipped.

Residual stream: hc_mult streams per token ([..., m, hidden], hyla.layers.mhc); each block reads
their mix and writes back through the Sinkhorn-constrained combination; the final hidden state is
norm(mean of the streams).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hyla.contract import (DSALayerCache, ForwardBatch, HybridCache, KDALayerCache, LayerCache, MLALayerCache,
                           state_pool)
from hyla.layers.clamped_swiglu import ClampedMLP
from hyla.layers.dsa import DSAAttention, DSAIndexer
from hyla.layers.kda import KimiDeltaAttention
from hyla.layers.mhc import HyperConnection, expand_streams, hc_head
from hyla.layers.moe import MoE
from hyla.layers.norm import RMSNorm
from hyla.models import memory
from hyla.models.base import HybridForCausalLM, LanguageModelHolder
from hyla.models.config import LINEAR, SPARSE
from hyla.models.glm5_next_config import FULL_INDEXER, Glm5NextConfig
from hyla.models.glm5_next_memory import indexer_bytes_per_token
from hyla.ops import kv_fp8

log = logging.getLogger(__name__)


class Glm5NextDecoderLayer(nn.Module):
    """h: [..., m, hidden] streams -> the same; `selections` carries the DSA selection of the
    latest full indexer layer to the shared layers after it."""

    def __init__(self, config: Glm5NextConfig, idx: int):
        super().__init__()
        c = config
        self.is_linear = c.layer_types[idx] == LINEAR
        if self.is_linear:
            self.self_attn = KimiDeltaAttention(
                c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim,
                lower_bound=c.linear_lower_bound, norm_eps=c.rms_norm_eps, a_log_shape=(c.linear_num_heads,),
            )
        else:
            indexer = None
            if c.indexer_types[idx] == FULL_INDEXER:
                indexer = DSAIndexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim,
                                     c.index_kpool, c.index_topk, c.index_kpool_always_select_tail)
            self.self_attn = DSAAttention(c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim,
                                          c.v_head_dim, c.q_lora_rank, indexer, bias=c.attention_bias,
                                          norm_eps=c.rms_norm_eps)
        if c.mlp_layer_types[idx] == SPARSE:
            self.mlp = MoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                           num_shared_experts=c.n_shared_experts, num_group=c.n_group, topk_group=c.topk_group,
                           renormalize=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor,
                           swiglu_limit=c.swiglu_limit)
        else:
            self.mlp = ClampedMLP(c.hidden_size, c.intermediate_size, c.swiglu_limit)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc = HyperConnection(c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = HyperConnection.new_parameters(c.hc_mult, c.hidden_size)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = HyperConnection.new_parameters(c.hc_mult, c.hidden_size)

    @property
    def token_mixer(self) -> nn.Module:
        return self.self_attn

    def _mix(self, x: torch.Tensor, batch: ForwardBatch | None, cache: LayerCache | None, selections: dict):
        if self.is_linear:
            return self.self_attn(x) if batch is None else self.self_attn.forward_batch(x, batch, cache)
        if batch is None:
            out, selections["latest"] = self.self_attn(x, selections.get("latest"))
        else:
            out, selections["latest"] = self.self_attn.forward_batch(x, batch, cache, selections.get("latest"))
        return out

    def forward(self, h: torch.Tensor, batch: ForwardBatch | None = None, cache: LayerCache | None = None,
                selections: dict | None = None) -> torch.Tensor:
        selections = {} if selections is None else selections
        post, comb, x = self.hc.pre(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        a = self._mix(self.input_layernorm(x), batch, cache, selections)
        h = self.hc.post(a, post, comb, h)
        post, comb, x = self.hc.pre(h, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        return self.hc.post(self.mlp(self.post_attention_layernorm(x)), post, comb, h)


class Glm5NextTextModel(nn.Module):
    def __init__(self, config: Glm5NextConfig):
        super().__init__()
        self.hc_mult = config.hc_mult
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward_layers(self, h: torch.Tensor, batch: ForwardBatch | None = None,
                       caches: list[LayerCache] | None = None) -> torch.Tensor:
        """Embeddings h [..., hidden] -> final-norm hidden states [..., hidden]. A shared DSA
        layer reuses the selection of the nearest earlier full one (carried in `selections`)."""
        streams, selections = expand_streams(h, self.hc_mult), {}
        for i, layer in enumerate(self.layers):
            streams = layer(streams, batch, None if caches is None else caches[i], selections)
        return self.norm(hc_head(streams))


class Glm5NextModel(LanguageModelHolder):
    """The checkpoint's `model.` level: `language_model` (the text model; the vision tower is
    not built)."""

    text_model_cls = Glm5NextTextModel


class Glm5NextForCausalLM(HybridForCausalLM):
    # The vision tower (text serving only) and, as transformers skips them, the released
    # checkpoint's multi-token-prediction layer 45 (with its shared_head). A config with more than
    # 45 layers would then miss layer 45's tensors: the loader names them, nothing loads silently.
    ignored_checkpoint_prefixes = ("model.visual.", "model.language_model.layers.45.")

    def __init__(self, config: Glm5NextConfig):
        super().__init__()
        self.config = config
        self.model = Glm5NextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.has_vision:  # once per model built (the loader builds one)
            log.info("glm5_next: serving the text model; the vision tower's weights (model.visual.*) are skipped")

    def kv_bytes_per_token(self, kv_cache_dtype: str | None = None) -> int:
        """MLA latents plus the indexer's per-token rows and pooled keys (hyla.models.glm5_next_memory;
        with FP8 pages the latents are e4m3 with a scale per token, the indexer's rows stay in the
        model dtype)."""
        return (memory.kv_bytes_per_token(self.config, self.dtype, self._kv_name(kv_cache_dtype))
                + indexer_bytes_per_token(self.config, self.dtype))

    def allocate_cache(self, num_slots: int, num_pages: int, page_size: int = 16,
                       state_dtype: torch.dtype = torch.float32, device=None, dtype=None,
                       kv_cache_dtype: str | None = None) -> HybridCache:
        """Zeroed pools: per KDA layer a state [num_slots, H, K, K] (state_dtype) and three conv
        windows [num_slots, H*K, W-1]; per indexed layer latents [num_pages, page_size,
        kv_lora_rank], and with a full indexer also index_tokens [num_pages, page_size, 2D] and
        index_pooled [num_pages, page_size // kpool, D], under the same page ids (dtype). With FP8
        pages (kv_cache_dtype, default the model's) the latents are e4m3 with one scale per token,
        kv_scale [num_pages, page_size, 1] (hyla.ops.kv_fp8); the indexer's rows keep the dtype.
        page_size must be a multiple of index_kpool, so that a page holds whole pools."""
        fp8 = self._kv_fp8(kv_cache_dtype)
        self._check_pool_sizes(num_slots, num_pages, page_size)
        c = self.config
        if page_size % c.index_kpool:
            raise ValueError(f"page_size ({page_size}) must be a multiple of index_kpool ({c.index_kpool})")
        device = self.device if device is None else device
        dtype = self.dtype if dtype is None else dtype
        d, kk, w = c.linear_num_heads * c.linear_head_dim, c.linear_head_dim, c.linear_conv_kernel_dim - 1
        layers = []
        for i, kind in enumerate(c.layer_types):
            if kind == LINEAR:
                state = state_pool(num_slots, c.linear_num_heads, kk, kk, state_dtype, device)
                conv = tuple(torch.zeros(num_slots, d, w, dtype=dtype, device=device) for _ in range(3))
                layers.append(KDALayerCache(state, conv))
                continue
            if fp8:
                kv, scale = kv_fp8.paged_pair((num_pages, page_size, c.kv_lora_rank),
                                              kv_fp8.latent_groups(c.kv_lora_rank, 0), device)
            else:
                kv, scale = torch.zeros(num_pages, page_size, c.kv_lora_rank, dtype=dtype, device=device), None
            if c.indexer_types[i] != FULL_INDEXER:
                layers.append(MLALayerCache(kv, kv_scale=scale))
                continue
            di = c.index_head_dim
            tokens = torch.zeros(num_pages, page_size, 2 * di, dtype=dtype, device=device)
            pooled = torch.zeros(num_pages, page_size // c.index_kpool, di, dtype=dtype, device=device)
            layers.append(DSALayerCache(kv, tokens, pooled, kv_scale=scale))
        return HybridCache(layers, num_slots, num_pages, page_size)
