"""A linear projection with block-FP8 weights (hyla.models.fp8), and the packing of several of them
into one GEMM.

Fp8Linear holds the checkpoint's tensors under their names: `weight` [out, in] float8_e4m3fn and
`weight_scale_inv` [ceil(out/128), ceil(in/128)] fp32 (and `bias` [out] in the model dtype), so
the loader fills it as a checked copy. forward(x [..., in]) -> [..., out] in x.dtype through
hyla.ops.fp8.fp8_linear: W8A8 with the activations quantised per token and 128 columns (the
Triton GEMM on CUDA, the torch definition elsewhere).

A model's `.to(dtype)` moves the FP8 weight and its scales but never casts them (they are the
stored format, not a compute dtype); a bias follows the cast as nn.Linear's does.

PackedFp8Linears is what hyla.layers.delta_rule.PackedLinears becomes for FP8 projections over the
same input: one weight with one scale grid, every part starting on a 128-row block (a part whose
rows do not fill its last block is followed by zero rows up to it: Qwen3.5's 32-row b and a
projections), its output columns a view of the one GEMM's; possible when all parts are FP8,
otherwise they run one after the other (`weight()` is None, as PackedLinears says for
projections it could not pack). A group whose checkpoint keeps some parts in the model dtype packs
each kind on its own (hyla.layers.delta_rule.MixedPackedLinears).
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch
from torch import nn

from hyla.ops.fp8 import BLOCK, FP8_DTYPE, block_dequantize, block_quantize, fp8_linear, scale_shape


def keep_stored_dtypes(fn: Callable[[torch.Tensor], torch.Tensor], tensors) -> Callable[[torch.Tensor], torch.Tensor]:
    """`fn` (what nn.Module._apply maps over parameters) with dtype casts kept off `tensors`:
    a device move still applies to them, a cast does not (the FP8 codes and their fp32 scales are
    a storage format). Used by the FP8 modules' `_apply`."""
    stored = {id(t): t.dtype for t in tensors if t is not None}

    def apply(t):
        out = fn(t)
        if id(t) in stored and out.dtype != stored[id(t)]:
            return t.to(device=out.device)
        return out

    return apply


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as e4m3 codes and 128 x 128 block scales (see the module
    docstring). in_features / out_features as nn.Linear's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.ones(*scale_shape(out_features, in_features)),
                                             requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear) -> Fp8Linear:
        """An (empty) Fp8Linear of `linear`'s shape, on its device; its forward hooks carried over
        (a tensor-parallel plan's all-reduce hangs on o_proj / out_proj)."""
        with torch.device(linear.weight.device):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None)
        if linear.bias is not None:
            new.bias.data = new.bias.data.to(linear.bias.dtype)
        new._forward_hooks.update(linear._forward_hooks)
        new._forward_pre_hooks.update(linear._forward_pre_hooks)
        return new

    def _apply(self, fn, recurse: bool = True):
        return super()._apply(keep_stored_dtypes(fn, (self.weight, self.weight_scale_inv)), recurse)

    @torch.no_grad()
    def quantize_(self, w: torch.Tensor) -> None:
        """Fill from a full-precision weight [out, in] (hyla.models.fp8's block quantisation)."""
        q, s = block_quantize(w.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale_inv.copy_(s)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W = codes x block scales, [out, in] in dtype."""
        return block_dequantize(self.weight, self.weight_scale_inv, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


def _adjacent(ts) -> bool:
    """Whether the contiguous tensors ts lie one after the other in one storage."""
    if not all(t.is_contiguous() for t in ts) or len({t.untyped_storage().data_ptr() for t in ts}) != 1:
        return False
    return all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in itertools.pairwise(ts))


class PackedFp8Linears:
    """PackedLinears' contract (hyla.layers.delta_rule) for a list with FP8 projections: `weight()`
    (not None while packed and still aliased), `__call__(x)` -> each projection's output, `sizes`,
    `contiguous` (the outputs side by side: no part padded to its block).
    Packing re-points each part's weight, scales and bias to views of the packed tensors, so
    `state_dict()` keeps every name, shape and value; parts already adjacent in memory (a shared
    expert's gate and up rows inside the stacked FP8 experts) are packed in place."""

    def __init__(self, linears):
        self.linears = list(linears)
        self.sizes = [lin.out_features for lin in self.linears]
        # each part's first row in the packed weight: the parts before it, each rounded up to whole blocks
        self.offsets = [sum(-(-n // BLOCK) * BLOCK for n in self.sizes[:i]) for i in range(len(self.sizes))]
        # whether the parts' outputs sit side by side (no zero rows between them): what a caller
        # reading several parts as one tensor needs (KDA's q ++ k ++ v for its short convs)
        self.contiguous = all(n % BLOCK == 0 for n in self.sizes[:-1])
        self.packed: Fp8Linear | None = None
        if not self._packable():
            return
        ws = [lin.weight for lin in self.linears]
        ss = [lin.weight_scale_inv for lin in self.linears]
        biases = [lin.bias for lin in self.linears]
        has_bias = biases[0] is not None
        rows = self.offsets[-1] + self.sizes[-1]
        with torch.no_grad(), torch.device("meta"):
            packed = Fp8Linear(ws[0].shape[1], rows, has_bias)
        if self.contiguous and _adjacent(ws) and _adjacent(ss) and (not has_bias or _adjacent(biases)):
            first_w, first_s = ws[0].detach(), ss[0].detach()
            packed.weight = nn.Parameter(first_w.as_strided((sum(self.sizes), first_w.shape[1]), first_w.stride()),
                                         requires_grad=False)
            rows = sum(s.shape[0] for s in ss)
            packed.weight_scale_inv = nn.Parameter(first_s.as_strided((rows, first_s.shape[1]), first_s.stride()),
                                                   requires_grad=False)
            if has_bias:
                packed.bias = nn.Parameter(biases[0].detach().as_strided((sum(self.sizes),), (1,)), requires_grad=False)
            self.packed = packed
            return
        with torch.no_grad():
            w0, s0 = ws[0].detach(), ss[0].detach()
            weight = torch.zeros(rows, w0.shape[1], dtype=w0.dtype, device=w0.device)  # e4m3 zeros in the gaps
            scales = torch.ones(-(-rows // BLOCK), s0.shape[1], dtype=s0.dtype, device=s0.device)
            bias = torch.zeros(rows, dtype=biases[0].dtype, device=biases[0].device) if has_bias else None
            for o, w, sc, b in zip(self.offsets, ws, ss, biases):
                weight[o:o + w.shape[0]] = w.detach()
                scales[o // BLOCK:o // BLOCK + sc.shape[0]] = sc.detach()
                if has_bias:
                    bias[o:o + w.shape[0]] = b.detach()
            packed.weight = nn.Parameter(weight, requires_grad=False)
            packed.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
            if has_bias:
                packed.bias = nn.Parameter(bias, requires_grad=False)
        for lin, o, n in zip(self.linears, self.offsets, self.sizes):
            ob = o // BLOCK
            lin.weight = nn.Parameter(packed.weight[o:o + n], requires_grad=False)
            lin.weight_scale_inv = nn.Parameter(packed.weight_scale_inv[ob:ob + -(-n // BLOCK)], requires_grad=False)
            if has_bias:
                lin.bias = nn.Parameter(packed.bias[o:o + n], requires_grad=lin.bias.requires_grad)
        self.packed = packed

    def _packable(self) -> bool:
        lins = self.linears
        if not all(isinstance(lin, Fp8Linear) for lin in lins):
            return False  # FP8 next to a projection kept in the model dtype: two GEMMs
        if len({(lin.weight.device, lin.in_features) for lin in lins}) != 1:
            return False
        return len({lin.bias is None for lin in lins}) == 1

    def _aliased(self) -> bool:
        """Whether every part's weight and scales are still views of the packed ones at its offset
        (pointer arithmetic only: a slice of the scales to read its address cost a tensor a part,
        on every call of every packed projection)."""
        p = self.packed
        w, sc = p.weight, p.weight_scale_inv
        w_base, w_row = w.data_ptr(), w.stride(0) * w.element_size()
        s_base, s_row = sc.data_ptr(), sc.stride(0) * sc.element_size()
        for lin, o in zip(self.linears, self.offsets):
            if (lin.weight.data_ptr() != w_base + o * w_row
                    or lin.weight_scale_inv.data_ptr() != s_base + (o // BLOCK) * s_row):
                return False
        return True

    def weight(self):
        """(the packed Fp8Linear, None) while packed and aliased, else None: use the parts."""
        if self.packed is None or not self._aliased():
            return None
        return self.packed, None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: [..., in] -> each projection's output (one GEMM when packed, then column views)."""
        if self.weight() is None:
            return [lin(x) for lin in self.linears]
        out = self.packed(x)
        return [out[..., o:o + n] for o, n in zip(self.offsets, self.sizes)]


def quantized_like(linear: nn.Linear) -> Fp8Linear:
    """An Fp8Linear holding `linear`'s weight block-quantised (and its bias), on its device."""
    new = Fp8Linear.like(linear)
    new.quantize_(linear.weight.detach())
    if linear.bias is not None:
        with torch.no_grad():
            new.bias.copy_(linear.bias)
    return new
