"""Mixture of experts with a sigmoid router (DeepSeek-V3 "noaux_tc" routing, as Kimi-Linear).

Routing, for each token (all in fp32, as transformers' KimiLinearTopkRouter):
    s = sigmoid(x W_r^T)                             [E]   affinity of every expert
    c = s + e_score_correction_bias                  [E]   used only to *choose* experts
    groups scored by the sum of their top-2 c; keep the best `topk_group` groups,
    pick the top-k experts by c inside them, weight them by s (not c),
    renormalise the k weights to sum to 1 (moe_renormalize), then scale by routed_scaling_factor.
Output = sum_k w_k * expert_k(x) + shared_experts(x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.layers.mlp import MLP, Expert


class Router(nn.Module):
    """Tensor names: weight [E, hidden], e_score_correction_bias [E]; both kept in fp32."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, num_group: int, topk_group: int,
                 renormalize: bool, routed_scaling_factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.top_k, self.num_group, self.topk_group = top_k, num_group, topk_group
        self.renormalize, self.routed_scaling_factor = renormalize, routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [M, hidden] -> (weights [M, top_k] fp32, expert ids [M, top_k] int64)."""
        E = self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [M, E]
        choice = scores + self.e_score_correction_bias.float()
        group_scores = choice.view(-1, self.num_group, E // self.num_group).topk(2, dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]  # [M, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()  # [M, G]
        expert_mask = group_mask.repeat_interleave(E // self.num_group, dim=1)  # [M, E]
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class MoE(nn.Module):
    """x: [..., hidden] -> [..., hidden]. Tensor names (Kimi): gate.*, experts.{e}.w{1,2,3}.weight,
    shared_experts.{gate,up,down}_proj.weight."""

    graph_safe = False  # run_experts reads per-expert counts on the host (hyla.engine.cuda_graph)

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 num_shared_experts: int = 1, num_group: int = 1, topk_group: int = 1, renormalize: bool = True,
                 routed_scaling_factor: float = 1.0):
        super().__init__()
        self.gate = Router(hidden_size, num_experts, top_k, num_group, topk_group, renormalize, routed_scaling_factor)
        self.experts = nn.ModuleList(Expert(hidden_size, moe_intermediate_size) for _ in range(num_experts))
        self.shared_experts = (
            MLP(hidden_size, moe_intermediate_size * num_shared_experts) if num_shared_experts > 0 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat)
        out = run_experts(self.experts, flat, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)


def run_experts(experts: nn.ModuleList, flat: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[:, k] * experts[ids[:, k]](flat). flat: [M, hidden]; weights: [M, top_k];
    ids: [M, top_k] int64 -> [M, hidden] in flat.dtype. Reads the per-expert token counts on the
    host (not CUDA-graph safe)."""
    out = torch.zeros_like(flat)
    # Group the (token, slot) pairs by expert so each expert runs once on all of its tokens.
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=len(experts)).tolist()
    token_of = order // ids.shape[1]
    w_sorted = weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start:start + n]
        y = experts[e](flat[tok]) * w_sorted[start:start + n, None]
        out.index_add_(0, tok, y.to(out.dtype))
        start += n
    return out
