"""Kimi K3's latent mixture of experts: route on the full hidden state, run the routed experts in
a narrower latent space, add shared experts on the full hidden state.

    w, ids = Router(x)                   sigmoid scores, e_score_correction_bias for selection only,
                                         top-k, renormalised, times routed_scaling_factor (hyla.layers.moe)
    z      = routed_expert_down_proj(x)  [M, L]      (L = routed_expert_hidden_size)
    y      = sum_j w_j SiTU-expert_{ids_j}(z)        [M, L]
    y      = routed_expert_norm(y)                   (latent_moe_use_norm)
    out    = routed_expert_up_proj(y) + shared_experts(x)

Tensor names (under block_sparse_moe.): gate.weight, gate.e_score_correction_bias (fp32),
routed_expert_down_proj.weight [L, H], experts.gate_up_proj / experts.down_proj (stacked; loaded
from experts.{e}.w1/w3/w2), routed_expert_norm.weight [L], routed_expert_up_proj.weight [H, L],
shared_experts.{gate,up,down}_proj.weight. Without a latent width the projections are absent.

`experts` is any holder of the contract (z [M, L], weights [M, k], ids [M, k]) -> [M, L]: the
SiTU experts in the model dtype (hyla.layers.situ.SituExperts), or, for MXFP4 checkpoints kept
packed, hyla.models.mxfp4.Mxfp4Experts (same stacked names, uint8 rows), whose forward runs the
MXFP4 fused-MoE kernel (hyla.ops.triton.fused_moe_mxfp4) on CUDA; Kimi K3's model builds that one.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.moe import Router
from hyla.layers.norm import RMSNorm
from hyla.layers.situ import SituExperts, SituMLP


class LatentMoE(nn.Module):
    """x: [..., hidden] -> [..., hidden]."""

    def __init__(self, hidden_size: int, latent_size: int | None, moe_intermediate_size: int, num_experts: int,
                 top_k: int, num_shared_experts: int, num_group: int, topk_group: int, renormalize: bool,
                 routed_scaling_factor: float, use_norm: bool, norm_eps: float, beta: float,
                 linear_beta: float | None):
        super().__init__()
        self.gate = Router(hidden_size, num_experts, top_k, num_group, topk_group, renormalize, routed_scaling_factor)
        width = hidden_size if latent_size is None else latent_size
        if latent_size is not None:
            self.routed_expert_down_proj = nn.Linear(hidden_size, latent_size, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent_size, hidden_size, bias=False)
        self.latent = latent_size is not None
        self.routed_expert_norm = RMSNorm(width, norm_eps) if use_norm else None
        self.experts = SituExperts(num_experts, width, moe_intermediate_size, beta, linear_beta)
        self.shared_experts = (SituMLP(hidden_size, moe_intermediate_size * num_shared_experts, beta, linear_beta)
                               if num_shared_experts > 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat)
        z = self.routed_expert_down_proj(flat) if self.latent else flat
        y = self.experts(z, weights, ids)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        out = self.routed_expert_up_proj(y) if self.latent else y
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)
