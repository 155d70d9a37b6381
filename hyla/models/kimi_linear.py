"""Kimi-Linear: KDA and NoPE-MLA layers (3:1 in the released model), dense / MoE MLPs.

Module names mirror the HF checkpoint, so `state_dict()` keys are the official tensor names:
model.embed_tokens, model.layers.{i}.{input_layernorm, self_attn, post_attention_layernorm,
mlp (dense) | block_sparse_moe (MoE)}, model.norm, lm_head.

Two ways to run it (hyla.models.base.HybridForCausalLM):
- `model(input_ids [B, T]) -> logits [B, T, V]`: whole sequences, no cache;
- `model.forward_batch(input_ids [T_total], batch, cache) -> hidden [T_total, hidden]`, then
  `model.compute_logits(hidden[rows])`: one engine step over the pools of `allocate_cache`.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.contract import ForwardBatch, HybridCache, KDALayerCache, LayerCache, MLALayerCache, state_pool
from hyla.layers.kda import KimiDeltaAttention
from hyla.layers.mla import MLAAttention
from hyla.layers.mlp import MLP
from hyla.layers.moe import MoE
from hyla.layers.norm import RMSNorm
from hyla.models.base import HybridForCausalLM
from hyla.models.config import LINEAR, SPARSE, KimiLinearConfig
from hyla.ops import kv_fp8


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += ffn(norm(h)). h: [..., hidden]."""

    def __init__(self, config: KimiLinearConfig, idx: int):
        super().__init__()
        c = config
        self.is_linear = c.layer_types[idx] == LINEAR
        if self.is_linear:
            self.self_attn = KimiDeltaAttention(
                c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.conv_kernel_size,
                lower_bound=c.gate_lower_bound, full_rank_gate=c.use_full_rank_gate, norm_eps=c.rms_norm_eps,
            )
        else:
            self.self_attn = MLAAttention(
                c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                c.v_head_dim, q_lora_rank=c.q_lora_rank, bias=c.attention_bias,
            )
        self.is_sparse = c.mlp_layer_types[idx] == SPARSE  # the official names: block_sparse_moe / mlp
        if self.is_sparse:
            self.block_sparse_moe = MoE(
                c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_token,
                num_shared_experts=c.num_shared_experts, num_group=c.num_expert_group, topk_group=c.topk_group,
                renormalize=c.moe_renormalize, routed_scaling_factor=c.routed_scaling_factor,
            )
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    @property
    def token_mixer(self) -> nn.Module:
        return self.self_attn

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if self.is_sparse else self.mlp(x)

    def forward(self, h: torch.Tensor, batch: ForwardBatch | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        x = self.input_layernorm(h)
        a = self.self_attn(x) if batch is None else self.self_attn.forward_batch(x, batch, cache)
        x, h = self.post_attention_layernorm.add_forward(a, h)  # h += attn: one fused launch on CUDA
        return h + self.ffn(x)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch | None = None,
                         cache: LayerCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same block with the residual adds fused into the norms, for a loop over layers
        (KimiLinearModel.forward_layers): the layer's input is residual + x (residual None: x),
        returns (ffn output, residual) whose sum is forward(residual + x)."""
        x, h = self.input_layernorm.add_forward(x, residual)
        a = self.self_attn(x) if batch is None else self.self_attn.forward_batch(x, batch, cache)
        x, h = self.post_attention_layernorm.add_forward(a, h)
        return self.ffn(x), h


class KimiLinearModel(nn.Module):
    def __init__(self, config: KimiLinearConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward_layers(self, h: torch.Tensor, batch: ForwardBatch | None = None,
                       caches: list[LayerCache] | None = None) -> torch.Tensor:
        """Embeddings h -> final-norm hidden states: every layer then self.norm, each residual add
        fused into the next norm (one launch per norm on CUDA). Equal to applying the layers one
        by one and then self.norm. caches: the per-layer caches (an engine step) or None."""
        x, res = h, None
        for i, layer in enumerate(self.layers):
            x, res = layer.forward_residual(x, res, batch, None if caches is None else caches[i])
        return self.norm.add_forward(x, res)[0]


class KimiLinearForCausalLM(HybridForCausalLM):
    piecewise_prefill = True  # prefill steps as spans and cores (hyla.models.prefill_program)

    def __init__(self, config: KimiLinearConfig):
        super().__init__()
        self.config = config
        self.model = KimiLinearModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def allocate_cache(self, num_slots: int, num_pages: int, page_size: int = 16,
                       state_dtype: torch.dtype = torch.float32, device=None, dtype=None,
                       kv_cache_dtype: str | None = None) -> HybridCache:
        """Zeroed pools (kda_mla_pools); dtype / device / kv_cache_dtype default to the model's."""
        self._check_pool_sizes(num_slots, num_pages, page_size)
        return kda_mla_pools(self.config, num_slots, num_pages, page_size, state_dtype,
                             self.device if device is None else device, self.dtype if dtype is None else dtype,
                             fp8=self._kv_fp8(kv_cache_dtype))


def kda_mla_pools(c, num_slots: int, num_pages: int, page_size: int, state_dtype: torch.dtype,
                  device, dtype: torch.dtype, fp8: bool = False) -> HybridCache:
    """The pools of a KDA + MLA layer stack (Kimi-Linear, Kimi K3): per KDA layer a state
    [num_slots, H, K, K] (state_dtype) and three conv windows [num_slots, H*K, W-1] (dtype); per
    MLA layer latents [num_pages, page_size, kv_lora_rank + qk_rope_head_dim] (dtype; with fp8
    e4m3 and their scales [num_pages, page_size, 2 | 1], hyla.ops.kv_fp8)."""
    d, kk, w = c.linear_num_heads * c.linear_head_dim, c.linear_head_dim, c.conv_kernel_size - 1
    layers = []
    for kind in c.layer_types:
        if kind == LINEAR:
            state = state_pool(num_slots, c.linear_num_heads, kk, kk, state_dtype, device)
            conv = tuple(torch.zeros(num_slots, d, w, dtype=dtype, device=device) for _ in range(3))
            layers.append(KDALayerCache(state, conv))
        elif fp8:
            kv, scale = kv_fp8.paged_pair((num_pages, page_size, c.kv_lora_rank + c.qk_rope_head_dim),
                                          kv_fp8.latent_groups(c.kv_lora_rank, c.qk_rope_head_dim), device)
            layers.append(MLALayerCache(kv, kv_scale=scale))
        else:
            kv = torch.zeros(num_pages, page_size, c.kv_lora_rank + c.qk_rope_head_dim, dtype=dtype, device=device)
            layers.append(MLALayerCache(kv))
    return HybridCache(layers, num_slots, num_pages, page_size)
