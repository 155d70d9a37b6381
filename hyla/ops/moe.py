"""Mixture-of-experts ops: the two routing rules, and routed SwiGLU experts over stacked weights.

Routing (`sigmoid_topk_route`, `softmax_topk_route`) runs as one Triton kernel on CUDA
(hyla.ops.triton.moe_routing) and as torch ops elsewhere. The experts:

    y[m] = sum_j weights[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])),   e = ids[m, j]

Weights are stacked once at load time, in the layout transformers 5 keeps in memory:
    w13: [E, 2I, H]  rows 0..I-1 the gate projection, rows I..2I-1 the up projection
    w2:  [E, H, I]   the down projection

Three implementations with one contract (x: [M, H], weights: [M, k] fp32, ids: [M, k] int64 ->
[M, H] in x.dtype):

- `moe_experts_naive`: the loop oracle (one expert after another, tokens gathered on the host);
- `moe_experts_torch`: (token, expert) pairs sorted by expert on the device, then two grouped
  GEMMs (`torch.nn.functional.grouped_mm`) with per-expert offsets that never leave the device;
  fp64 (which grouped_mm does not take) multiplies each pair by its gathered expert instead.
  No host sync and fixed shapes for a given M, so a CUDA graph can capture it;
- the Triton fused-MoE kernels (hyla.ops.triton.fused_moe), which `moe_experts` picks on CUDA.

The k contributions of a token are summed in a fixed order (never with atomics), so a result
does not depend on the run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyla.ops.gated_act import SILU, GatedActivation
from hyla.ops.moe_pairs import check_expert_shapes
from hyla.ops.moe_pairs import expert_counts, sort_pairs_by_expert
from hyla.ops.utils import work_dtype

# torch.nn.functional.grouped_mm is the public name from torch 2.10 on; older builds have the op only.
_GROUPED_MM = getattr(F, "grouped_mm", None) or torch._grouped_mm

__all__ = ["sigmoid_topk_route", "softmax_topk_route", "moe_experts", "moe_experts_naive", "moe_experts_torch", "sort_pairs_by_expert",
           "expert_counts"]


def moe_experts_naive(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """The oracle: every (token, slot) pair through its expert in a python loop, summed over the
    k slots in slot order. Same contract as `moe_experts`."""
    check_expert_shapes(x, w13, w2, weights, ids)
    I = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=work_dtype(x))
    for m in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            gu = w13[e] @ x[m]
            h = F.silu(gu[:I]) * gu[I:]
            out[m] += weights[m, j].to(out.dtype) * (w2[e] @ h).to(out.dtype)
    return out.to(x.dtype)


def _grouped(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, ids_sorted: torch.Tensor) -> torch.Tensor:
    """Rows a [P, K] (sorted by expert) times their expert's w[e].T ([E, N, K]) -> [P, N]."""
    if a.dtype == torch.float64 or (a.is_cuda and a.dtype != torch.bfloat16):
        # grouped_mm takes no fp64 (and only bf16 on CUDA): gather each pair's expert instead
        return torch.bmm(w[ids_sorted], a[:, :, None])[:, :, 0]
    return _GROUPED_MM(a, w.transpose(1, 2), offs=ends)


def moe_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, activation: GatedActivation = SILU) -> torch.Tensor:
    """Sorted pairs and grouped GEMMs on the device (see the module docstring); `activation`
    between the two GEMMs (hyla.ops.gated_act)."""
    check_expert_shapes(x, w13, w2, weights, ids)
    M, k = ids.shape
    I = w13.shape[1] // 2
    order, ends = sort_pairs_by_expert(ids, w13.shape[0])
    ids_sorted = ids.reshape(-1)[order]
    xs = x[order // k]  # [P, H] the token of each sorted pair
    gu = _grouped(xs, w13, ends, ids_sorted)  # [P, 2I]
    h = activation(gu[:, :I], gu[:, I:])
    y = _grouped(h, w2, ends, ids_sorted)  # [P, H]
    work = work_dtype(x)
    unsorted = torch.empty_like(y, dtype=work).index_copy_(0, order, y.to(work))  # back to [M*k] pair order
    out = (unsorted.view(M, k, -1) * weights.to(work)[:, :, None]).sum(1)
    return out.to(x.dtype)


def _route_kernel(logits: torch.Tensor, top_k: int, num_group: int):
    """The Triton routing module when it takes this call (CUDA, not fp64, its limits), else None."""
    from hyla.ops import dispatch

    if dispatch.backend_for(logits, logits, [logits], heads=False) != "triton":
        return None
    from hyla.ops.triton import moe_routing

    return moe_routing if moe_routing.supports(logits.shape[-1], top_k, num_group) else None


def _append_shared(weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                   shared_logit: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One more slot per token for a shared expert stacked as expert E (= num_experts): weight
    1, or sigmoid(shared_logit [M]) (Qwen3-Next's gated shared expert)."""
    w = torch.ones_like(weights[:, :1]) if shared_logit is None else shared_logit.to(weights.dtype).sigmoid()[:, None]
    return torch.cat([weights, w], 1), torch.cat([ids, torch.full_like(ids[:, :1], num_experts)], 1)


def sigmoid_topk_route(logits: torch.Tensor, top_k: int, bias: torch.Tensor, num_group: int = 1,
                       topk_group: int = 1, renormalize: bool = True, scale: float = 1.0,
                       shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 "noaux_tc" routing (Kimi-Linear). logits: [M, E] (fp32, or fp64) ->
    (weights [M, k] in logits.dtype, ids [M, k] int64):
        s = sigmoid(logits), c = s + bias (used only to choose);
        groups scored by the sum of their top-2 c, the best `topk_group` groups kept;
        the top-k experts by c inside them, weighted by s, renormalised to sum 1, times scale.
    shared: append slot k with expert id E and weight 1 (a shared expert stacked as expert E)."""
    kernel = _route_kernel(logits, top_k, num_group)
    if kernel is not None:
        return kernel.route(logits, top_k, sigmoid=True, bias=bias, num_group=num_group, topk_group=topk_group,
                            renormalize=renormalize, scale=scale, shared=shared)
    E = logits.shape[-1]
    scores = logits.sigmoid()
    choice = scores + bias.to(logits.dtype)
    if num_group > 1:
        group_scores = choice.view(-1, num_group, E // num_group).topk(2, dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]  # [M, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()  # [M, G]
        choice = choice.masked_fill(~group_mask.repeat_interleave(E // num_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * scale
    return _append_shared(weights, ids, E, None) if shared else (weights, ids)


def softmax_topk_route(logits: torch.Tensor, top_k: int, renormalize: bool = True,
                       shared_logit: torch.Tensor | None = None,
                       shared_gate: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (Qwen3-Next). logits: [M, E] -> (weights [M, k], ids [M, k]):
    p = softmax(logits); the top-k by p, weighted by p (divided by their sum when renormalize).
    shared_logit [M]: append slot k with expert id E and weight sigmoid(shared_logit).
    shared_gate (x [M, H], w [1, H]): that logit as F.linear(x, w)[:, 0], which the routing kernel
    computes itself at a decode step's rows (dispatch.projects_in_kernel: one launch fewer a
    layer); elsewhere the linear runs here."""
    from hyla.ops import dispatch

    kernel = _route_kernel(logits, top_k, 1)
    if shared_gate is not None and (kernel is None or not dispatch.projects_in_kernel(logits.shape[0])):
        shared_logit, shared_gate = F.linear(*shared_gate)[:, 0], None
    if kernel is not None:
        return kernel.route(logits, top_k, sigmoid=False, renormalize=renormalize, shared_logit=shared_logit,
                            shared_gate=shared_gate)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return _append_shared(weights, ids, logits.shape[-1], shared_logit) if shared_logit is not None else (weights, ids)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, activation: GatedActivation = SILU) -> torch.Tensor:
    """x: [M, H]; w13: [E, 2I, H]; w2: [E, H, I]; weights: [M, k] fp32; ids: [M, k] int64 ->
    [M, H] in x.dtype; `activation`: the experts' gated activation (SwiGLU by default). The
    Triton fused-MoE kernels on CUDA (no grad, not fp64; HYLA_BACKEND overrides as for the other
    ops), the sorted grouped GEMMs elsewhere."""
    from hyla.ops import dispatch

    if dispatch.backend_for(x, x, [x, w13, w2], heads=False) == "triton":
        from hyla.ops.triton.fused_moe import fused_moe

        return fused_moe(x, w13, w2, weights, ids, activation=activation)
    return moe_experts_torch(x, w13, w2, weights, ids, activation)
