"""Qwen3.5 (dense and MoE): Qwen3-Next's architecture -- Gated DeltaNet and gated full-attention
layers, zero-centred RMSNorms, partial RoPE, softmax-routed MoE with a sigmoid-gated shared
expert -- with Qwen3.5's GDN projections (hyla.layers.gdn.Qwen3_5GatedDeltaNet: separate
in_proj_qkv / in_proj_z / in_proj_b / in_proj_a instead of the head-interleaved in_proj_qkvz /
in_proj_ba). Everything else is the Qwen3-Next code (hyla.models.qwen3_next), subclassed.

Two checkpoint layouts, one module tree each so that `state_dict()` keys are the official names:

- Qwen3_5ForCausalLM (`qwen3_5_text`, `qwen3_5_moe_text`): model.embed_tokens,
  model.layers.{i}.{input_layernorm, linear_attn | self_attn, post_attention_layernorm, mlp},
  model.norm, lm_head;
- Qwen3_5MultimodalForCausalLM (`qwen3_5`, `qwen3_5_moe`, the released checkpoints): the same
  text model under model.language_model.*, lm_head; the vision tower (model.visual.*) is not
  built and its tensors are skipped, with one log line.

Both skip the multi-token-prediction head (`mtp.*`), as transformers does.
"""

from __future__ import annotations

import logging


from hyla.layers.gdn import Qwen3_5GatedDeltaNet
from hyla.models.base import LanguageModelHolder
from hyla.models.qwen3_5_config import Qwen3_5Config
from hyla.models.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextForCausalLM, Qwen3NextModel

log = logging.getLogger("hyla.models")


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    linear_attn_cls = Qwen3_5GatedDeltaNet


class Qwen3_5Model(Qwen3NextModel):
    decoder_layer_cls = Qwen3_5DecoderLayer


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """The causal-LM layout. Dense or MoE as config.mlp_layer_types says (Qwen3_5Config /
    Qwen3_5MoeConfig)."""

    base_model_cls = Qwen3_5Model


class Qwen3_5LanguageModelHolder(LanguageModelHolder):
    """`model` of the multimodal layout: the text model under `language_model`."""

    text_model_cls = Qwen3_5Model


class Qwen3_5MultimodalForCausalLM(Qwen3_5ForCausalLM):
    """The released multimodal layout, text only."""

    ignored_checkpoint_prefixes = ("mtp.", "model.visual.")
    base_model_cls = Qwen3_5LanguageModelHolder

    def __init__(self, config: Qwen3_5Config):
        super().__init__(config)
        log.info("%s checkpoint: serving its text model; the vision tower (model.visual.*) is not built and "
                 "its tensors are skipped", config.model_type)
