"""Kimi K3 text model: KDA (full-rank output gate, safe gate) and NoPE MLA (output gate) layers,
block Attention Residuals around every block, a dense SiTU first layer then latent SiTU MoE.

Module names mirror the checkpoint, so `state_dict()` keys are the official tensor names:
language_model.model.embed_tokens, language_model.model.layers.{i}.{self_attention_res_norm,
self_attention_res_proj, input_layernorm, self_attn, mlp_res_norm, mlp_res_proj,
post_attention_layernorm, mlp (dense) | block_sparse_moe (latent MoE)},
language_model.model.{output_attn_res_norm, output_attn_res_proj, norm}, language_model.lm_head.

The residual stream is hyla.layers.attn_residual.BlockResidualStream: built per forward pass
(per engine step), it is activation memory, never part of the cache; the caches are
Kimi-Linear's (KDA state slots, MLA latent pages).

MXFP4 experts (a compressed-tensors `quantization_config`): while hyla.models.mxfp4.pack_at_load()
the routed experts are built as hyla.models.mxfp4.Mxfp4Experts (uint8 rows of codes + scales,
under the same stacked names), so the loader fills them packed and the latent MoE runs the MXFP4
fused-MoE kernel; prepare_for_inference converts them to block FP8 (mxfp4_experts="fp8") or
dequantises them once where they are not kept packed (mxfp4.keep_packed: by default, off CUDA).
Otherwise they are dequantised as they load.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.contract import ForwardBatch, HybridCache, LayerCache
from hyla.layers.attn_residual import BlockResidualStream, residual_scorer
from hyla.layers.gated_mla import GatedMLAAttention
from hyla.layers.kda import KimiDeltaAttention
from hyla.layers.latent_moe import LatentMoE
from hyla.layers.mla import MLAAttention
from hyla.layers.norm import RMSNorm
from hyla.layers.situ import SituExperts, SituMLP
from hyla.models.base import HybridForCausalLM
from hyla.models.kimi_linear import kda_mla_pools
from hyla.models.kimi_k3_config import LINEAR, SPARSE, KimiK3Config
from hyla.models.mxfp4 import Mxfp4Experts, is_mxfp4, keep_packed, pack_at_load
from hyla.ops.gated_act import GatedActivation


class KimiK3DecoderLayer(nn.Module):
    """One block over a BlockResidualStream (see hyla.layers.attn_residual for the mixing)."""

    def __init__(self, config: KimiK3Config, idx: int, packed_experts: bool = False):
        super().__init__()
        c = config
        self.idx = idx
        self.is_linear = c.layer_types[idx] == LINEAR
        if self.is_linear:
            self.self_attn = KimiDeltaAttention(
                c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.conv_kernel_size,
                lower_bound=c.gate_lower_bound, full_rank_gate=c.use_full_rank_gate, norm_eps=c.rms_norm_eps,
                a_log_shape=(c.linear_head_dim,),
            )
        else:
            mla = GatedMLAAttention if c.mla_use_output_gate else MLAAttention
            # K3 is served on DeepSeek-V2's MLA (SGLang / vLLM): its latent norms use rms_norm_eps,
            # not Kimi-Linear's 1e-6
            self.self_attn = mla(c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim,
                                 c.qk_rope_head_dim, c.v_head_dim, q_lora_rank=c.q_lora_rank, bias=c.attention_bias,
                                 latent_norm_eps=c.rms_norm_eps)
        self.is_sparse = c.mlp_layer_types[idx] == SPARSE
        if self.is_sparse:
            self.block_sparse_moe = LatentMoE(
                c.hidden_size, c.routed_expert_hidden_size, c.moe_intermediate_size, c.num_experts,
                c.num_experts_per_token, c.num_shared_experts, c.num_expert_group, c.topk_group, c.moe_renormalize,
                c.routed_scaling_factor, c.latent_moe_use_norm, c.rms_norm_eps, c.activation_situ_beta,
                c.activation_situ_linear_beta,
            )
            if packed_experts:
                width = c.routed_expert_hidden_size or c.hidden_size
                self.block_sparse_moe.experts = Mxfp4Experts(
                    c.num_experts, width, c.moe_intermediate_size,
                    GatedActivation("situ", beta=c.activation_situ_beta, linear_beta=c.activation_situ_linear_beta))
        else:
            self.mlp = SituMLP(c.hidden_size, c.intermediate_size, c.activation_situ_beta,
                               c.activation_situ_linear_beta)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attention_res_norm, self.self_attention_res_proj = residual_scorer(c.hidden_size, c.rms_norm_eps)
        self.mlp_res_norm, self.mlp_res_proj = residual_scorer(c.hidden_size, c.rms_norm_eps)

    @property
    def token_mixer(self) -> nn.Module:
        return self.self_attn

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if self.is_sparse else self.mlp(x)

    def forward(self, stream: BlockResidualStream, batch: ForwardBatch | None = None,
                cache: LayerCache | None = None) -> None:
        """Advance `stream` ([..., hidden] per token) by this block."""
        x = self.input_layernorm(stream.attention_input(self.idx, self.self_attention_res_norm,
                                                        self.self_attention_res_proj))
        stream.add(self.self_attn(x) if batch is None else self.self_attn.forward_batch(x, batch, cache))
        x = self.post_attention_layernorm(stream.mix(self.mlp_res_norm, self.mlp_res_proj))
        stream.add(self.ffn(x))


class KimiK3Model(nn.Module):
    """The checkpoint's `language_model.model` level."""

    def __init__(self, config: KimiK3Config, packed_experts: bool = False):
        super().__init__()
        self.block_size = config.attn_res_block_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiK3DecoderLayer(config, i, packed_experts)
                                    for i in range(config.num_hidden_layers))
        self.output_attn_res_norm, self.output_attn_res_proj = residual_scorer(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward_layers(self, h: torch.Tensor, batch: ForwardBatch | None = None,
                       caches: list[LayerCache] | None = None) -> torch.Tensor:
        """Embeddings h [..., hidden] -> final-norm hidden states [..., hidden]."""
        stream = BlockResidualStream(h, self.block_size)
        for i, layer in enumerate(self.layers):
            layer(stream, batch, None if caches is None else caches[i])
        return self.norm(stream.mix(self.output_attn_res_norm, self.output_attn_res_proj))


class KimiK3LanguageModel(nn.Module):
    """The checkpoint's `language_model` level: `model` and `lm_head`."""

    def __init__(self, config: KimiK3Config, packed_experts: bool = False):
        super().__init__()
        self.model = KimiK3Model(config, packed_experts)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class KimiK3ForCausalLM(HybridForCausalLM):
    # A multimodal checkpoint's vision tower and projector are not built (text serving only).
    ignored_checkpoint_prefixes = ("vision_tower.", "multi_modal_projector.", "mm_projector.")
    # The released checkpoint stores the KDA short-conv weights in fp32; the conv ops compute in
    # fp32 and read any weight dtype, so they stay fp32 whatever the model dtype (hyla.models.loader).
    fp32_tensors = ("_conv1d.weight",)

    def __init__(self, config: KimiK3Config, packed_experts: bool | None = None):
        """packed_experts: routed experts as Mxfp4Experts; None (the loader's call) = when the
        checkpoint's experts are MXFP4 and hyla.models.mxfp4.pack_at_load() says so for the
        mxfp4_experts mode the loader left on the config ("auto" without one)."""
        super().__init__()
        self.config = config
        if packed_experts is None:
            packed_experts = is_mxfp4(config.quantization_config) and pack_at_load(self._experts_mode())
        self.language_model = KimiK3LanguageModel(config, packed_experts)

    def _experts_mode(self) -> str:
        return getattr(self.config, "mxfp4_experts", "auto")

    @property
    def model(self) -> KimiK3Model:
        return self.language_model.model

    @property
    def lm_head(self) -> nn.Linear:
        return self.language_model.lm_head

    def prepare_for_inference(self) -> None:
        """Packed experts become block FP8 with mxfp4_experts="fp8" (Mxfp4Experts.to_fp8);
        otherwise those not kept packed where they are (mxfp4.keep_packed) are dequantised once
        to the model dtype (exact) into SituExperts; then the layers' own preparation."""
        fp8 = self._experts_mode() == "fp8"
        for layer in self.model.layers:
            experts = layer.block_sparse_moe.experts if layer.is_sparse else None
            if isinstance(experts, Mxfp4Experts) and fp8:
                layer.block_sparse_moe.experts = experts.to_fp8()
            elif isinstance(experts, Mxfp4Experts) and not keep_packed(experts.gate_up_proj.device, self._experts_mode()):
                layer.block_sparse_moe.experts = _dequantized(experts, self.dtype)
        super().prepare_for_inference()

    def allocate_cache(self, num_slots: int, num_pages: int, page_size: int = 16,
                       state_dtype: torch.dtype = torch.float32, device=None, dtype=None,
                       kv_cache_dtype: str | None = None) -> HybridCache:
        """Zeroed pools, Kimi-Linear's (kimi_linear.kda_mla_pools): the residual bank needs none."""
        self._check_pool_sizes(num_slots, num_pages, page_size)
        return kda_mla_pools(self.config, num_slots, num_pages, page_size, state_dtype,
                             self.device if device is None else device, self.dtype if dtype is None else dtype,
                             fp8=self._kv_fp8(kv_cache_dtype))


def _dequantized(packed: Mxfp4Experts, dtype: torch.dtype) -> SituExperts:
    """The SiTU experts holding `packed`'s weights dequantised to dtype, on its device."""
    act = packed.activation
    with torch.device("meta"):  # no init of weights that are replaced at once
        experts = SituExperts(packed.num_experts, packed.hidden_size, packed.intermediate_size, act.beta,
                              act.linear_beta)
    w13, w2 = packed.dequantized(dtype)
    experts.gate_up_proj, experts.down_proj = nn.Parameter(w13, False), nn.Parameter(w2, False)
    return experts
