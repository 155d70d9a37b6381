"""The Kimi-Linear configuration, read from an HF `config.json`.

One dataclass holds what the hyla modules need. `from_hf_dict` accepts the key spellings that
real checkpoints use (the released Kimi-Linear config, and what transformers' `save_pretrained`
writes) and resolves them with transformers' precedence, so that hyla and transformers build the
same layer schedule from the same file:

- layer kinds: `layer_types` > `linear_attn_config.{kda_layers, full_attn_layers}` (1-based) >
  the default (full attention at every 0-based index i > 0 with i % 4 == 0);
- MLP kinds: `mlp_layer_types` > `first_k_dense_replace` (default 1: layer 0 dense, rest MoE);
- KDA geometry: `linear_attn_config.{head_dim, num_heads, short_conv_kernel_size}` >
  `linear_head_dim` / `linear_num_heads` / `linear_conv_kernel_dim`.

Variants beyond Kimi-Linear (the seeds' Kimi K3 / GLM-5-Next KDA): `linear_attn_config.
gate_lower_bound` (or `safe_gate: true`, which defaults the bound to -5) selects the safe gate
g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)); `linear_attn_config.use_full_rank_gate`
replaces the low-rank output gate g_a_proj -> g_b_proj with one `g_proj`.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field

from hyla.ops.kv_fp8 import latent_groups

LINEAR = "linear_attention"
FULL = "full_attention"
DENSE = "dense"
SPARSE = "sparse"
SUPPORTED_MODEL_TYPES = ("kimi_linear",)


@dataclass(frozen=True)
class TransformersNames:
    """How transformers names a family's tensors where they differ from hyla's (for
    hyla.bench.hf_peer, which points transformers' model at hyla's weights).

    model_class: the transformers class; config_drop: config.json keys its config derives
    itself; renames: (transformers' fragment, hyla's) substitutions tried in order;
    fused_conv: transformers' `{prefix}conv1d.weight` is the cat of hyla's q / k / v
    `{prefix}{q,k,v}_conv1d.weight`; expert_pieces: hyla's per-expert names behind
    `experts.gate_up_proj` and `experts.down_proj`; router_in_model_dtype: transformers
    multiplies the router weight in the activations' dtype (hyla keeps it fp32)."""

    model_class: str
    expert_pieces: dict
    config_drop: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    fused_conv: bool = False
    router_in_model_dtype: bool = False


@dataclass(frozen=True)
class LayerSizes:
    """What the memory report (hyla.models.memory) asks a family's config: the kind of its linear
    and attention layers and, in elements, what one layer of each kind caches. Every family's
    config answers `layer_sizes()`; the layer counts come from `layer_types`."""

    linear_kind: str  # e.g. "KDA", "GDN"
    attention_kind: str  # e.g. "MLA", "GQA"
    state_per_slot: int  # one linear layer's recurrent state, per request (state dtype)
    conv_per_slot: int  # one linear layer's conv windows, per request (model dtype)
    kv_per_token: int  # one attention layer's cache, per token (model dtype)
    kv_contents: str  # what that cache holds, e.g. "MLA latents", "keys + values"
    # fp32 scales per token of one attention layer's cache with FP8 pages (hyla.ops.kv_fp8)
    kv_scales_per_token: int = 0

# Alternative spellings seen in Kimi-Linear configs: transformers' attribute names on the left of
# its attribute_map, the released checkpoint's keys on the right. The first key found wins.
_ALIASES = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_token": ("num_experts_per_token", "num_experts_per_tok"),
    "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "num_expert_group": ("num_expert_group", "n_group"),
    "moe_renormalize": ("moe_renormalize", "norm_topk_prob"),
}


@dataclass
class KimiLinearConfig:
    """Sizes and schedules of a Kimi-Linear model. Layer lists are 0-based and have one entry per layer."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]  # "linear_attention" (KDA) | "full_attention" (MLA)
    mlp_layer_types: list[str]  # "dense" | "sparse" (MoE)
    intermediate_size: int = 9216
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # KDA
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    conv_kernel_size: int = 4
    gate_lower_bound: float | None = None  # None: gate v1 (softplus); < 0: safe gate v2
    use_full_rank_gate: bool = False
    # MLA (NoPE: the "rope" part of q/k is used without any rotation)
    num_attention_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attention_bias: bool = False
    # MoE
    moe_intermediate_size: int = 1024
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 2.446
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
        return "kimi_linear"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_layers(self) -> list[int]:
        """0-based indices of the KDA layers."""
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def mla_layers(self) -> list[int]:
        """0-based indices of the MLA layers."""
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    def layer_sizes(self) -> LayerSizes:
        """KDA: a state H x K x K and three conv windows (q, k, v), each H*K x (W-1), per slot;
        MLA: one latent of kv_lora_rank + qk_rope_head_dim values per token."""
        h, k = self.linear_num_heads, self.linear_head_dim
        return LayerSizes(linear_kind="KDA", attention_kind="MLA", state_per_slot=h * k * k,
                          conv_per_slot=3 * h * k * (self.conv_kernel_size - 1),
                          kv_per_token=self.kv_lora_rank + self.qk_rope_head_dim, kv_contents="MLA latents",
                          kv_scales_per_token=len(latent_groups(self.kv_lora_rank, self.qk_rope_head_dim)))

    def parameter_counts(self) -> tuple[int, int]:
        """(parameters stored in the model dtype, parameters kept in fp32), from the config alone."""
        hid, main, fp32 = self.hidden_size, 0, 0
        for i, kind in enumerate(self.layer_types):
            main += 2 * hid  # input / post-attention norms
            if kind == LINEAR:
                h, k = self.linear_num_heads, self.linear_head_dim
                d = h * k
                gate = hid * d if self.use_full_rank_gate else hid * k + k * d
                main += 3 * hid * d + 3 * d * self.conv_kernel_size + hid * k + k * d + hid * h + gate + k + d * hid
                fp32 += d + h  # dt_bias, A_log
            else:
                h, qk, r, b = self.num_attention_heads, self.qk_head_dim, self.kv_lora_rank, int(self.attention_bias)
                if self.q_lora_rank is None:
                    main += hid * h * qk
                else:
                    ql = self.q_lora_rank
                    main += hid * ql + b * ql + ql + ql * h * qk
                main += (hid + b) * (r + self.qk_rope_head_dim) + r + r * h * (self.qk_nope_head_dim + self.v_head_dim)
                main += h * self.v_head_dim * hid + b * hid
            if self.mlp_layer_types[i] == SPARSE:
                e, im = self.num_experts, self.moe_intermediate_size
                main += 3 * hid * im * (e + self.num_shared_experts)
                fp32 += e * hid + e  # router weight, e_score_correction_bias
            else:
                main += 3 * hid * self.intermediate_size
        main += self.vocab_size * hid * (1 if self.tie_word_embeddings else 2) + hid
        return main, fp32

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "linear_num_heads", "linear_head_dim",
            "conv_kernel_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
        ]
        for name in positive:
            _check_int(name, getattr(self, name), low=1)
        _check_int("qk_rope_head_dim", self.qk_rope_head_dim, low=0)
        if self.q_lora_rank is not None:
            _check_int("q_lora_rank", self.q_lora_rank, low=1)
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"config field `rms_norm_eps` must be > 0, got {self.rms_norm_eps!r}")
        if self.gate_lower_bound is not None:
            lb = self.gate_lower_bound
            if not (isinstance(lb, (int, float)) and math.isfinite(lb) and lb < 0):
                raise ValueError(f"config field `gate_lower_bound` must be a finite negative number, got {lb!r}")
        check_layer_kinds(self)
        if SPARSE in self.mlp_layer_types:
            self._validate_moe()

    def _validate_moe(self) -> None:
        _check_int("moe_intermediate_size", self.moe_intermediate_size, low=1)
        _check_int("num_experts", self.num_experts, low=1)
        _check_int("num_experts_per_token", self.num_experts_per_token, low=1, high=self.num_experts)
        _check_int("num_shared_experts", self.num_shared_experts, low=0)
        _check_int("num_expert_group", self.num_expert_group, low=1, high=self.num_experts)
        _check_int("topk_group", self.topk_group, low=1, high=self.num_expert_group)
        if self.num_experts % self.num_expert_group:
            raise ValueError(
                f"config field `num_experts` ({self.num_experts}) must be divisible by "
                f"`num_expert_group` ({self.num_expert_group})"
            )
        per_group = self.num_experts // self.num_expert_group
        # Groups are scored by their top-2 experts (transformers / DeepSeek-V3 "noaux_tc").
        if per_group < 2:
            raise ValueError(f"each expert group needs >= 2 experts to be scored, got {per_group}")
        if self.num_experts_per_token > self.topk_group * per_group:
            raise ValueError(
                f"config field `num_experts_per_token` ({self.num_experts_per_token}) exceeds the "
                f"{self.topk_group * per_group} experts in the `topk_group` selected groups"
            )

    @classmethod
    def from_hf_dict(cls, d: dict) -> KimiLinearConfig:
        """Build from a parsed `config.json` (see the module docstring for the key precedence)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unknown model_type {model_type!r} for KimiLinearConfig, which reads "
                             f"{list(SUPPORTED_MODEL_TYPES)} (hyla.models.load_config picks the family)")
        _reject_unsupported(d)
        n = _req(d, "num_hidden_layers")
        lac = d.get("linear_attn_config") or {}
        kw = dict(
            vocab_size=_req(d, "vocab_size"),
            hidden_size=_req(d, "hidden_size"),
            num_hidden_layers=n,
            layer_types=_layer_types(d, lac, n),
            mlp_layer_types=_mlp_layer_types(d, n),
            linear_num_heads=lac.get("num_heads", d.get("linear_num_heads", 32)),
            linear_head_dim=lac.get("head_dim", d.get("linear_head_dim", 128)),
            conv_kernel_size=lac.get("short_conv_kernel_size", d.get("linear_conv_kernel_dim", 4)),
            gate_lower_bound=_lower_bound(lac),
            use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            dtype=d.get("dtype", d.get("torch_dtype")),
            extra=dict(d),
        )
        for name in (
            "intermediate_size", "rms_norm_eps", "tie_word_embeddings", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "attention_bias",
            "moe_intermediate_size", "topk_group", "routed_scaling_factor", "bos_token_id", "eos_token_id",
            "pad_token_id",
        ):
            if name in d:
                kw[name] = d[name]
        for name, keys in _ALIASES.items():
            for key in keys:
                if key in d:
                    kw[name] = d[key]
                    break
        if kw.get("topk_group") is None:
            kw["topk_group"] = 1
        return cls(**kw)

    TRANSFORMERS_NAMES = TransformersNames(
        model_class="KimiLinearForCausalLM",
        config_drop=("head_dim",),  # transformers derives it (qk_rope_head_dim)
        renames=((".mlp.", ".block_sparse_moe."), (".self_attn.forget_gate.", ".self_attn.")),
        fused_conv=True,
        expert_pieces={"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)},
    )

    @staticmethod
    def first_layers_hf_dict(d: dict, layers: int) -> dict:
        """A copy of config.json contents `d` for the model's first `layers` layers (the same
        schedule prefix): the 1-based `linear_attn_config` layer lists and `first_k_dense_replace`
        cut, explicit per-layer lists shortened."""
        d = copy.deepcopy(d)
        d["num_hidden_layers"] = layers
        lac = d.get("linear_attn_config") or {}
        for key in ("kda_layers", "full_attn_layers"):
            if key in lac:
                lac[key] = [i for i in lac[key] if i <= layers]  # 1-based
        for key in ("layer_types", "mlp_layer_types"):
            if d.get(key) is not None:
                d[key] = d[key][:layers]
        d["first_k_dense_replace"] = min(d.get("first_k_dense_replace", 1), layers)
        return d

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> KimiLinearConfig:
        """Read `path` (a config.json, or a directory holding one)."""
        return cls.from_hf_dict(read_config_json(path))


def read_config_json(path: str | os.PathLike) -> dict:
    """The parsed config.json at `path` (the file, or a directory holding it)."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"no config.json at {file}")
    with open(file, encoding="utf-8") as f:
        d = json.load(f)
    if not isinstance(d, dict):
        raise ValueError(f"{file} does not hold a JSON object")
    return d


def check_layer_kinds(config) -> None:
    """`layer_types` / `mlp_layer_types`: one known kind per layer; dense MLPs need a size (both
    families; the MoE fields are each family's own)."""
    n = config.num_hidden_layers
    for name, allowed in (("layer_types", (LINEAR, FULL)), ("mlp_layer_types", (DENSE, SPARSE))):
        kinds = getattr(config, name)
        if len(kinds) != n:
            raise ValueError(f"config field `{name}` has {len(kinds)} entries for {n} layers")
        bad = sorted({k for k in kinds if k not in allowed})
        if bad:
            raise ValueError(f"config field `{name}` has unknown kinds {bad}; expected {list(allowed)}")
    if DENSE in config.mlp_layer_types:
        _check_int("intermediate_size", config.intermediate_size, low=1)


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config field `{name}` must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"config field `{name}` must be {rng}, got {value}")


def _req(d: dict, key: str):
    if key not in d:
        raise ValueError(f"config.json lacks the required field `{key}`")
    return d[key]


def _reject_unsupported(d: dict) -> None:
    """Fields whose other values would change the math in ways hyla does not implement."""
    if d.get("mla_use_nope", True) is not True:
        raise ValueError("config field `mla_use_nope` is false: MLA with RoPE is not supported (Kimi-Linear is NoPE)")
    if d.get("mla_use_output_gate", False):
        raise ValueError("config field `mla_use_output_gate` is true: an output gate on MLA layers is not supported")
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config field `hidden_act` must be 'silu', got {act!r}")
    router = d.get("moe_router_activation_func", "sigmoid")
    if router != "sigmoid":
        raise ValueError(f"config field `moe_router_activation_func` must be 'sigmoid', got {router!r}")


def _layer_types(d: dict, lac: dict, n: int) -> list[str]:
    from_lists = None
    if "kda_layers" in lac and "full_attn_layers" in lac:
        from_lists = [None] * n
        for key, kind in (("full_attn_layers", FULL), ("kda_layers", LINEAR)):
            for one_based in lac[key]:
                if isinstance(one_based, bool) or not isinstance(one_based, int) or not 1 <= one_based <= n:
                    raise ValueError(f"linear_attn_config.{key} entry {one_based!r} is not a 1-based layer in 1..{n}")
                if from_lists[one_based - 1] is not None:
                    raise ValueError(f"layer {one_based} (1-based) is listed twice in linear_attn_config")
                from_lists[one_based - 1] = kind
        missing = [i + 1 for i, t in enumerate(from_lists) if t is None]
        if missing:
            raise ValueError(f"layers {missing} (1-based) are in neither kda_layers nor full_attn_layers")
    if d.get("layer_types") is not None:
        types = list(d["layer_types"])
        if from_lists is not None and types != from_lists:
            raise ValueError("config `layer_types` disagrees with linear_attn_config.kda_layers/full_attn_layers")
        return types
    if from_lists is not None:
        return from_lists
    return [FULL if i and i % 4 == 0 else LINEAR for i in range(n)]


def _mlp_layer_types(d: dict, n: int) -> list[str]:
    if d.get("mlp_layer_types") is not None:
        return list(d["mlp_layer_types"])
    k = d.get("first_k_dense_replace", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"config field `first_k_dense_replace` must be an integer >= 0, got {k!r}")
    return [DENSE if i < k else SPARSE for i in range(n)]


def _lower_bound(lac: dict) -> float | None:
    lb = lac.get("gate_lower_bound")
    if lb is None and lac.get("safe_gate", False):
        lb = -5.0  # GLM-5-Next's default when the safe gate is on without an explicit bound
    return float(lb) if isinstance(lb, int) and not isinstance(lb, bool) else lb
