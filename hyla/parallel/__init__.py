"""hyla.parallel: context parallelism for linear-attention layers over torch.distributed.

- `chunk_kda_cp`, `chunk_gated_delta_rule_cp`: KCP forward (one all-gather of fixed-size
  (M, S~) slice summaries, a prefix scan, then the local chunked kernel) -- hyla.parallel.kcp
- `count_comm_bytes`, `kcp_comm_bytes`, `softmax_cp_comm_bytes`: what is sent, measured and predicted
- `simulate_kcp`, `scan_summaries`: the same computation in one process
"""

from hyla.parallel.kcp import (
    CommCounter,
    chunk_gated_delta_rule_cp,
    chunk_kda_cp,
    count_comm_bytes,
    kcp_comm_bytes,
    scan_summaries,
    simulate_kcp,
    softmax_cp_comm_bytes,
)

__all__ = [
    "chunk_kda_cp", "chunk_gated_delta_rule_cp", "count_comm_bytes", "CommCounter",
    "kcp_comm_bytes", "softmax_cp_comm_bytes", "scan_summaries", "simulate_kcp",
]
