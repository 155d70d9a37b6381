"""The shared parts of every MoE experts implementation: the shape contract of the stacked
weights, and (token, expert) pairs sorted by expert on the device (hyla.ops.moe's torch path and
hyla.ops.triton.fused_moe both start from them)."""

from __future__ import annotations

import torch


def check_expert_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor) -> None:
    """x [M, H], w13 [E, 2I, H], w2 [E, H, I], weights / ids [M, k]; ValueError naming the mismatch."""
    if x.ndim != 2 or w13.ndim != 3 or w2.ndim != 3:
        raise ValueError(f"expected x [M, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    E, two_i, H = w13.shape
    if two_i % 2 or x.shape[1] != H or tuple(w2.shape) != (E, H, two_i // 2):
        raise ValueError(f"inconsistent expert shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if weights.shape != ids.shape or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"weights and ids must both be [M={x.shape[0]}, k]; got {tuple(weights.shape)}, "
                         f"{tuple(ids.shape)}")


def expert_counts(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """flat_ids: [P] int64 -> pairs per expert [E] int64. A scatter-add, not torch.bincount,
    which reads the largest id back on the host on CUDA to size its output."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    return counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))


def sort_pairs_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: [M, k] -> (order [M*k]: flat pair indices sorted by expert (stable), ends [E] int32:
    cumulative pair counts, i.e. expert e owns sorted rows ends[e-1]..ends[e]-1). On the device."""
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = expert_counts(flat, num_experts)
    return order, counts.cumsum(0).to(torch.int32)
