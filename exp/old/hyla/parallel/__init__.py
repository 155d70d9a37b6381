"""hyla.parallel: context and tensor parallelism over torch.distributed.

Tensor / expert parallelism (`LLM(model, tensor_parallel_size=N, enable_expert_parallel=...)`):
workers.py (the worker processes, rank 0 = the engine's process), worker.py (what each rank
runs), runner.py (the engine's runner that broadcasts each step), tensor.py (sharding by hooks
and per-rank configs), plans.py + tp_<family>.py (what each family splits how).

Context parallelism:

- `chunk_kda_cp`, `chunk_gated_delta_rule_cp`: KCP forward (one local chunked pass giving the
  slice's outputs from a zero state and its fixed-size (M, S~) summary, one all-gather, a prefix
  scan, then one matmul adding the incoming state's share) -- hyla.parallel.kcp
- `local_pass`, `add_incoming`: the two local halves of that forward
- `count_comm_bytes`, `kcp_comm_bytes`, `softmax_cp_comm_bytes`: what is sent, measured and predicted
- `simulate_kcp`, `scan_summaries`: the same computation in one process
"""

from hyla.parallel.kcp import (
    CommCounter,
    add_incoming,
    balanced_slice_lengths,
    chunk_gated_delta_rule_cp,
    chunk_kda_cp,
    count_comm_bytes,
    first_pass,
    kcp_comm_bytes,
    local_pass,
    scan_summaries,
    simulate_kcp,
    softmax_cp_comm_bytes,
)

__all__ = [
    "chunk_kda_cp", "chunk_gated_delta_rule_cp", "local_pass", "first_pass", "add_incoming",
    "balanced_slice_lengths", "count_comm_bytes",
    "CommCounter", "kcp_comm_bytes", "softmax_cp_comm_bytes", "scan_summaries", "simulate_kcp",
]
