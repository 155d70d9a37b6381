"""Memory report for a model config (any family): weights, per-request state, per-token KV.

Everything is computed from the config alone (no weights needed), so the report for a 48B / 80B
checkpoint costs nothing. This module knows no family: it counts the linear and attention layers
of `config.layer_types` and asks the config for the rest, `config.layer_sizes()` (a LayerSizes:
the layer kinds and what one layer of each kind caches) and `config.parameter_counts()`; each
family answers in its own config module. What a serving engine has to budget for:
- per state slot (a request holds one, or 1 + k with "slots" speculation, plus the prefix
  cache's checkpoints): each linear layer's recurrent state HV x K x V (fp32 by default)
  plus its conv windows in the model dtype: KDA three (q, k, v), each H*K x (W-1); Gated
  DeltaNet one over its q|k|v channels, (2*H*K + HV*V) x (W-1);
- per token: each MLA layer's latent, kv_lora_rank + qk_rope_head_dim values; each full-attention
  (GQA) layer's key and value, 2 x Hkv x head_dim values; in the model dtype, or with FP8 pages
  (kv_cache_dtype "fp8", hyla.ops.kv_fp8) one byte each plus 4 per fp32 scale
  (LayerSizes.kv_scales_per_token: 2 per MLA latent with a positional part, 1 without, 2 x Hkv
  per GQA layer);
- weights: every tensor of the checkpoint, the few kept in fp32 (FP32_TENSORS) at 4 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.models.config import FULL, LINEAR
from hyla.ops import kv_fp8

# Tensors the loader keeps in fp32 whatever the model dtype: they feed exponentials, sigmoids
# and top-k choices where bf16 rounding changes results (transformers keeps the router's and
# dt_bias in fp32 too; A_log is stored in fp32 by the released checkpoints). ".gate.weight" is
# an MoE router (Kimi's block_sparse_moe.gate, Qwen3-Next's mlp.gate), not Qwen3-Next's
# shared_expert_gate, which stays in the model dtype as in transformers. GLM-5-Next keeps its
# hyper-connections' base and scale in fp32 (transformers' _keep_in_fp32_modules_strict).
FP32_TENSORS = ("dt_bias", "A_log", ".gate.weight", ".gate.e_score_correction_bias",
                "hc_attn_base", "hc_attn_scale", "hc_ffn_base", "hc_ffn_scale")  # GLM-5-Next's mHC


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def state_bytes_per_slot(config, state_dtype=torch.float32, dtype=torch.bfloat16) -> int:
    """Bytes of one state slot over all linear layers (recurrent state + conv windows)."""
    return _recurrent_bytes(config, state_dtype) + _conv_bytes(config, dtype)


def _num_layers(config, kind: str) -> int:
    """Layers of `kind`; FULL counts every non-linear layer (GLM-5-Next calls its attention
    layers "indexed_attention")."""
    if kind == FULL:
        return sum(t != LINEAR for t in config.layer_types)
    return sum(t == kind for t in config.layer_types)


def _recurrent_bytes(config, state_dtype) -> int:
    return _num_layers(config, LINEAR) * config.layer_sizes().state_per_slot * _nbytes(state_dtype)


def _conv_bytes(config, dtype) -> int:
    return _num_layers(config, LINEAR) * config.layer_sizes().conv_per_slot * _nbytes(dtype)


def kv_bytes_per_token(config, dtype=torch.bfloat16, kv_cache_dtype: str = "auto") -> int:
    """Bytes of cached KV per token over all attention layers (MLA latents or GQA keys + values):
    in dtype, or with kv_cache_dtype "fp8" / "fp8_e4m3" one byte per value plus the fp32 scales."""
    sizes = config.layer_sizes()
    if kv_fp8.is_fp8_kv(kv_cache_dtype):
        per_layer = sizes.kv_per_token * 1 + sizes.kv_scales_per_token * _nbytes(kv_fp8.SCALE_DTYPE)
    else:
        per_layer = sizes.kv_per_token * _nbytes(dtype)
    return _num_layers(config, FULL) * per_layer


def parameter_counts(config) -> tuple[int, int]:
    """(parameters stored in the model dtype, parameters kept in fp32): the family's count."""
    return config.parameter_counts()


@dataclass
class MemoryReport:
    """Bytes a deployment of one model needs (all integers are bytes unless named otherwise)."""

    num_linear_layers: int
    num_attention_layers: int
    dtype: torch.dtype
    state_dtype: torch.dtype
    num_parameters: int
    weight_bytes: int
    recurrent_state_bytes_per_request: int
    conv_state_bytes_per_request: int
    kv_bytes_per_token: int
    linear_kind: str  # LayerSizes.linear_kind, e.g. "KDA" | "GDN"
    attention_kind: str  # e.g. "MLA" | "GQA"
    kv_contents: str  # e.g. "MLA latents" | "keys + values"
    kv_cache_dtype: str = "auto"  # "fp8": e4m3 pages with fp32 scales (hyla.ops.kv_fp8)

    @property
    def num_kda_layers(self) -> int:  # the names of the Kimi-only report
        return self.num_linear_layers

    @property
    def num_mla_layers(self) -> int:
        return self.num_attention_layers

    @property
    def state_bytes_per_request(self) -> int:
        return self.recurrent_state_bytes_per_request + self.conv_state_bytes_per_request

    def __str__(self) -> str:
        def mib(b):
            return f"{b / 2**20:,.2f} MiB"

        dt, st = str(self.dtype).replace("torch.", ""), str(self.state_dtype).replace("torch.", "")
        return "\n".join([
            f"layers            {self.num_linear_layers} {self.linear_kind} + {self.num_attention_layers} "
            f"{self.attention_kind}",
            f"weights           {self.weight_bytes / 2**30:,.2f} GiB ({self.num_parameters:,} parameters, {dt})",
            f"state / request   {mib(self.state_bytes_per_request)} = recurrent "
            f"{mib(self.recurrent_state_bytes_per_request)} ({st}) + conv {mib(self.conv_state_bytes_per_request)}",
            f"KV / token        {self.kv_bytes_per_token:,} B ({self.kv_contents}, "
            f"{dt if not kv_fp8.is_fp8_kv(self.kv_cache_dtype) else 'fp8 e4m3 + fp32 scales'})",
        ])


def memory_report(config, dtype: torch.dtype = torch.bfloat16,
                  state_dtype: torch.dtype = torch.float32, weight_bytes: int | None = None,
                  kv_cache_dtype: str = "auto") -> MemoryReport:
    """Report for `config` with weights / conv windows / KV in `dtype` and recurrent states in
    `state_dtype`. weight_bytes: the measured size of a loaded model (computed when None).
    kv_cache_dtype "fp8": KV pages in e4m3 with their scales."""
    main, fp32 = parameter_counts(config)
    if weight_bytes is None:
        weight_bytes = main * _nbytes(dtype) + fp32 * 4
    sizes = config.layer_sizes()
    return MemoryReport(
        num_linear_layers=_num_layers(config, LINEAR), num_attention_layers=_num_layers(config, FULL), dtype=dtype,
        state_dtype=state_dtype, num_parameters=main + fp32, weight_bytes=weight_bytes,
        recurrent_state_bytes_per_request=_recurrent_bytes(config, state_dtype),
        conv_state_bytes_per_request=_conv_bytes(config, dtype),
        kv_bytes_per_token=kv_bytes_per_token(config, dtype, kv_cache_dtype),
        linear_kind=sizes.linear_kind, attention_kind=sizes.attention_kind, kv_contents=sizes.kv_contents,
        kv_cache_dtype=kv_cache_dtype,
    )
