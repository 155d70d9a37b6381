"""Triton kernel for an MTP head step's input (contract: hyla.ops.mtp_input): one program per
token gathers its embedding row, normalises it and the target's hidden state (zero-centred
RMSNorm in fp32, rounded once, as hyla.ops.triton.norm) and writes both halves of the `fc`
input: one launch instead of four (embedding, two norms, cat)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.mtp_input import check_fc_input
from hyla.ops.triton import _interpreter
from hyla.ops.triton.norm import to_dtype

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1


@triton.jit
def _fc_input_kernel(ids, embed, hidden, w_e, w_h, out, s_e, s_h, D, eps, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BD)
    m = c < D
    tok = tl.load(ids + t).to(tl.int64)
    e = tl.load(embed + tok * s_e + c, mask=m, other=0.0).to(tl.float32)
    ne = e * tl.math.rsqrt(tl.sum(e * e, axis=0) / D + eps) * (1.0 + tl.load(w_e + c, mask=m, other=0.0).to(tl.float32))
    tl.store(out + t * 2 * D + c, to_dtype(ne, out.dtype.element_ty), mask=m)
    h = tl.load(hidden + t * s_h + c, mask=m, other=0.0).to(tl.float32)
    nh = h * tl.math.rsqrt(tl.sum(h * h, axis=0) / D + eps) * (1.0 + tl.load(w_h + c, mask=m, other=0.0).to(tl.float32))
    tl.store(out + t * 2 * D + D + c, to_dtype(nh, out.dtype.element_ty), mask=m)


def mtp_fc_input(ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, w_e: torch.Tensor,
                 w_h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The Triton version of hyla.ops.mtp_input.mtp_fc_input."""
    check_fc_input(ids, embed, hidden, w_e, w_h)
    if hidden.dtype != embed.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and embed ({embed.dtype}) must share a dtype")
    T, D = hidden.shape
    embed, hidden = (x if x.stride(1) == 1 else x.contiguous() for x in (embed, hidden))
    out = torch.empty(T, 2 * D, device=hidden.device, dtype=embed.dtype)
    if T:
        BD = triton.next_power_of_2(D)
        _fc_input_kernel[(T,)](ids, embed, hidden, w_e.contiguous(), w_h.contiguous(), out, embed.stride(0),
                               hidden.stride(0), D, float(eps), BD=BD, num_warps=max(1, min(8, BD // 256)))
    return out
