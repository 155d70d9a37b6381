"""The Qwen3.5 configuration (dense and MoE), read from an HF `config.json` in either layout:

- causal-LM layout, `model_type` "qwen3_5_text" (dense) or "qwen3_5_moe_text" (MoE): the keys at
  the top level, weights under `model.*`, as transformers' Qwen3_5ForCausalLM /
  Qwen3_5MoeForCausalLM save them;
- the released multimodal layout, `model_type` "qwen3_5" or "qwen3_5_moe": the text model's keys
  under `text_config`, weights under `model.language_model.*`, plus a vision tower
  (`model.visual.*`, not built by hyla: it serves text).

The keys are Qwen3-Next's (hyla.models.qwen3_next_config.read_fields reads both families) with
three differences, each as transformers 5.24's Qwen3_5TextConfig / Qwen3_5MoeTextConfig has it:

- MLPs: dense every layer (Qwen3.5) or MoE every layer (Qwen3.5-MoE, top-k weights always
  renormalised); `mlp_only_layers`, `decoder_sparse_step` and `norm_topk_prob` do not exist;
- defaults of the sizes a file may omit (vocab 248320; dense: hidden 4096, intermediate 12288,
  32 layers, 4 KV heads; MoE: hidden 2048, 40 layers, 256 experts top-8);
- RoPE: `rope_parameters` may carry `mrope_section` (default [11, 11, 10]) and `mrope_interleaved`
  for multimodal position ids (temporal, height, width). A text token has all three equal to
  its position, so every rotary channel pair turns by position * inv_freq whichever stream its
  section assigns it to: for text the mRoPE is exactly the 1-D partial RoPE of Qwen3-Next.

In the multimodal layout `tie_word_embeddings` is the outer config's (default False; that is the
flag transformers ties by), and the dtype and special-token ids come from `text_config`, else the
outer config.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from hyla.models.config import DENSE, SPARSE, TransformersNames
from hyla.models.qwen3_next_config import Qwen3NextConfig, read_fields

_OUTER_FALLBACK_KEYS = ("dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id")


@dataclass
class Qwen3_5Config(Qwen3NextConfig):
    """Sizes and schedules of a dense Qwen3.5 model (Qwen3_5MoeConfig: the MoE models)."""

    multimodal: bool = False  # the released layout: weights under model.language_model.*
    mrope_section: list[int] | None = None  # rope_parameters.mrope_section (text: no effect)

    TEXT_MODEL_TYPE = "qwen3_5_text"
    MULTIMODAL_MODEL_TYPE = "qwen3_5"
    MOE = False
    DEFAULTS = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                    num_key_value_heads=4)
    TRANSFORMERS_NAMES = TransformersNames(  # the causal-LM layout (hyla.bench.hf_peer)
        model_class="Qwen3_5ForCausalLM",
        expert_pieces={"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
        router_in_model_dtype=True,
    )

    @property
    def model_type(self) -> str:
        return self.MULTIMODAL_MODEL_TYPE if self.multimodal else self.TEXT_MODEL_TYPE

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        super().validate()
        s = self.mrope_section
        if s is not None and (not isinstance(s, list) or len(s) != 3
                              or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in s)):
            raise ValueError(f"config field `rope_parameters.mrope_section` must be a list of 3 integers >= 0, "
                             f"got {s!r}")

    @classmethod
    def from_hf_dict(cls, d: dict) -> Qwen3_5Config:
        """Build from a parsed `config.json` of either layout (see the module docstring)."""
        kind = d.get("model_type")
        if kind == cls.TEXT_MODEL_TYPE:
            text = d
        elif kind == cls.MULTIMODAL_MODEL_TYPE:
            text = _text_config(d, cls.TEXT_MODEL_TYPE)
        else:
            raise ValueError(f"model_type {kind!r} is not {cls.TEXT_MODEL_TYPE!r} or {cls.MULTIMODAL_MODEL_TYPE!r}")
        mlp = SPARSE if cls.MOE else DENSE
        kw = read_fields(text, lambda _, n: [mlp] * n, defaults=cls.DEFAULTS)
        params = text.get("rope_parameters") or text.get("rope_scaling") or {}
        kw.update(multimodal=text is not d, mrope_section=params.get("mrope_section", [11, 11, 10]), extra=dict(d))
        if cls.MOE:
            kw["norm_topk_prob"] = True  # Qwen3.5-MoE's router always renormalises its top-k
        return cls(**kw)

    @staticmethod
    def first_layers_hf_dict(d: dict, layers: int) -> dict:
        """A copy of config.json contents `d` (either layout) for the model's first `layers` layers."""
        if not isinstance(d.get("text_config"), dict):
            return Qwen3NextConfig.first_layers_hf_dict(d, layers)
        d = copy.deepcopy(d)
        d["text_config"] = Qwen3NextConfig.first_layers_hf_dict(d["text_config"], layers)
        return d


@dataclass
class Qwen3_5MoeConfig(Qwen3_5Config):
    """Qwen3.5-MoE: every layer's MLP a sparse MoE block (softmax top-k + sigmoid-gated shared expert)."""

    TEXT_MODEL_TYPE = "qwen3_5_moe_text"
    MULTIMODAL_MODEL_TYPE = "qwen3_5_moe"
    MOE = True
    DEFAULTS = dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_experts=256, num_experts_per_tok=8)
    TRANSFORMERS_NAMES = TransformersNames(
        model_class="Qwen3_5MoeForCausalLM",
        expert_pieces={"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
        router_in_model_dtype=True,
    )


def _text_config(d: dict, text_type: str) -> dict:
    """The text model's keys of a multimodal config.json, completed from the outer config."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config field `text_config` must be a mapping, got {text!r}")
    if text.get("model_type", text_type) != text_type:
        raise ValueError(f"config field `text_config.model_type` must be {text_type!r} for model_type "
                         f"{d.get('model_type')!r}, got {text.get('model_type')!r}")
    text = dict(text, model_type=text_type)
    for key in _OUTER_FALLBACK_KEYS:
        if text.get(key) is None and d.get(key) is not None:
            text[key] = d[key]
    text["tie_word_embeddings"] = d.get("tie_word_embeddings", False)
    return text
