"""Memory report for a model config (Kimi-Linear or Qwen3-Next): weights, per-request state,
per-token KV.

Everything is computed from the config alone (no weights needed), so the report for a 48B / 80B
checkpoint costs nothing. What a serving engine has to budget for:
- per request (one state slot): each linear layer's recurrent state HV x K x V (fp32 by default)
  plus its conv windows in the model dtype: KDA three (q, k, v), each H*K x (W-1); Gated
  DeltaNet one over its q|k|v channels, (2*H*K + HV*V) x (W-1);
- per token: each MLA layer's latent, kv_lora_rank + qk_rope_head_dim values; each full-attention
  (GQA) layer's key and value, 2 x Hkv x head_dim values; in the model dtype;
- weights: every tensor of the checkpoint, the few kept in fp32 (FP32_TENSORS) at 4 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.models.config import FULL, LINEAR, SPARSE

# Tensors the loader keeps in fp32 whatever the model dtype: they feed exponentials, sigmoids
# and top-k choices where bf16 rounding changes results (transformers keeps the router's and
# dt_bias in fp32 too; A_log is stored in fp32 by the released checkpoints). ".gate.weight" is
# an MoE router (Kimi's block_sparse_moe.gate, Qwen3-Next's mlp.gate), not Qwen3-Next's
# shared_expert_gate, which stays in the model dtype as in transformers.
FP32_TENSORS = ("dt_bias", "A_log", ".gate.weight", ".gate.e_score_correction_bias")


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _is_qwen3_next(config) -> bool:
    return config.model_type == "qwen3_next"


def state_bytes_per_slot(config, state_dtype=torch.float32, dtype=torch.bfloat16) -> int:
    """Bytes of one state slot over all linear layers (recurrent state + conv windows)."""
    return _recurrent_bytes(config, state_dtype) + _conv_bytes(config, dtype)


def _recurrent_bytes(c, state_dtype) -> int:
    if _is_qwen3_next(c):
        per_layer = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        return len(c.linear_layers) * per_layer * _nbytes(state_dtype)
    return len(c.kda_layers) * c.linear_num_heads * c.linear_head_dim ** 2 * _nbytes(state_dtype)


def _conv_bytes(c, dtype) -> int:
    if _is_qwen3_next(c):
        return len(c.linear_layers) * c.conv_dim * (c.linear_conv_kernel_dim - 1) * _nbytes(dtype)
    d = c.linear_num_heads * c.linear_head_dim
    return len(c.kda_layers) * 3 * d * (c.conv_kernel_size - 1) * _nbytes(dtype)


def kv_bytes_per_token(config, dtype=torch.bfloat16) -> int:
    """Bytes of cached KV per token over all attention layers (MLA latents or GQA keys + values)."""
    if _is_qwen3_next(config):
        return len(config.attention_layers) * 2 * config.num_key_value_heads * config.head_dim * _nbytes(dtype)
    return len(config.mla_layers) * (config.kv_lora_rank + config.qk_rope_head_dim) * _nbytes(dtype)


def parameter_counts(c) -> tuple[int, int]:
    """(parameters stored in the model dtype, parameters kept in fp32)."""
    if _is_qwen3_next(c):
        return _qwen3_next_parameter_counts(c)
    hid, main, fp32 = c.hidden_size, 0, 0
    for i, kind in enumerate(c.layer_types):
        main += 2 * hid  # input / post-attention norms
        if kind == LINEAR:
            h, k = c.linear_num_heads, c.linear_head_dim
            d = h * k
            gate = hid * d if c.use_full_rank_gate else hid * k + k * d
            main += 3 * hid * d + 3 * d * c.conv_kernel_size + hid * k + k * d + hid * h + gate + k + d * hid
            fp32 += d + h  # dt_bias, A_log
        else:
            h, qk, r, b = c.num_attention_heads, c.qk_head_dim, c.kv_lora_rank, int(c.attention_bias)
            if c.q_lora_rank is None:
                main += hid * h * qk
            else:
                ql = c.q_lora_rank
                main += hid * ql + b * ql + ql + ql * h * qk
            main += (hid + b) * (r + c.qk_rope_head_dim) + r + r * h * (c.qk_nope_head_dim + c.v_head_dim)
            main += h * c.v_head_dim * hid + b * hid
        if c.mlp_layer_types[i] == SPARSE:
            e, im = c.num_experts, c.moe_intermediate_size
            main += 3 * hid * im * (e + c.num_shared_experts)
            fp32 += e * hid + e  # router weight, e_score_correction_bias
        else:
            main += 3 * hid * c.intermediate_size
    main += c.vocab_size * hid * (1 if c.tie_word_embeddings else 2) + hid
    return main, fp32


def _qwen3_next_parameter_counts(c) -> tuple[int, int]:
    hid, main, fp32 = c.hidden_size, 0, 0
    for i, kind in enumerate(c.layer_types):
        main += 2 * hid  # input / post-attention norms
        if kind == LINEAR:
            hv, kd, vd = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
            key_dim, value_dim = c.linear_num_key_heads * kd, hv * vd
            main += hid * (2 * key_dim + 2 * value_dim) + hid * 2 * hv  # in_proj_qkvz, in_proj_ba
            main += c.conv_dim * c.linear_conv_kernel_dim + vd + value_dim * hid  # conv1d, norm, out_proj
            fp32 += 2 * hv  # dt_bias, A_log
        else:
            h, kv, d, b = c.num_attention_heads, c.num_key_value_heads, c.head_dim, int(c.attention_bias)
            main += (hid + b) * 2 * h * d + 2 * (hid + b) * kv * d + h * d * hid + b * hid + 2 * d
        if c.mlp_layer_types[i] == SPARSE:
            main += 3 * hid * (c.moe_intermediate_size * c.num_experts + c.shared_expert_intermediate_size) + hid
            fp32 += c.num_experts * hid  # router
        else:
            main += 3 * hid * c.intermediate_size
    main += c.vocab_size * hid * (1 if c.tie_word_embeddings else 2) + hid
    return main, fp32


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
    linear_kind: str = "KDA"  # "KDA" | "GDN"
    attention_kind: str = "MLA"  # "MLA" | "GQA"

    @property
    def num_kda_layers(self) -> int:  # the names of the Kimi-only report
        return self.num_linear_layers

    @property
    def num_mla_layers(self) -> int:
        return self.num_attention_layers

    @property
    def state_bytes_per_request(self) -> int:
        return self.recurrent_state_bytes_per_request + self.conv_state_bytes_per_request

    def kv_tokens_that_fit(self, free_bytes: int, num_requests: int) -> int:
        """KV tokens that fit in `free_bytes` after `num_requests` state slots."""
        left = free_bytes - num_requests * self.state_bytes_per_request
        return max(left, 0) // self.kv_bytes_per_token if self.kv_bytes_per_token else 0

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
            f"KV / token        {self.kv_bytes_per_token:,} B "
            f"({'MLA latents' if self.attention_kind == 'MLA' else 'keys + values'}, {dt})",
        ])


def memory_report(config, dtype: torch.dtype = torch.bfloat16,
                  state_dtype: torch.dtype = torch.float32, weight_bytes: int | None = None) -> MemoryReport:
    """Report for `config` with weights / conv windows / KV in `dtype` and recurrent states in
    `state_dtype`. weight_bytes: the measured size of a loaded model (computed when None)."""
    main, fp32 = parameter_counts(config)
    if weight_bytes is None:
        weight_bytes = main * _nbytes(dtype) + fp32 * 4
    qwen = _is_qwen3_next(config)
    n_linear = sum(t == LINEAR for t in config.layer_types)
    return MemoryReport(
        num_linear_layers=n_linear, num_attention_layers=sum(t == FULL for t in config.layer_types), dtype=dtype,
        state_dtype=state_dtype, num_parameters=main + fp32, weight_bytes=weight_bytes,
        recurrent_state_bytes_per_request=_recurrent_bytes(config, state_dtype),
        conv_state_bytes_per_request=_conv_bytes(config, dtype),
        kv_bytes_per_token=kv_bytes_per_token(config, dtype),
        linear_kind="GDN" if qwen else "KDA", attention_kind="GQA" if qwen else "MLA",
    )

