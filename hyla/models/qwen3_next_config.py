"""The Qwen3-Next configuration, read from an HF `config.json` (`model_type: "qwen3_next"`).

Keys and defaults follow transformers' Qwen3NextConfig, so that hyla and transformers build the
same model from the same file:

- layer kinds: `layer_types` > `full_attention_interval` (default 4: layer i is full attention
  when (i + 1) % interval == 0, Gated DeltaNet otherwise);
- MLP kinds: MoE at layer i when i is not in `mlp_only_layers`, `num_experts` > 0 and
  (i + 1) % `decoder_sparse_step` == 0; a dense MLP (`intermediate_size`) otherwise;
- RoPE: `rope_parameters.{rope_theta, partial_rotary_factor, rope_type}` (what transformers 5
  writes) > the released checkpoints' top-level `rope_theta` / `partial_rotary_factor` /
  `rope_scaling`; defaults theta 10000, factor 0.25. Only the default RoPE type is supported.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from hyla.models.config import (
    DENSE, FULL, LINEAR, SPARSE, LayerSizes, TransformersNames, _check_int, _req, check_layer_kinds,
    read_config_json,
)

MODEL_TYPE = "qwen3_next"


@dataclass
class Qwen3NextConfig:
    """Sizes and schedules of a Qwen3-Next model. Layer lists are 0-based, one entry per layer."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]  # "linear_attention" (Gated DeltaNet) | "full_attention" (gated GQA)
    mlp_layer_types: list[str]  # "dense" | "sparse" (MoE)
    intermediate_size: int = 5632
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # gated full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    # MoE
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    # tokens and storage
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None  # the checkpoint's `dtype` / `torch_dtype`, e.g. "bfloat16"
    extra: dict = field(default_factory=dict, repr=False)  # the raw config.json

    def __post_init__(self):
        self.validate()

    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    @property
    def linear_layers(self) -> list[int]:
        """0-based indices of the Gated DeltaNet layers."""
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def attention_layers(self) -> list[int]:
        """0-based indices of the full-attention layers."""
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's short conv: q, k and v concatenated."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def layer_sizes(self) -> LayerSizes:
        """Gated DeltaNet: a state HV x K x V and one conv window conv_dim x (W-1) per slot;
        gated attention (GQA): a key and a value, Hkv x head_dim each, per token."""
        return LayerSizes(
            linear_kind="GDN", attention_kind="GQA",
            state_per_slot=self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim,
            conv_per_slot=self.conv_dim * (self.linear_conv_kernel_dim - 1),
            kv_per_token=2 * self.num_key_value_heads * self.head_dim, kv_contents="keys + values",
            kv_scales_per_token=2 * self.num_key_value_heads)  # FP8 pages: a scale per token and KV head each

    def parameter_counts(self) -> tuple[int, int]:
        """(parameters stored in the model dtype, parameters kept in fp32), from the config alone."""
        hid, main, fp32 = self.hidden_size, 0, 0
        for i, kind in enumerate(self.layer_types):
            main += 2 * hid  # input / post-attention norms
            if kind == LINEAR:
                hv, kd, vd = self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim
                key_dim, value_dim = self.linear_num_key_heads * kd, hv * vd
                main += hid * (2 * key_dim + 2 * value_dim) + hid * 2 * hv  # in_proj_qkvz, in_proj_ba
                main += self.conv_dim * self.linear_conv_kernel_dim + vd + value_dim * hid  # conv1d, norm, out_proj
                fp32 += 2 * hv  # dt_bias, A_log
            else:
                h, kv, d = self.num_attention_heads, self.num_key_value_heads, self.head_dim
                b = int(self.attention_bias)
                main += (hid + b) * 2 * h * d + 2 * (hid + b) * kv * d + h * d * hid + b * hid + 2 * d
            if self.mlp_layer_types[i] == SPARSE:
                experts = self.moe_intermediate_size * self.num_experts + self.shared_expert_intermediate_size
                main += 3 * hid * experts + hid
                fp32 += self.num_experts * hid  # router
            else:
                main += 3 * hid * self.intermediate_size
        main += self.vocab_size * hid * (1 if self.tie_word_embeddings else 2) + hid
        return main, fp32

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel_dim", "num_attention_heads", "num_key_value_heads", "head_dim"):
            _check_int(name, getattr(self, name), low=1)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"config field `linear_num_value_heads` ({self.linear_num_value_heads}) must be a "
                             f"multiple of `linear_num_key_heads` ({self.linear_num_key_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config field `num_attention_heads` ({self.num_attention_heads}) must be a "
                             f"multiple of `num_key_value_heads` ({self.num_key_value_heads})")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"config field `{name}` must be > 0, got {value!r}")
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"config field `partial_rotary_factor` must lie in (0, 1], got {f!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"head_dim * partial_rotary_factor = {self.rotary_dim} rotary channels: "
                             "must be even and >= 2")
        check_layer_kinds(self)
        if SPARSE in self.mlp_layer_types:
            _check_int("num_experts", self.num_experts, low=1)
            _check_int("num_experts_per_tok", self.num_experts_per_tok, low=1, high=self.num_experts)
            _check_int("moe_intermediate_size", self.moe_intermediate_size, low=1)
            _check_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size, low=1)

    @classmethod
    def from_hf_dict(cls, d: dict) -> Qwen3NextConfig:
        """Build from a parsed `config.json` (see the module docstring for the key precedence)."""
        if d.get("model_type") != MODEL_TYPE:
            raise ValueError(f"model_type {d.get('model_type')!r} is not {MODEL_TYPE!r}")
        return cls(**read_fields(d, _mlp_layer_types))

    TRANSFORMERS_NAMES = TransformersNames(
        model_class="Qwen3NextForCausalLM",
        expert_pieces={"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
        router_in_model_dtype=True,
    )

    @staticmethod
    def first_layers_hf_dict(d: dict, layers: int) -> dict:
        """A copy of config.json contents `d` for the model's first `layers` layers (the same
        schedule prefix: `full_attention_interval`, `mlp_only_layers` and `decoder_sparse_step`
        give it as they are; an explicit `layer_types` is shortened)."""
        d = copy.deepcopy(d)
        d["num_hidden_layers"] = layers
        if d.get("layer_types") is not None:
            d["layer_types"] = d["layer_types"][:layers]
        return d

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Qwen3NextConfig:
        """Read `path` (a config.json, or a directory holding one)."""
        return cls.from_hf_dict(read_config_json(path))


# Keys read as they are when present (each one a field of the config class).
_PLAIN_KEYS = (
    "intermediate_size", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "norm_topk_prob", "bos_token_id", "eos_token_id", "pad_token_id",
)


def read_fields(d: dict, mlp_layer_types: Callable[[dict, int], list[str]], defaults: dict | None = None) -> dict:
    """Keyword arguments of a Qwen3-Next-style config class from config.json contents `d` (shared
    with Qwen3.5): `defaults` fills keys `d` lacks (a key with no default among vocab_size,
    hidden_size, num_hidden_layers is required); `mlp_layer_types(d, n)` gives each layer's MLP
    kind, the one schedule the families read differently."""
    defaults = defaults or {}

    def size(key):
        return defaults[key] if key in defaults and d.get(key) is None else _req(d, key)

    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config field `hidden_act` must be 'silu', got {act!r}")
    n = size("num_hidden_layers")
    _check_int("num_hidden_layers", n, low=1)
    kw = dict(defaults)
    kw.update(vocab_size=size("vocab_size"), hidden_size=size("hidden_size"), num_hidden_layers=n,
              layer_types=_layer_types(d, n), mlp_layer_types=mlp_layer_types(d, n),
              dtype=d.get("dtype", d.get("torch_dtype")), extra=dict(d), **_rope(d))
    for name in _PLAIN_KEYS:
        if d.get(name) is not None:
            kw[name] = d[name]
    return kw


def _layer_types(d: dict, n: int) -> list[str]:
    if d.get("layer_types") is not None:
        return list(d["layer_types"])
    interval = d.get("full_attention_interval", 4)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"config field `full_attention_interval` must be an integer >= 1, got {interval!r}")
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]


def _mlp_layer_types(d: dict, n: int) -> list[str]:
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise ValueError(f"config field `mlp_only_layers` must be a list of 0-based layer indices, got {only!r}")
    step = d.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"config field `decoder_sparse_step` must be an integer >= 1, got {step!r}")
    experts = d.get("num_experts", 512)
    return [SPARSE if i not in only and experts > 0 and (i + 1) % step == 0 else DENSE for i in range(n)]


def _rope(d: dict) -> dict:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config field `rope_parameters` must be a mapping, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"RoPE type {kind!r} is not supported (only 'default')")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    return dict(rope_theta=theta, partial_rotary_factor=factor)
