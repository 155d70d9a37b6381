"""Qwen3-Next: Gated DeltaNet and gated full-attention layers (3:1 in the released model), MoE
(softmax router, shared expert with a sigmoid gate) or dense MLPs.

Module names mirror the HF checkpoint, so `state_dict()` keys are the official tensor names:
model.embed_tokens, model.layers.{i}.{input_layernorm, linear_attn (GDN) | self_attn (attention),
post_attention_layernorm, mlp}, model.norm, lm_head. Every RMSNorm outside the GDN output norm is
zero-centred (weight stored as w, applied as 1 + w).

The released checkpoints also hold a multi-token-prediction head (`mtp.*`); like transformers,
hyla does not build it and the loader skips those tensors.

Runs through the same API as every hyla model (hyla.models.base.HybridForCausalLM):
`model(input_ids [B, T])`, `forward_batch` over the pools of `allocate_cache`, `commit_replay`.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.contract import ForwardBatch, GDNLayerCache, HybridCache, KVLayerCache, LayerCache, state_pool
from hyla.layers.attention import GatedAttention
from hyla.layers.gdn import GatedDeltaNet
from hyla.layers.mlp import MLP
from hyla.layers.norm import ZeroCentredRMSNorm
from hyla.layers.qwen_moe import Qwen3NextSparseMoE
from hyla.models.base import HybridForCausalLM
from hyla.models.config import LINEAR, SPARSE
from hyla.models.qwen3_next_config import Qwen3NextConfig
from hyla.ops import kv_fp8


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm block: h += mixer(norm(h)); h += mlp(norm(h)). h: [..., hidden]."""

    linear_attn_cls = GatedDeltaNet  # Qwen3.5 swaps in its split-projection GDN

    def __init__(self, config: Qwen3NextConfig, idx: int):
        super().__init__()
        c = config
        self.is_linear = c.layer_types[idx] == LINEAR
        if self.is_linear:
            self.linear_attn = self.linear_attn_cls(
                c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                c.linear_value_head_dim, c.linear_conv_kernel_dim, norm_eps=c.rms_norm_eps,
            )
        else:
            self.self_attn = GatedAttention(
                c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                partial_rotary_factor=c.partial_rotary_factor, rope_theta=c.rope_theta, bias=c.attention_bias,
                norm_eps=c.rms_norm_eps,
            )
        if c.mlp_layer_types[idx] == SPARSE:
            self.mlp = Qwen3NextSparseMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                                          c.num_experts_per_tok, c.shared_expert_intermediate_size,
                                          norm_topk_prob=c.norm_topk_prob)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)

    @property
    def token_mixer(self) -> nn.Module:
        return self.linear_attn if self.is_linear else self.self_attn

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP or sparse MoE (hyla.models.prefill_program's name for it)."""
        return self.mlp(x)

    def forward(self, h: torch.Tensor, batch: ForwardBatch | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        x = self.input_layernorm(h)
        mixer = self.token_mixer
        a = mixer(x) if batch is None else mixer.forward_batch(x, batch, cache)
        x, h = self.post_attention_layernorm.add_forward(a, h)  # h += mixer: one fused launch on CUDA
        return h + self.mlp(x)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch | None = None,
                         cache: LayerCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same block with the residual adds fused into the norms (Qwen3NextModel.forward_layers):
        the layer's input is residual + x (residual None: x); returns (mlp output, residual)."""
        x, h = self.input_layernorm.add_forward(x, residual)
        mixer = self.token_mixer
        a = mixer(x) if batch is None else mixer.forward_batch(x, batch, cache)
        x, h = self.post_attention_layernorm.add_forward(a, h)
        return self.mlp(x), h


class Qwen3NextModel(nn.Module):
    decoder_layer_cls = Qwen3NextDecoderLayer

    def __init__(self, config: Qwen3NextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward_layers(self, h: torch.Tensor, batch: ForwardBatch | None = None,
                       caches: list[LayerCache] | None = None) -> torch.Tensor:
        """Embeddings h -> final-norm hidden states, each residual add fused into the next norm;
        equal to applying the layers one by one and then self.norm."""
        x, res = h, None
        for i, layer in enumerate(self.layers):
            x, res = layer.forward_residual(x, res, batch, None if caches is None else caches[i])
        return self.norm.add_forward(x, res)[0]


class Qwen3NextForCausalLM(HybridForCausalLM):
    piecewise_prefill = True  # prefill steps as spans and cores (hyla.models.prefill_program); Qwen3.5 too
    # Checkpoint tensors the model does not build (the MTP head), skipped by the loader.
    ignored_checkpoint_prefixes = ("mtp.",)
    base_model_cls = Qwen3NextModel  # what `self.model` is (a subclass per family)

    def __init__(self, config: Qwen3NextConfig):
        super().__init__()
        self.config = config
        self.model = self.base_model_cls(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_mtp_head(self, path, shard=None):
        """The `mtp.*` head Qwen3-Next and Qwen3.5 checkpoints ship (hyla.models.qwen3_5_mtp:
        ValueError when the checkpoint has none)."""
        from hyla.models.qwen3_5_mtp import load_mtp_head

        return load_mtp_head(path, self, shard=shard)

    def allocate_cache(self, num_slots: int, num_pages: int, page_size: int = 16,
                       state_dtype: torch.dtype = torch.float32, device=None, dtype=None,
                       kv_cache_dtype: str | None = None) -> HybridCache:
        """Zeroed pools: per Gated DeltaNet layer a state [num_slots, HV, K, V] (state_dtype) and
        one conv window [num_slots, 2*H*K + HV*V, W-1] (dtype); per attention layer keys and
        values, each [num_pages, page_size, Hkv, head_dim] (dtype; with FP8 pages e4m3 and a
        scale each per token and KV head, [num_pages, page_size, Hkv, 1], hyla.ops.kv_fp8).
        dtype / device / kv_cache_dtype default to the model's."""
        fp8 = self._kv_fp8(kv_cache_dtype)
        self._check_pool_sizes(num_slots, num_pages, page_size)
        c = self.config
        device = self.device if device is None else device
        dtype = self.dtype if dtype is None else dtype
        layers = []
        for kind in c.layer_types:
            if kind == LINEAR:
                state = state_pool(num_slots, c.linear_num_value_heads, c.linear_key_head_dim,
                                   c.linear_value_head_dim, state_dtype, device)
                conv = torch.zeros(num_slots, c.conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
                layers.append(GDNLayerCache(state, (conv,)))
            elif fp8:
                shape = (num_pages, page_size, c.num_key_value_heads, c.head_dim)
                (k, k_scale), (v, v_scale) = (kv_fp8.paged_pair(shape, (c.head_dim,), device) for _ in range(2))
                layers.append(KVLayerCache(k, v, k_scale=k_scale, v_scale=v_scale))
            else:
                k, v = (torch.zeros(num_pages, page_size, c.num_key_value_heads, c.head_dim, dtype=dtype,
                                    device=device) for _ in range(2))
                layers.append(KVLayerCache(k, v))
        return HybridCache(layers, num_slots, num_pages, page_size)
