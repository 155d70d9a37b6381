"""MoE router logits in fp32: `router_logits(x [M, H], weight [E, H] fp32) -> [M, E] fp32`.

Routing picks experts by comparing logits, so both families keep the router in fp32 (as the
released models and transformers do). On CUDA an fp32 GEMM runs on FFMA units, without tensor
cores: at prefill sizes (8K tokens x 2304 x 256) that is ~0.2 ms a layer, as long as a
bandwidth-bound expert GEMM. With bf16 activations the same product is exact on tensor cores: split the fp32 weight into three bf16 terms w = hi + mid + lo (8 significant bits each,
24 in all: the whole fp32 significand), and sum x @ hi + x @ mid + x @ lo with fp32 outputs.
Every product of a bf16 activation and a bf16 term is exact in fp32 and the sums are fp32, so the
result equals the fp32 GEMM up to the order of the additions, the same freedom any GEMM has.

Used for M >= SPLIT_MIN_TOKENS only: a decode step's router is bandwidth-bound, and reading three
bf16 copies (6 B per weight) costs more than one fp32 read (4 B). A decode step's few tokens
(up to hyla.ops.triton.router_gemv.MAX_TOKENS) take one Triton GEMV instead, which widens x in
registers: one launch where the cast and the cuBLAS GEMV are two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyla.ops import utils
from hyla.ops.utils import work_dtype

SPLIT_MIN_TOKENS = 512


def split_bf16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 weight -> (hi, mid, lo) bf16 with hi + mid + lo == weight to fp32 precision
    (exactly, unless a term falls below bf16's normal range)."""
    w = weight.float()
    hi = w.to(torch.bfloat16)
    r = w - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


def _split_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    terms = utils.cached_on(weight, "bf16_split", lambda: tuple(t.t() for t in split_bf16(weight)))
    xb = x.to(torch.bfloat16)  # exact: only bf16 activations take this path
    out = torch.mm(xb, terms[0], out_dtype=torch.float32)
    for term in terms[1:]:
        out = torch.addmm(out, xb, term, out_dtype=torch.float32)
    return out


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, H] activations; weight: [E, H] (fp32). Returns [M, E] logits in fp32 (fp64 for fp64 x)."""
    if x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] >= SPLIT_MIN_TOKENS:
        return _split_product(x, weight)
    if x.dim() == 2 and weight.dtype == torch.float32 and _triton_takes(x, weight):
        from hyla.ops.triton.router_gemv import MAX_TOKENS, router_gemv

        if x.shape[0] <= MAX_TOKENS:
            return router_gemv(x.contiguous(), weight.contiguous())
    work = work_dtype(x)
    return F.linear(x.to(work), weight.to(work))


def _triton_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The dispatch rule of the other Triton ops (CUDA, no grad, not fp64; HYLA_BACKEND)."""
    from hyla.ops import dispatch

    return dispatch.backend_for(x, x, [x, weight], heads=False) == "triton"
