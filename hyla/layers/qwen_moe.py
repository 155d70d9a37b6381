"""Qwen3-Next's sparse MoE block (transformers' Qwen3NextSparseMoeBlock): a softmax router over
E experts, top-k, plus one shared expert scaled by its own sigmoid gate.

    p    = softmax(x W_r^T)                          [E]   (fp32)
    ids  = top-k of p;  w = p[ids] (/ sum, when norm_topk_prob)
    y    = sum_k w_k * expert_{ids_k}(x) + sigmoid(x W_sg^T) * shared_expert(x)

Experts and the shared expert are SwiGLU MLPs. Tensor names: gate.weight [E, hidden],
experts.gate_up_proj [E, 2I, hidden] / experts.down_proj [E, hidden, I] (stacked; loaded from
experts.{e}.{gate,up,down}_proj.weight or the fused tensors), shared_expert.{gate,up,down}_proj.weight,
shared_expert_gate.weight [1, hidden].

One deliberate difference from transformers: the router logits are computed in fp32 from an fp32
copy of the router weight (the loader keeps `*.gate.weight` in fp32, as for Kimi-Linear), where
transformers multiplies in the model dtype. In fp32 the two are identical; in bf16 hyla's top-k
choice is the one of the exact logits rather than of their bf16 rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.delta_rule import plain_weight
from hyla.layers.mlp import MLP
from hyla.layers.moe import StackedExperts
from hyla.ops.moe import softmax_topk_route
from hyla.ops.router import router_logits


class SoftmaxRouter(nn.Module):
    """weight: [E, hidden] (kept in fp32). x: [M, hidden] -> (weights [M, top_k], ids [M, top_k])."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=torch.float32))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor, shared_gate: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """shared_gate (the shared expert's gate, hidden -> 1): one more slot per token, expert E
        with weight sigmoid(shared_gate(x)). A plain linear gate in x's dtype is computed by the
        routing (hyla.ops.moe.softmax_topk_route's shared_gate), other modules (a quantised
        linear) here."""
        shared_logit = gate = None
        if shared_gate is not None:
            w = plain_weight(shared_gate)
            if w is not None and w.dtype == x.dtype:
                gate = (x, w)
            else:
                shared_logit = shared_gate(x)[:, 0]
        return softmax_topk_route(router_logits(x, self.weight), self.top_k, self.norm_topk_prob,
                                  shared_logit, gate)


class Qwen3NextSparseMoE(nn.Module):
    """x: [..., hidden] -> [..., hidden]."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 shared_expert_intermediate_size: int, norm_topk_prob: bool = True):
        super().__init__()
        self.gate = SoftmaxRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = StackedExperts(num_experts, hidden_size, moe_intermediate_size)
        self.shared_expert = MLP(hidden_size, shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.shared_stacked = False

    def prepare_for_inference(self) -> None:
        """Stack the shared expert behind the routed ones when it has their width: its sigmoid
        gate becomes its routing weight (hyla.layers.moe.StackedExperts.stack_shared)."""
        if not self.shared_stacked:
            self.shared_stacked = self.experts.stack_shared(self.shared_expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.experts.shared_is_stacked():
            weights, ids = self.gate(flat, self.shared_expert_gate)
            return self.experts(flat, weights, ids, shared=True).view(shape)
        weights, ids = self.gate(flat)
        out = self.experts(flat, weights, ids)
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (out + shared).view(shape)
