"""hyla.ops: linear-attention recurrences (KDA, Gated DeltaNet, DeltaNet, linear attention).

- `naive_recurrent_*`: token loops, the oracle (hyla.ops.naive)
- `chunk_*`: stable chunkwise prefill with in-pass state checkpoints (hyla.ops.chunk)
- `fused_recurrent_*`: decode / speculative verify over a state pool (hyla.ops.recurrent)
  Both dispatch to the Triton kernels (hyla.ops.triton) for CUDA inputs; see hyla.ops.dispatch.
- short causal conv, gates, norms, the affine view, numerics helpers

Layout follows fla 0.6: q, k [B, T, H, K], v [B, T, HV, V], state [N, HV, K, V].
"""

from hyla.ops.affine import apply, compose, identity, prefix_scan, segment_affine
from hyla.ops.conv import causal_conv1d_fn
from hyla.ops.dispatch import (
    causal_conv1d_update,
    causal_conv1d_verify,
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
)
from hyla.ops.gate import gdn_gate, kda_gate
from hyla.ops.naive import (
    naive_recurrent_delta_rule,
    naive_recurrent_gated_delta_rule,
    naive_recurrent_kda,
    naive_recurrent_linear_attn,
)
from hyla.ops.norm import gated_rms_norm, l2norm, rms_norm
from hyla.ops.numerics import max_reciprocal_decay, safe_chunk_size

__all__ = [
    "chunk_kda", "chunk_gated_delta_rule", "chunk_delta_rule",
    "fused_recurrent_kda", "fused_recurrent_gated_delta_rule",
    "naive_recurrent_kda", "naive_recurrent_gated_delta_rule", "naive_recurrent_delta_rule",
    "naive_recurrent_linear_attn",
    "causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_verify", "kda_gate", "gdn_gate",
    "l2norm", "rms_norm", "gated_rms_norm",
    "segment_affine", "compose", "apply", "identity", "prefix_scan", "max_reciprocal_decay", "safe_chunk_size",
]
