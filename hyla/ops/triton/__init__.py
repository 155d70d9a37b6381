"""Triton kernels for hyla.ops (forward only): chunk prefill with in-kernel checkpoints,
decode / speculative verify over a state pool, the short-conv update of a decode step, and the
fused norms and gates of a decode step (hyla.ops.triton.norm, hyla.ops.triton.gate). Same contracts as the torch modules
hyla.ops.chunk and hyla.ops.recurrent; hyla.ops dispatches here for CUDA tensors.

On a machine without a GPU the kernels still run under Triton's interpreter
(TRITON_INTERPRET=1 set before triton is imported), which is how CI tests them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

__all__ = ["is_available", "interpreting", "chunk_kda", "chunk_gated_delta_rule", "chunk_delta_rule",
           "fused_recurrent_kda", "fused_recurrent_gated_delta_rule", "causal_conv1d_update",
           "causal_conv1d_verify", "rms_norm_rounded", "rms_norm_zero_centred", "add_rms_norm", "gated_rms_norm",
           "lowrank_gated_rms_norm", "silu_gated_rms_norm", "kda_gate_beta", "kda_lowrank_gate_beta", "gdn_gate_beta",
           "gdn_projected_gate_beta", "causal_conv1d_update_packed", "causal_conv1d_fn",
           "causal_conv1d_prefill_packed", "write_latents", "paged_mla_decode", "qk_norm_rope_write", "paged_window_attention",
           "silu_mul", "mtp_fc_input", "derive_step_rows"]


def is_available() -> bool:
    """True when triton can be imported (it does not say whether a GPU is present)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def __getattr__(name):
    # Lazy: importing hyla.ops must not import triton (it is an optional dependency).
    modules = {"chunk_kda": "chunk", "chunk_gated_delta_rule": "chunk", "chunk_delta_rule": "chunk",
               "fused_recurrent_kda": "recurrent", "fused_recurrent_gated_delta_rule": "recurrent",
               "causal_conv1d_update": "conv", "causal_conv1d_verify": "conv", "causal_conv1d_update_packed": "conv",
               "rms_norm_rounded": "norm", "rms_norm_zero_centred": "norm", "add_rms_norm": "norm",
               "gated_rms_norm": "norm", "lowrank_gated_rms_norm": "norm", "silu_gated_rms_norm": "norm",
               "kda_gate_beta": "gate", "kda_lowrank_gate_beta": "gate", "gdn_gate_beta": "gate",
               "gdn_projected_gate_beta": "gate",
               "causal_conv1d_fn": "conv_prefill", "causal_conv1d_prefill_packed": "conv_prefill",
               "write_latents": "mla", "paged_mla_decode": "mla",
               "qk_norm_rope_write": "paged_attention", "paged_window_attention": "paged_attention",
               "mtp_fc_input": "mtp_input",
               "silu_mul": "gated_act", "derive_step_rows": "step_rows"}
    if name in modules:
        return getattr(importlib.import_module(f"hyla.ops.triton.{modules[name]}"), name)
    raise AttributeError(f"module 'hyla.ops.triton' has no attribute {name!r}")
