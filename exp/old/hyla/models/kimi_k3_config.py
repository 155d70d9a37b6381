"""The Kimi K3 configuration: a `kimi_k3` config.json whose `text_config` is `kimi_linear`-style.

K3 reuses Kimi-Linear's fields and key precedence (hyla.models.config: 1-based
`linear_attn_config.{kda_layers, full_attn_layers}`, `first_k_dense_replace`, the safe gate's
`gate_lower_bound`, `use_full_rank_gate`) and adds:

- `attn_res_block_size`: block Attention Residuals (hyla.layers.attn_residual), required;
- `routed_expert_hidden_size`: the latent width of the routed experts (None: no latent
  projections), `latent_moe_use_norm`: RMSNorm on the experts' weighted sum (hyla.layers.latent_moe);
- `hidden_act: "situ"` with `activation_situ_beta` / `activation_situ_linear_beta` (hyla.layers.situ);
- `mla_use_output_gate`: o_proj(attn * sigmoid(g_proj(x))) on the MLA layers (hyla.layers.gated_mla).

KDA's `A_log` is stored with head_dim entries; the gate reads the first num_heads of them.
Weights live under `language_model.model.*` and `language_model.lm_head`; a vision tower, if
present, is not built. The released experts are MXFP4 (`quantization_config`, hyla.models.mxfp4).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields

from hyla.models.config import DENSE, FULL, LINEAR, SPARSE, KimiLinearConfig, LayerSizes, _check_int

# K3 fields that Kimi-Linear's parser rejects or does not know; read here, hidden from it.
_K3_KEYS = ("attn_res_block_size", "routed_expert_hidden_size", "latent_moe_use_norm", "hidden_act",
            "activation_situ_beta", "activation_situ_linear_beta", "mla_use_output_gate")


@dataclass
class KimiK3Config(KimiLinearConfig):
    """KimiLinearConfig plus K3's fields (layer lists 0-based, one entry per layer)."""

    attn_res_block_size: int = 1
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    mla_use_output_gate: bool = False
    quantization_config: dict | None = None

    # transformers has no K3 class, so there is no transformers peer to benchmark against
    # (hyla.bench.hf_peer); the tests' oracle is tests.oracles.kimi_k3_oracle.
    TRANSFORMERS_NAMES = None

    @property
    def model_type(self) -> str:
        return "kimi_k3"

    @property
    def num_attn_res_blocks(self) -> int:
        """Snapshots the bank holds after the last layer: ceil(layers / block size)."""
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    def validate(self) -> None:
        super().validate()
        _check_int("attn_res_block_size", self.attn_res_block_size, low=1)
        if self.routed_expert_hidden_size is not None:
            _check_int("routed_expert_hidden_size", self.routed_expert_hidden_size, low=1)
        if self.hidden_act != "situ":
            raise ValueError(f"config field `hidden_act` must be 'situ' for kimi_k3, got {self.hidden_act!r}")
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            v = getattr(self, name)
            if v is None and name == "activation_situ_linear_beta":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"config field `{name}` must be a positive number, got {v!r}")
        if self.tie_word_embeddings:
            raise ValueError("config field `tie_word_embeddings` must be false for kimi_k3 (its lm_head is stored)")

    def layer_sizes(self) -> LayerSizes:
        return super().layer_sizes()  # KDA states and MLA latents, as Kimi-Linear

    def kda_parameters(self) -> tuple[int, int]:
        """(model-dtype, fp32) parameters of one KDA layer's self_attn: q/k/v/g/o projections,
        f_a/f_b, b_proj, o_norm; in fp32 the three depthwise convs [H*K, 1, W], dt_bias [H*K]
        and A_log [K] (KimiK3ForCausalLM.fp32_tensors, hyla.models.memory.FP32_TENSORS)."""
        hid, h, k = self.hidden_size, self.linear_num_heads, self.linear_head_dim
        d = h * k
        gate = hid * d if self.use_full_rank_gate else hid * k + k * d
        main = 3 * hid * d + hid * k + k * d + hid * h + gate + k + d * hid
        return main, 3 * d * self.conv_kernel_size + d + k

    def mla_parameters(self) -> int:
        """Parameters of one MLA layer's self_attn (with its output gate)."""
        hid, h, qk, r, b = (self.hidden_size, self.num_attention_heads, self.qk_head_dim, self.kv_lora_rank,
                            int(self.attention_bias))
        main = hid * h * qk if self.q_lora_rank is None else hid * self.q_lora_rank + b * self.q_lora_rank + \
            self.q_lora_rank + self.q_lora_rank * h * qk
        main += (hid + b) * (r + self.qk_rope_head_dim) + r + r * h * (self.qk_nope_head_dim + self.v_head_dim)
        main += h * self.v_head_dim * hid + b * hid
        if self.mla_use_output_gate:
            main += hid * h * self.v_head_dim
        return main

    def moe_parameters(self) -> tuple[int, int, int]:
        """(routed expert parameters, other model-dtype parameters, fp32 parameters) of one
        latent MoE block: experts w1/w3/w2 in the latent width; the down / up projections, the
        latent norm and the shared experts; the router weight and its correction bias."""
        hid, e, im = self.hidden_size, self.num_experts, self.moe_intermediate_size
        lat = self.routed_expert_hidden_size or hid
        routed = 3 * lat * im * e
        other = 3 * hid * im * self.num_shared_experts
        if self.routed_expert_hidden_size is not None:
            other += 2 * hid * lat + (lat if self.latent_moe_use_norm else 0)
        return routed, other, e * hid + e

    def parameter_counts(self) -> tuple[int, int]:
        """(parameters stored in the model dtype, parameters kept in fp32), from the config alone."""
        hid, main, fp32 = self.hidden_size, 0, 0
        for i, kind in enumerate(self.layer_types):
            main += 2 * hid + 2 * 2 * hid  # input / post-attention norms; two residual scorers (norm + proj)
            if kind == LINEAR:
                m, f = self.kda_parameters()
                main, fp32 = main + m, fp32 + f
            else:
                main += self.mla_parameters()
            if self.mlp_layer_types[i] == SPARSE:
                routed, other, f = self.moe_parameters()
                main, fp32 = main + routed + other, fp32 + f
            else:
                main += 3 * hid * self.intermediate_size
        main += 2 * self.vocab_size * hid + hid + 2 * hid  # embeddings, lm_head, final norm, output scorer
        return main, fp32

    @classmethod
    def from_hf_dict(cls, d: dict) -> KimiK3Config:
        """Build from a parsed `kimi_k3` config.json (its `text_config` holds the model)."""
        if d.get("model_type") != "kimi_k3":
            raise ValueError(f"unknown model_type {d.get('model_type')!r} for KimiK3Config, which reads 'kimi_k3'")
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("config field `text_config` must be an object (kimi_k3 keeps the model there)")
        text = dict(text, model_type="kimi_linear")
        if "attn_res_block_size" not in text or text["attn_res_block_size"] is None:
            raise ValueError("config field `attn_res_block_size` is required for kimi_k3")
        k3 = {key: text.pop(key) for key in _K3_KEYS if key in text}
        text.setdefault("dtype", d.get("dtype", d.get("torch_dtype")))
        base = KimiLinearConfig.from_hf_dict(text)
        kw = {f.name: getattr(base, f.name) for f in fields(KimiLinearConfig)}
        kw["extra"] = dict(d)
        quant = d.get("quantization_config", text.get("quantization_config"))
        return cls(**kw, **{k: v for k, v in k3.items() if v is not None or k == "activation_situ_linear_beta"},
                   quantization_config=quant)

    @staticmethod
    def first_layers_hf_dict(d: dict, layers: int) -> dict:
        """A copy of config.json contents `d` for the model's first `layers` layers."""
        d = copy.deepcopy(d)
        d["text_config"] = KimiLinearConfig.first_layers_hf_dict(d["text_config"], layers)
        return d


__all__ = ["KimiK3Config", "DENSE", "FULL", "LINEAR", "SPARSE"]
