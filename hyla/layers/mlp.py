"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)).

`prepare_for_inference()` packs gate_proj and up_proj into one weight
(hyla.layers.delta_rule.PackedLinears; state_dict unchanged): one GEMM instead of two per step.
The activation silu(gate) * up is hyla.ops.dispatch.silu_mul: one Triton launch on CUDA reading
the packed output's column views in place, torch's `F.silu(gate) * up` elsewhere. `fp8_output`
(False unless hyla.models.fp8_loading.mark_fp8_producers sets it, for a block-FP8 down_proj): that
launch also writes the activation's block-FP8 form, which down_proj's GEMM reads instead of
quantising it (hyla.ops.fp8_activation).
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.delta_rule import PackedLinears
from hyla.ops import dispatch


class MLP(nn.Module):
    """x: [..., hidden] -> [..., hidden]. Tensor names: gate_proj, up_proj, down_proj (HF / Kimi)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self._packed = None
        self.fp8_output = False  # the activation's block-FP8 form for down_proj (module docstring)

    def prepare_for_inference(self) -> None:
        """Pack gate_proj and up_proj into one weight (one GEMM per step); state_dict unchanged."""
        self._packed = PackedLinears([self.gate_proj, self.up_proj])

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden] -> gate_proj(x), up_proj(x) (one GEMM once packed)."""
        if self._packed is not None:
            return tuple(self._packed(x))
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(dispatch.silu_mul(gate, up, self.fp8_output))

