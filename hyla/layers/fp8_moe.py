"""Routed SwiGLU experts with block-FP8 weights: StackedExperts' layout and contract
(hyla.layers.moe) with e4m3 codes and 128 x 128 block scales (hyla.models.fp8).

Tensors (transformers' FP8Experts names):
    gate_up_proj            [E, 2I, H] float8_e4m3fn   gate rows, then up rows
    gate_up_proj_scale_inv  [E, 2 ceil(I/128), ceil(H/128)] fp32   the gate rows' blocks, then the
                            up rows': each half blocked on its own, as the per-expert checkpoint
                            tensors (`experts.{e}.gate_proj.weight_scale_inv`) are, so the loader
                            copies an expert's scales into their slice as it copies its weights
                            (with I a multiple of 128 this is the plain [E, 2I/128, H/128] grid)
    down_proj               [E, H, I] float8_e4m3fn
    down_proj_scale_inv     [E, ceil(H/128), ceil(I/128)] fp32

forward(x [M, H], weights [M, k] fp32, ids [M, k] int64, shared=False) -> [M, H] in x.dtype:
hyla.ops.fp8.fp8_moe_experts (the block-FP8 fused-MoE kernels on CUDA, the torch definition
elsewhere). A shared expert of the routed width whose three projections are FP8 (hyla.layers.
fp8_linear.Fp8Linear) is stacked behind the routed ones as expert E, as StackedExperts does.
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.layers.fp8_linear import Fp8Linear, keep_stored_dtypes
from hyla.layers.moe import storage_pointers
from hyla.ops.fp8 import (BLOCK, FP8_DTYPE, block_quantize, cdiv, dequantize_gate_up, fp8_moe_experts,
                          quantize_gate_up, scale_shape)
from hyla.ops.gated_act import SILU, GatedActivation


class Fp8StackedExperts(nn.Module):
    """E routed experts in FP8 (see the module docstring). swiglu_limit: GLM-5-Next's clamped
    SwiGLU (hyla.layers.clamped_swiglu), computed in the kernel's epilogue."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 swiglu_limit: float | None = None, activation: GatedActivation | None = None):
        """activation: another gated activation than (clamped) SwiGLU (Kimi K3's SiTU experts
        converted from MXFP4, hyla.models.mxfp4.Mxfp4Experts.to_fp8); such experts take no
        shared expert behind them."""
        super().__init__()
        E, H, I = num_experts, hidden_size, intermediate_size
        self.swiglu_limit = swiglu_limit
        self.own_activation = activation is not None
        self.activation = activation or (SILU if swiglu_limit is None
                                         else GatedActivation("clamped_silu", limit=swiglu_limit))
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H, dtype=FP8_DTYPE), requires_grad=False)
        self.gate_up_proj_scale_inv = nn.Parameter(torch.ones(E, 2 * cdiv(I, BLOCK), cdiv(H, BLOCK)),
                                                   requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I, dtype=FP8_DTYPE), requires_grad=False)
        self.down_proj_scale_inv = nn.Parameter(torch.ones(E, *scale_shape(H, I)), requires_grad=False)
        self.with_shared: tuple | None = None  # (w13, s13, w2, s2, shared MLP) once stack_shared ran

    @classmethod
    def like(cls, experts: nn.Module) -> Fp8StackedExperts:
        """Empty FP8 experts of a StackedExperts' shape, on its device."""
        E, two_i, H = experts.gate_up_proj.shape
        with torch.device(experts.gate_up_proj.device):
            return cls(E, H, two_i // 2, experts.swiglu_limit)

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def _apply(self, fn, recurse: bool = True):
        return super()._apply(keep_stored_dtypes(fn, (self.gate_up_proj, self.gate_up_proj_scale_inv,
                                                            self.down_proj, self.down_proj_scale_inv)), recurse)

    @torch.no_grad()
    def quantize_(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Fill from full-precision experts w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I],
        one expert at a time (the fp32 transient is one matrix)."""
        for e in range(w13.shape[0]):
            self.quantize_expert_(e, w13[e], w2[e])

    @torch.no_grad()
    def quantize_expert_(self, e: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Fill expert e from its full-precision w13 [2I, H] and w2 [H, I] (on this module's device)."""
        dev = self.gate_up_proj.device
        q, s = quantize_gate_up(w13.to(dev))
        self.gate_up_proj[e].copy_(q)
        self.gate_up_proj_scale_inv[e].copy_(s)
        q, s = block_quantize(w2.to(dev))
        self.down_proj[e].copy_(q)
        self.down_proj_scale_inv[e].copy_(s)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in dtype."""
        from hyla.ops.fp8 import block_dequantize

        return (dequantize_gate_up(self.gate_up_proj, self.gate_up_proj_scale_inv, dtype),
                block_dequantize(self.down_proj, self.down_proj_scale_inv, dtype))

    def stack_shared(self, shared: nn.Module) -> bool:
        """Stack an FP8 shared expert of the routed width behind the routed experts as expert E
        (StackedExperts.stack_shared's contract): its projections become views of the stacked
        tensors, so `state_dict()` keeps every name. False (nothing changed) when the shared
        expert is not FP8 or not of that width."""
        projs = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        E, two_i, H = self.gate_up_proj.shape
        I = two_i // 2
        ni = cdiv(I, BLOCK)
        if (self.own_activation or not all(isinstance(p, Fp8Linear) and p.bias is None for p in projs)
                or tuple(projs[0].weight.shape) != (I, H) or tuple(projs[2].weight.shape) != (H, I)
                or getattr(shared, "limit", None) != self.swiglu_limit):
            return False
        gate, up, down = projs
        with torch.no_grad():
            w13 = torch.cat([self.gate_up_proj, torch.cat([gate.weight, up.weight])[None]])
            s13 = torch.cat([self.gate_up_proj_scale_inv,
                             torch.cat([gate.weight_scale_inv, up.weight_scale_inv])[None]])
            w2 = torch.cat([self.down_proj, down.weight[None]])
            s2 = torch.cat([self.down_proj_scale_inv, down.weight_scale_inv[None]])
        frozen = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.gate_up_proj, self.gate_up_proj_scale_inv = frozen(w13[:E]), frozen(s13[:E])
        self.down_proj, self.down_proj_scale_inv = frozen(w2[:E]), frozen(s2[:E])
        gate.weight, gate.weight_scale_inv = frozen(w13[E, :I]), frozen(s13[E, :ni])
        up.weight, up.weight_scale_inv = frozen(w13[E, I:]), frozen(s13[E, ni:])
        down.weight, down.weight_scale_inv = frozen(w2[E]), frozen(s2[E])
        self.with_shared = (w13, s13, w2, s2, shared)
        self._stacked_at = storage_pointers(self._stacked_params())
        return True

    def _stacked_params(self) -> tuple[torch.Tensor, ...]:
        shared = self.with_shared[-1]
        g, u, d = shared.gate_proj, shared.up_proj, shared.down_proj
        return (self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj, self.down_proj_scale_inv,
                g.weight, g.weight_scale_inv, u.weight, u.weight_scale_inv, d.weight, d.weight_scale_inv)

    def shared_is_stacked(self) -> bool:
        """True while the routed and shared tensors are still the views `stack_shared` made
        (addresses recorded then, as hyla.layers.moe's block does)."""
        return self.with_shared is not None and storage_pointers(self._stacked_params()) == self._stacked_at

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: bool = False) -> torch.Tensor:
        if shared:
            w13, s13, w2, s2, _ = self.with_shared
        else:
            w13, s13, w2, s2 = self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj, self.down_proj_scale_inv
        return fp8_moe_experts(x, w13, s13, w2, s2, weights, ids, self.activation)
