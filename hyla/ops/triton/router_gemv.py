"""Router logits of a decode step in one launch: x [M, H] (bf16 / fp16 / fp32) times the fp32
router weight [E, H] -> [M, E] fp32, x widened to fp32 in registers.

A decode step's router is a GEMV whose weight (E x H fp32: 2.4 MB for Kimi-Linear-48B) crosses
HBM in about half a microsecond, so its launches are its cost: torch runs it as a cast of x to
fp32 and a cuBLAS fp32 GEMV, two launches per MoE layer; this kernel is one. Each program owns BE
experts (enough programs to spread the weight over the SMs) and walks H in BH columns; products
and sums are fp32 FMAs, in another order than cuBLAS's (the freedom any GEMM has).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.triton import _interpreter
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1

# Token counts this kernel takes (hyla.ops.router picks it up to here): each token re-reads the
# weight (from L2 after the first), which beats a cast and a GEMM only for a handful of rows.
MAX_TOKENS = 4


@triton.jit
def _router_gemv_kernel(x, w, out, M, E, H, s_xm, s_we, s_om, BE: tl.constexpr, BH: tl.constexpr,
                        PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    o_e = tl.program_id(0) * BE + tl.arange(0, BE)
    m_e = o_e < E
    o_h = tl.arange(0, BH)
    w_ptr = w + o_e[:, None].to(tl.int64) * s_we + o_h[None, :]  # [BE, BH]
    for m in range(M):
        acc = tl.zeros((BE, BH), dtype=tl.float32)
        for h0 in range(0, H, BH):
            m_h = (h0 + o_h) < H
            a = tl.load(x + m * s_xm + h0 + o_h, mask=m_h, other=0.0).to(tl.float32)  # [BH]
            b = tl.load(w_ptr + h0, mask=m_e[:, None] & m_h[None, :], other=0.0)
            acc += b * a[None, :]
        tl.store(out + m * s_om + o_e, tl.sum(acc, 1), mask=m_e)


def router_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, H] with M <= MAX_TOKENS (bf16 / fp16 / fp32, last dim contiguous); weight: [E, H]
    fp32 (last dim contiguous) -> [M, E] fp32 logits."""
    M, H = x.shape
    E = weight.shape[0]
    if M > MAX_TOKENS or weight.shape[1] != H or weight.dtype != torch.float32:
        raise ValueError(f"router_gemv: expected x [M <= {MAX_TOKENS}, H] and an fp32 weight [E, H], "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)} {weight.dtype}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("router_gemv: the last dimension of x and weight must be contiguous")
    out = torch.empty(M, E, dtype=torch.float32, device=x.device)
    if M == 0:
        return out
    BE = min(8, max(1, triton.next_power_of_2(E) // 128))  # >= 128 programs where E allows
    BH = min(512, triton.next_power_of_2(H))
    _router_gemv_kernel[(triton.cdiv(E, BE),)](x, weight, out, M, E, H, x.stride(0), weight.stride(0),
                                               out.stride(0), BE=BE, BH=BH, num_warps=4,
                                               **pdl_launch(x.device))
    return out
