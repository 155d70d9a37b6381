"""The GLM-5-Next (GLM-5.3-Flash) text configuration, read from an HF `config.json`.

transformers 5.24 names the family `glm5_next` (a vision-language wrapper whose text part is a
`glm5_next_text` config under `text_config`); text-only checkpoints may store the text fields at
the top level instead. hyla serves the text model and reads either layout. Keys and defaults
follow transformers' Glm5NextTextConfig, so that both build the same model from the same file:

- layer kinds: `layer_types` ("linear_attention" = KDA, "indexed_attention" = DSA-indexed NoPE
  MLA; "full_attention" is read as "indexed_attention") > the default (layer i is indexed when
  i % 4 == 3);
- MLP kinds: `mlp_layer_types` ("dense" | "sparse") > the default (the first 3 layers dense);
- indexer modes: `indexer_types` ("full" | "shared") > `index_topk_pattern` ("FSSF..." or a
  list) > `index_topk_freq` / `index_skip_topk_offset` (layer i is full when
  max(i - offset + 1, 0) % freq == 0; defaults 1 / 2, i.e. every layer full);
- KDA geometry: `linear_attn_config.{head_dim, num_heads, short_conv_kernel_size,
  gate_lower_bound}` > `linear_head_dim` / `linear_num_heads` / `linear_conv_kernel_dim` /
  `linear_lower_bound` (the safe gate's bound; default -5).

hyla's rule for a "shared" indexed layer: it reuses the selection of the nearest *earlier*
"full" indexed layer (KDA layers in between do not matter). transformers hands a selection only
from the immediately preceding layer, so the two agree wherever transformers runs at all.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field

from hyla.models.config import (
    DENSE, LINEAR, SPARSE, LayerSizes, TransformersNames, _check_int, _req, read_config_json,
)
from hyla.ops.kv_fp8 import latent_groups

MODEL_TYPE = "glm5_next"
TEXT_MODEL_TYPE = "glm5_next_text"
INDEXED = "indexed_attention"
FULL_INDEXER, SHARED_INDEXER = "full", "shared"


@dataclass
class Glm5NextConfig:
    """Sizes and schedules of a GLM-5-Next text model. Layer lists are 0-based, one entry per layer."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]  # "linear_attention" (KDA) | "indexed_attention" (DSA + MLA)
    mlp_layer_types: list[str]  # "dense" | "sparse" (MoE)
    indexer_types: list[str]  # per layer "full" | "shared" (read on indexed layers only)
    intermediate_size: int = 12288
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    swiglu_limit: float | None = 10.0
    # KDA (safe gate)
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    # MLA (NoPE, q_lora) + DSA indexer
    num_attention_heads: int = 64
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    # mHC hyper-connections
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # MoE
    moe_intermediate_size: int = 2048
    num_experts: int = 288
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    # tokens and storage
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: str | None = None
    has_vision: bool = False  # config.json describes a vision tower (its weights are not loaded)
    extra: dict = field(default_factory=dict, repr=False)  # the raw config.json

    def __post_init__(self):
        self.validate()

    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def attention_layers(self) -> list[int]:
        """0-based indices of the indexed (DSA + MLA) layers."""
        return [i for i, t in enumerate(self.layer_types) if t == INDEXED]

    @property
    def indexer_layers(self) -> list[int]:
        """Indexed layers that run their own indexer (and cache indexer keys)."""
        return [i for i in self.attention_layers if self.indexer_types[i] == FULL_INDEXER]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def selection_source(self, layer: int) -> int:
        """The full indexed layer whose selection indexed layer `layer` uses (itself if full)."""
        for j in range(layer, -1, -1):
            if self.layer_types[j] == INDEXED and self.indexer_types[j] == FULL_INDEXER:
                return j
        raise ValueError(f"config field `indexer_types`: layer {layer} is 'shared' but no earlier indexed "
                         "layer runs a full indexer")

    def layer_sizes(self) -> LayerSizes:
        """KDA: a state H x K x K and q, k, v conv windows (H*K x (W-1) each) per slot; MLA: one
        latent of kv_lora_rank values per token (NoPE: no rope part). The indexer's keys are
        counted by hyla.models.glm5_next_memory (only "full" layers hold them)."""
        h, k = self.linear_num_heads, self.linear_head_dim
        return LayerSizes(linear_kind="KDA", attention_kind="DSA-MLA", state_per_slot=h * k * k,
                          conv_per_slot=3 * h * k * (self.linear_conv_kernel_dim - 1),
                          kv_per_token=self.kv_lora_rank + self.qk_rope_head_dim, kv_contents="MLA latents",
                          kv_scales_per_token=len(latent_groups(self.kv_lora_rank, self.qk_rope_head_dim)))

    def parameter_counts(self) -> tuple[int, int]:
        """(parameters stored in the model dtype, parameters kept in fp32), from the config alone."""
        hid, main, fp32 = self.hidden_size, 0, 0
        m = self.hc_mult
        for i, kind in enumerate(self.layer_types):
            main += 2 * hid  # input / post-attention norms
            main += 2 * (2 + m) * m * m * hid  # hc_attn_fn, hc_ffn_fn
            fp32 += 2 * ((2 + m) * m + 3)  # their base and scale
            if kind == LINEAR:
                h, k = self.linear_num_heads, self.linear_head_dim
                d = h * k
                main += 3 * hid * d + 3 * d * self.linear_conv_kernel_dim  # q/k/v and their convs
                main += 2 * (hid * k + k * d) + hid * h + k + d * hid  # f_a/f_b, g_a/g_b, b_proj, o_norm, o_proj
                fp32 += d + h  # dt_bias, A_log
            else:
                h, ql, r, b = self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank, int(self.attention_bias)
                main += (hid + b) * ql + ql + ql * h * self.qk_head_dim
                main += (hid + b) * (r + self.qk_rope_head_dim) + r + r * h * (self.qk_nope_head_dim + self.v_head_dim)
                main += h * self.v_head_dim * hid + b * hid
                if self.indexer_types[i] == FULL_INDEXER:
                    hi, di = self.index_n_heads, self.index_head_dim
                    main += ql * hi * di + hid * di + 2 * di + hid * hi + self.index_kpool * di + di * hid
            if self.mlp_layer_types[i] == SPARSE:
                e, im = self.num_experts, self.moe_intermediate_size
                main += 3 * hid * im * (e + self.n_shared_experts)
                fp32 += e * hid + e  # router weight, e_score_correction_bias
            else:
                main += 3 * hid * self.intermediate_size
        main += self.vocab_size * hid * (1 if self.tie_word_embeddings else 2) + hid
        return main, fp32

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "linear_num_heads", "linear_head_dim",
                     "linear_conv_kernel_dim", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "v_head_dim", "index_topk", "index_head_dim", "index_n_heads", "index_kpool", "hc_mult",
                     "hc_sinkhorn_iters"):
            _check_int(name, getattr(self, name), low=1)
        if self.q_lora_rank is None:
            raise ValueError("config field `q_lora_rank` is required: the DSA indexer reads the query latent")
        _check_int("q_lora_rank", self.q_lora_rank, low=1)
        if self.qk_rope_head_dim != 0:
            raise ValueError(f"config field `qk_rope_head_dim` must be 0 (GLM-5-Next's MLA is NoPE), "
                             f"got {self.qk_rope_head_dim!r}")
        if self.index_topk % self.index_kpool:
            raise ValueError(f"config field `index_topk` ({self.index_topk}) must be a multiple of "
                             f"`index_kpool` ({self.index_kpool})")
        for name in ("rms_norm_eps", "hc_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"config field `{name}` must be > 0, got {value!r}")
        lb = self.linear_lower_bound
        if lb is not None and not (isinstance(lb, (int, float)) and math.isfinite(lb) and lb < 0):
            raise ValueError(f"config field `linear_lower_bound` must be a finite negative number, got {lb!r}")
        lim = self.swiglu_limit
        if lim is not None and not (isinstance(lim, (int, float)) and lim > 0):
            raise ValueError(f"config field `swiglu_limit` must be > 0, got {lim!r}")
        n = self.num_hidden_layers
        for name, allowed in (("layer_types", (LINEAR, INDEXED)), ("mlp_layer_types", (DENSE, SPARSE)),
                              ("indexer_types", (FULL_INDEXER, SHARED_INDEXER))):
            kinds = getattr(self, name)
            if len(kinds) != n:
                raise ValueError(f"config field `{name}` has {len(kinds)} entries for {n} layers")
            bad = sorted({str(k) for k in kinds if k not in allowed})
            if bad:
                raise ValueError(f"config field `{name}` has unknown kinds {bad}; expected {list(allowed)}")
        for i in self.attention_layers:
            self.selection_source(i)
        if DENSE in self.mlp_layer_types:
            _check_int("intermediate_size", self.intermediate_size, low=1)
        if SPARSE in self.mlp_layer_types:
            _check_int("moe_intermediate_size", self.moe_intermediate_size, low=1)
            _check_int("num_experts", self.num_experts, low=1)
            _check_int("num_experts_per_tok", self.num_experts_per_tok, low=1, high=self.num_experts)
            _check_int("n_shared_experts", self.n_shared_experts, low=0)
            _check_int("n_group", self.n_group, low=1, high=self.num_experts)
            _check_int("topk_group", self.topk_group, low=1, high=self.n_group)
            if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
                raise ValueError(f"config field `n_group` ({self.n_group}) must divide `num_experts` "
                                 f"({self.num_experts}) into groups of >= 2 experts")

    @classmethod
    def from_hf_dict(cls, d: dict) -> Glm5NextConfig:
        """Build from a parsed `config.json`: model_type "glm5_next" (text fields under
        `text_config`, or at the top level) or "glm5_next_text"."""
        if d.get("model_type") not in (MODEL_TYPE, TEXT_MODEL_TYPE):
            raise ValueError(f"model_type {d.get('model_type')!r} is not {MODEL_TYPE!r}")
        t = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
        act = t.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config field `hidden_act` must be 'silu', got {act!r}")
        n = _req(t, "num_hidden_layers")
        _check_int("num_hidden_layers", n, low=1)
        lac = t.get("linear_attn_config") or {}
        kw = dict(vocab_size=_req(t, "vocab_size"), hidden_size=_req(t, "hidden_size"), num_hidden_layers=n,
                  layer_types=_layer_types(t, n), mlp_layer_types=_mlp_layer_types(t, n),
                  indexer_types=_indexer_types(t, n), dtype=d.get("dtype", d.get("torch_dtype", t.get("dtype"))),
                  has_vision=d.get("vision_config") is not None, extra=dict(d))
        for name in (
            "intermediate_size", "rms_norm_eps", "swiglu_limit", "linear_num_heads", "linear_head_dim",
            "linear_conv_kernel_dim", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "attention_bias", "index_topk", "index_head_dim", "index_n_heads",
            "index_kpool", "index_kpool_always_select_tail", "hc_mult", "hc_eps", "hc_sinkhorn_iters",
            "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
            "norm_topk_prob", "routed_scaling_factor", "bos_token_id", "eos_token_id", "pad_token_id",
        ):
            if t.get(name) is not None:
                kw[name] = t[name]
        for name in ("linear_lower_bound", "q_lora_rank", "swiglu_limit"):  # an explicit null means "none"
            if name in t:
                kw[name] = t[name]
        for ours, key in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                          ("linear_conv_kernel_dim", "short_conv_kernel_size"),
                          ("linear_lower_bound", "gate_lower_bound")):
            if lac.get(key) is not None:
                kw[ours] = lac[key]
        if lac.get("safe_gate", True) and kw.get("linear_lower_bound", -5.0) is None:
            kw["linear_lower_bound"] = -5.0
        for key in ("n_routed_experts", "num_local_experts"):
            if t.get(key) is not None:
                kw["num_experts"] = t[key]
                break
        kw["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", t.get("tie_word_embeddings", False)))
        if kw["tie_word_embeddings"]:
            raise ValueError("config field `tie_word_embeddings` is true: GLM-5-Next checkpoints keep their own "
                             "lm_head, tied embeddings are not supported")
        return cls(**kw)

    TRANSFORMERS_NAMES = TransformersNames(
        model_class="Glm5NextForConditionalGeneration",
        renames=((".self_attn.forget_gate.", ".self_attn."), (".attn_hc.", ".hc_attn_"), (".ffn_hc.", ".hc_ffn_")),
        fused_conv=True,
        expert_pieces={"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
    )

    @staticmethod
    def first_layers_hf_dict(d: dict, layers: int) -> dict:
        """A copy of config.json contents `d` for the model's first `layers` layers (the same
        schedule prefix: explicit per-layer lists and patterns are shortened, the default
        schedules give their own prefix)."""
        d = copy.deepcopy(d)
        t = d["text_config"] if isinstance(d.get("text_config"), dict) else d
        t["num_hidden_layers"] = layers
        for key in ("layer_types", "mlp_layer_types", "indexer_types", "index_topk_pattern"):
            if t.get(key) is not None:
                t[key] = t[key][:layers]
        return d

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Glm5NextConfig:
        """Read `path` (a config.json, or a directory holding one)."""
        return cls.from_hf_dict(read_config_json(path))


def _layer_types(t: dict, n: int) -> list[str]:
    if t.get("layer_types") is not None:
        return [INDEXED if k == "full_attention" else k for k in t["layer_types"]]
    return [INDEXED if i % 4 == 3 else LINEAR for i in range(n)]


def _mlp_layer_types(t: dict, n: int) -> list[str]:
    if t.get("mlp_layer_types") is not None:
        return list(t["mlp_layer_types"])
    return [DENSE if i < 3 else SPARSE for i in range(n)]


def _indexer_types(t: dict, n: int) -> list[str]:
    if t.get("indexer_types") is not None:
        return list(t["indexer_types"])
    pattern = t.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            letters = {"F": FULL_INDEXER, "S": SHARED_INDEXER}
            bad = sorted(set(pattern) - set(letters))
            if bad:
                raise ValueError(f"config field `index_topk_pattern` has letters {bad}; expected 'F' / 'S'")
            return [letters[c] for c in pattern]
        return list(pattern)
    freq = t.get("index_topk_freq", 1)
    offset = t.get("index_skip_topk_offset", 2)
    for name, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config field `{name}` must be an integer, got {value!r}")
    freq = max(freq, 1)
    return [FULL_INDEXER if max(i - offset + 1, 0) % freq == 0 else SHARED_INDEXER for i in range(n)]
