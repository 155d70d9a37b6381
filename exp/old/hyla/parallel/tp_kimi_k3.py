"""Kimi K3's tensor-parallel plan: Kimi-Linear's (hyla.parallel.tp_kimi), whose KDA and MLA
modules K3 shares, plus what K3 adds.

Per rank (N ranks):
- KDA: Kimi-Linear's head split; the full-rank output gate g_proj [H*K, hidden] split by head
  with q/k/v. A_log is stored [K] with the first H entries used: a rank holds its H / N heads'
  entries first, zero-padded to K (the padding is never read).
- NoPE MLA with the output gate: heads split; g_proj [H*V, hidden] split by head like q_b_proj /
  kv_b_proj, so the gate multiplies this rank's heads before the row-parallel o_proj.
- Attention residuals: the residual scorers (`*_res_norm`, `*_res_proj [1, hidden]`) are
  replicated. The bank of block snapshots is activation memory built from the hidden stream,
  which every rank holds in full after each block's all-reduce, so every rank mixes the same
  bank: exact, no collective of its own.
- Latent MoE (hyla.layers.latent_moe): router, routed_expert_down_proj [L, hidden] replicated
  (every rank computes the full latent z); the experts' intermediate dim split (or, with expert
  parallelism, E / N whole experts per rank): either way their weighted sum y [M, L] is a
  partial sum over ranks. routed_expert_norm (an RMSNorm, not linear) needs the full y, so with
  the norm y is all-reduced (an [M, L] all-reduce, L < hidden), normalised on every rank, and
  routed_expert_up_proj [hidden, L] is row-parallel over L (rank r reads y[:, its L / N]); its
  output and the shared experts' (split along their width) are partial sums reduced by the
  block's all-reduce. Without the norm, y stays partial and up_proj is replicated (linear in y).
  SiTU is elementwise over the intermediate dim: unaffected by the split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyla.layers.latent_moe import LatentMoE
from hyla.layers.situ import SituExperts, SituMLP
from hyla.parallel.tensor import Cut, divide
from hyla.parallel.tp_kimi import KimiShardPlan


class LatentRowParallel(nn.Module):
    """routed_expert_up_proj split over its input (latent) dim: weight [hidden, L / N] holds
    columns [lo, lo + L / N). y: [..., L] (the same full y on every rank) -> [..., hidden], this
    rank's partial sum."""

    def __init__(self, latent_size: int, hidden_size: int, rank: int, world: int):
        super().__init__()
        per = latent_size // world
        self.lo, self.hi = rank * per, (rank + 1) * per
        self.weight = nn.Parameter(torch.empty(hidden_size, per))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return F.linear(y[..., self.lo:self.hi], self.weight)


class KimiK3ShardPlan(KimiShardPlan):
    def local_config(self, config):
        local = super().local_config(config)
        if config.latent_moe_use_norm and config.routed_expert_hidden_size is not None \
                and "sparse" in config.mlp_layer_types:
            divide(config, "routed_expert_hidden_size", self.world)
        return local

    def _a_log(self, shape):
        """A_log [K]: this rank's H / N heads' entries first, zero-padded to K."""
        h = self.full.linear_num_heads // self.world
        return Cut(0, ((self.rank * h, (self.rank + 1) * h),), pad_to=shape[0])

    def _row_parallel_up(self) -> bool:
        return self.full.latent_moe_use_norm and self.full.routed_expert_hidden_size is not None

    def rules(self, config):
        self.full = config  # the rules below read it before local_config has run
        rules = [(r"self_attn\.A_log$", self._a_log)]
        if self._row_parallel_up():
            rules.append((r"routed_expert_up_proj\.weight$", self.even(1)))
        return rules + super().rules(config)

    def prepare_family(self, model) -> None:
        """Every latent MoE block: expert parallel stacks (E / N whole experts, the shared
        experts 1/N of their width, the router's choices mapped to this rank's experts); with
        the latent norm, y all-reduced before it and up_proj row-parallel (see the module doc)."""
        c = self.full
        for module in model.modules():
            if not isinstance(module, LatentMoE):
                continue
            if self.expert_parallel:
                e = module.experts
                width = c.routed_expert_hidden_size or c.hidden_size
                module.experts = SituExperts(c.num_experts // self.world, width, c.moe_intermediate_size, e.beta,
                                             e.linear_beta)
                if module.shared_experts is not None:
                    module.shared_experts = SituMLP(c.hidden_size, c.moe_intermediate_size * c.num_shared_experts
                                                    // self.world, e.beta, e.linear_beta)
                module.gate.register_forward_hook(self.expert_parallel_hook(c.num_experts))
            if module.routed_expert_norm is not None:
                module.experts.register_forward_hook(self._all_reduce_hook)
                if module.latent:
                    module.routed_expert_up_proj = LatentRowParallel(c.routed_expert_hidden_size, c.hidden_size,
                                                                     self.rank, self.world)
                else:  # the normalised y is the routed output itself: each rank keeps its columns
                    module.routed_expert_norm.register_forward_hook(self._own_columns_hook)

    def _own_columns_hook(self, _module, _inputs, y: torch.Tensor) -> torch.Tensor:
        """y: [M, hidden], the same on every rank -> y with only this rank's ceil(hidden / N)
        columns kept, the rest zero: the block's all-reduce adds each column once (exact)."""
        per = -(-y.shape[-1] // self.world)
        cols = torch.arange(y.shape[-1], device=y.device) // per
        return y * (cols == self.rank).to(y.dtype)
