"""Mixture of experts with a sigmoid router (DeepSeek-V3 "noaux_tc" routing, as Kimi-Linear).

Routing, for each token (in fp32, as transformers' KimiLinearTopkRouter; fp64 inputs in fp64):
    s = sigmoid(x W_r^T)                             [E]   affinity of every expert
    c = s + e_score_correction_bias                  [E]   used only to *choose* experts
    groups scored by the sum of their top-2 c; keep the best `topk_group` groups,
    pick the top-k experts by c inside them, weight them by s (not c),
    renormalise the k weights to sum to 1 (moe_renormalize), then scale by routed_scaling_factor.
Output = sum_k w_k * expert_k(x) + shared_experts(x).
`swiglu_limit` (GLM-5-Next) clamps every expert's gate / up pre-activations
(hyla.layers.clamped_swiglu; the torch grouped GEMMs then, the fused kernels have no clamp).

Everything runs on the device without reading a value back (routing, the expert-sorted grouped
GEMMs of StackedExperts), so a decode step with MoE layers is captured as one CUDA graph.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.clamped_swiglu import ClampedMLP, clamped_moe_experts
from hyla.layers.mlp import MLP
from hyla.ops.moe import moe_experts, sigmoid_topk_route
from hyla.ops.router import router_logits


def storage_pointers(tensors) -> tuple:
    """(address, device) of each tensor: what a stacked-expert block records when it stacks its
    shared expert and compares on every call (`shared_is_stacked`)."""
    return tuple((t.data_ptr(), t.device) for t in tensors)


class Router(nn.Module):
    """Tensor names: weight [E, hidden], e_score_correction_bias [E]; both kept in fp32."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, num_group: int, topk_group: int,
                 renormalize: bool, routed_scaling_factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.top_k, self.num_group, self.topk_group = top_k, num_group, topk_group
        self.renormalize, self.routed_scaling_factor = renormalize, routed_scaling_factor

    def forward(self, x: torch.Tensor, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [M, hidden] -> (weights [M, top_k] fp32 (fp64 for fp64 x), expert ids [M, top_k] int64).
        shared: one more slot per token, expert E with weight 1 (see StackedExperts.stack_shared)."""
        logits = router_logits(x, self.weight)  # [M, E] fp32 (fp64 stays exact)
        return sigmoid_topk_route(logits, self.top_k, self.e_score_correction_bias, self.num_group,
                                  self.topk_group, self.renormalize, self.routed_scaling_factor, shared)


class StackedExperts(nn.Module):
    """E routed SwiGLU experts in two stacked tensors (transformers 5's in-memory layout):
    gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]. The loader fills
    them from the official per-expert names (Kimi `experts.{e}.w1/w3/w2`, Qwen
    `experts.{e}.gate_proj/up_proj/down_proj`) or from fused tensors of the same names.

    forward(x [M, H], weights [M, k] fp32, ids [M, k] int64) -> [M, H] (hyla.ops.moe_experts:
    the Triton fused-MoE kernels on CUDA, sorted grouped GEMMs elsewhere; no host sync)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 swiglu_limit: float | None = None):
        super().__init__()
        self.swiglu_limit = swiglu_limit  # GLM-5-Next: clamped SwiGLU (hyla.layers.clamped_swiglu)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        for w in (self.gate_up_proj, self.down_proj):  # nn.Linear's default init, per expert
            nn.init.kaiming_uniform_(w.view(-1, w.shape[-1]), a=5 ** 0.5)
        self.with_shared: tuple | None = None  # (w13, w2, shared MLP) once stack_shared ran

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def stack_shared(self, shared: MLP) -> bool:
        """Stack a shared expert of the same width behind the routed ones, as expert E: one
        grouped GEMM pair then serves both (routing appends slot k = E), instead of three more
        GEMMs, an activation and an add per layer. The shared MLP's weights become views of the
        stacked tensors, so `state_dict()` keeps every official name. Returns False (nothing
        changed) when the widths or dtypes differ."""
        E, two_i, H = self.gate_up_proj.shape
        if shared.gate_proj.weight.shape != (two_i // 2, H) or shared.gate_proj.weight.dtype != self.gate_up_proj.dtype:
            return False
        I = two_i // 2
        with torch.no_grad():
            w13 = torch.cat([self.gate_up_proj, torch.cat([shared.gate_proj.weight, shared.up_proj.weight])[None]])
            w2 = torch.cat([self.down_proj, shared.down_proj.weight[None]])
        self.gate_up_proj, self.down_proj = nn.Parameter(w13[:E], False), nn.Parameter(w2[:E], False)
        shared.gate_proj.weight = nn.Parameter(w13[E, :I], False)
        shared.up_proj.weight = nn.Parameter(w13[E, I:], False)
        shared.down_proj.weight = nn.Parameter(w2[E], False)
        self.with_shared = (w13, w2, shared)  # [E + 1, 2I, H], [E + 1, H, I], the shared MLP
        self._stacked_at = storage_pointers(self._stacked_params())
        return True

    def _stacked_params(self) -> tuple[torch.Tensor, ...]:
        shared = self.with_shared[-1]
        return self.gate_up_proj, self.down_proj, shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight

    def shared_is_stacked(self) -> bool:
        """True while the routed and shared weights are still the views `stack_shared` made. A
        `.to()` or an assignment of new tensors breaks that; the block then runs the shared
        expert on its own again (MoE.forward asks this every call, so it compares addresses
        recorded once rather than slicing the stacked tensors again)."""
        return self.with_shared is not None and storage_pointers(self._stacked_params()) == self._stacked_at

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: bool = False) -> torch.Tensor:
        """shared: ids name expert E, the stacked shared expert (the caller checked
        `shared_is_stacked()` for this step)."""
        w13, w2 = self.with_shared[:2] if shared else (self.gate_up_proj, self.down_proj)
        if self.swiglu_limit is not None:
            return clamped_moe_experts(x, w13, w2, weights, ids, self.swiglu_limit)
        return moe_experts(x, w13, w2, weights, ids)


class MoE(nn.Module):
    """x: [..., hidden] -> [..., hidden]. Tensor names (Kimi): gate.*, experts.gate_up_proj /
    experts.down_proj (stacked; loaded from experts.{e}.w{1,2,3}.weight),
    shared_experts.{gate,up,down}_proj.weight."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 num_shared_experts: int = 1, num_group: int = 1, topk_group: int = 1, renormalize: bool = True,
                 routed_scaling_factor: float = 1.0, swiglu_limit: float | None = None):
        super().__init__()
        self.gate = Router(hidden_size, num_experts, top_k, num_group, topk_group, renormalize, routed_scaling_factor)
        self.experts = StackedExperts(num_experts, hidden_size, moe_intermediate_size, swiglu_limit)
        shared_width = moe_intermediate_size * num_shared_experts
        self.shared_experts = (
            (MLP(hidden_size, shared_width) if swiglu_limit is None else ClampedMLP(hidden_size, shared_width, swiglu_limit))
            if num_shared_experts > 0 else None
        )

        self.shared_stacked = False

    def prepare_for_inference(self) -> None:
        """Stack the shared expert behind the routed ones when it has their width (one expert)."""
        if self.shared_experts is not None and not self.shared_stacked:
            self.shared_stacked = self.experts.stack_shared(self.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        stacked = self.experts.shared_is_stacked()
        weights, ids = self.gate(flat, shared=stacked)
        out = self.experts(flat, weights, ids, shared=stacked)
        if self.shared_experts is not None and not stacked:
            out = out + self.shared_experts(flat)
        return out.view(shape)
