"""FP8 (e4m3) block quantisation and the W8A8 block-FP8 ops: the torch definitions every kernel is
tested against, and the dispatch to the Triton kernels on CUDA.

The format (DeepSeek-V3's "fine-grained FP8", Qwen3-Next-FP8's, vLLM's `fp8` with
`weight_block_size` [128, 128]):

- a weight W [N, K] is stored as q [N, K] float8_e4m3fn and `weight_scale_inv` s [ceil(N/128),
  ceil(K/128)] fp32, one scale per 128 x 128 block (the last row / column block partial when N or
  K is not a multiple of 128): W[n, k] = q[n, k] * s[n // 128, k // 128];
- quantising: s = amax(|W| over the block) / 448 (448 = e4m3's largest finite value), q = W / s
  rounded to nearest-even e4m3 (an all-zero block gets s = 1);
- activations are quantised at run time per token and group of 128 columns (1 x 128, the
  "dynamic" activation scheme): s_a[m, g] = max(amax, 1e-10) / 448, a_q = a / s_a, so that
  y[m, n] = sum over groups g of (a_q[m, g] . q[n, g]) * s_a[m, g] * s[n // 128, g].

`block_quantize` / `block_dequantize` (whole tensors, any leading dims) and
`per_token_group_quant` (activations) are the format's definitions; `fp8_linear_torch` /
`fp8_moe_experts_torch` compute the W8A8 ops as the kernels do (quantised activations,
dequantised in fp32, fp32 products), so a kernel matches them up to fp32 summation order.
`fp8_linear` / `fp8_moe_experts` pick the Triton kernels for CUDA tensors (hyla.ops.dispatch's
rule) and the torch definitions elsewhere. (cuBLAS through torch._scaled_mm, with the same
quantised activations, sits beside the Triton GEMM in hyla.ops.triton.fp8_gemm for the GPU test
that times the two; the product uses the Triton GEMM until that timing picks.)

The e4m3 rounding and `per_token_group_quant` are defined in hyla.ops.fp8_quant (no dispatch
import there: the FP8 KV pages' torch ops, which hyla.ops.dispatch routes, quantise with them
too) and re-exported here.
"""

from __future__ import annotations

import torch

from hyla.ops.fp8_checks import BLOCK, FP8_DTYPE, cdiv, check_fp8_experts, scale_shape
from hyla.ops.fp8_quant import ACT_EPS, FP8_MAX, fp8_scale, per_token_group_quant  # noqa: F401 (re-exported)
from hyla.ops.fp8_quant import to_e4m3 as _to_e4m3
from hyla.ops.gated_act import SILU, GatedActivation
from hyla.ops.moe_pairs import sort_pairs_by_expert
from hyla.ops.utils import work_dtype

__all__ = ["FP8_DTYPE", "FP8_MAX", "BLOCK", "cdiv", "scale_shape", "block_quantize", "block_dequantize",
           "per_token_group_quant", "quantize_gate_up", "dequantize_gate_up", "fp8_linear", "fp8_linear_torch", "fp8_moe_experts",
           "fp8_moe_experts_torch"]


def _expand_blocks(s: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """s [..., ceil(rows/block), ceil(cols/block)] -> [..., rows, cols], each block's value repeated."""
    return s.repeat_interleave(block, dim=-2)[..., :rows, :].repeat_interleave(block, dim=-1)[..., :cols]


def block_quantize(w: torch.Tensor, block: int = BLOCK,
                   power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float dtype) -> (q [..., N, K] float8_e4m3fn, s [..., ceil(N/block),
    ceil(K/block)] fp32), s = amax(|block|) / 448 (1 for an all-zero block), q = w / s rounded to
    nearest even. Partial edge blocks take the amax of the rows / columns they hold. Leading
    dims (experts) are quantised one at a time, so the fp32 transient is one matrix.

    power_of_two: s = 2^ceil(log2(amax / 448)) instead, so that w / s only shifts exponents:
    values of a coarser format with power-of-two group scales (MXFP4's E2M1 x 2^e) then land on
    e4m3 codes exactly wherever a block's group exponents span at most 13 binades (E2M1's
    largest code 6 x 2^e_max maps to 384 <= 448; its smallest, 0.5 x 2^e, needs e >= e_max - 13
    to stay on e4m3's 2^-9 grid)."""
    if w.ndim < 2:
        raise ValueError(f"block_quantize needs a [..., N, K] weight, got shape {tuple(w.shape)}")
    if w.ndim > 2:
        pairs = [block_quantize(m, block, power_of_two) for m in w.reshape(-1, *w.shape[-2:])]
        q = torch.stack([p[0] for p in pairs]).reshape(w.shape)
        s = torch.stack([p[1] for p in pairs]).reshape(*w.shape[:-2], *pairs[0][1].shape)
        return q, s
    N, K = w.shape
    nb, kb = scale_shape(N, K, block)
    w32 = w.float()
    padded = torch.nn.functional.pad(w32, (0, kb * block - K, 0, nb * block - N))
    amax = padded.abs().view(nb, block, kb, block).amax(dim=(1, 3))
    s = torch.where(amax > 0, fp8_scale(amax), torch.ones_like(amax))
    if power_of_two:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = _to_e4m3(w32 / _expand_blocks(s, N, K, block))
    return q, s


def block_dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32,
                     block: int = BLOCK) -> torch.Tensor:
    """q [..., N, K] e4m3, s [..., ceil(N/block), ceil(K/block)] -> q * s [..., N, K]: the product
    in fp32 (fp64 for dtype fp64), then cast to dtype."""
    N, K = q.shape[-2:]
    if tuple(s.shape[-2:]) != scale_shape(N, K, block) or s.shape[:-2] != q.shape[:-2]:
        raise ValueError(f"FP8 scales {tuple(s.shape)} do not hold one value per {block}x{block} block of a "
                         f"{tuple(q.shape)} weight (expected {tuple(q.shape[:-2]) + scale_shape(N, K, block)})")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(work) * _expand_blocks(s.to(work), N, K, block)).to(dtype)


def _group_dequant(q: torch.Tensor, s: torch.Tensor, work: torch.dtype, group: int = BLOCK) -> torch.Tensor:
    return q.to(work) * s.to(work).repeat_interleave(group, dim=-1)[:, :q.shape[1]]


def check_fp8_weight(w: torch.Tensor, s: torch.Tensor, what: str = "weight") -> None:
    """w [..., N, K] float8_e4m3fn and s [..., ceil(N/128), ceil(K/128)] fp32; ValueError if not."""
    if w.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 {what} must be float8_e4m3fn, got {w.dtype}")
    if s.dtype != torch.float32:
        raise ValueError(f"FP8 {what} scales must be float32, got {s.dtype}")
    want = tuple(w.shape[:-2]) + scale_shape(*w.shape[-2:])
    if tuple(s.shape) != want:
        raise ValueError(f"FP8 {what} scales {tuple(s.shape)} do not match its {tuple(w.shape)} blocks "
                         f"(expected {want})")


def fp8_linear_torch(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype: x quantised per token group (per_token_group_quant),
    both sides dequantised and multiplied in fp32 (fp64 for fp64 x), + bias, rounded once."""
    check_fp8_weight(w, s)
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the FP8 weight {tuple(w.shape)} takes {w.shape[1]}")
    work = work_dtype(x)
    flat = x.reshape(-1, x.shape[-1])
    xq, xs = per_token_group_quant(flat)
    out = _group_dequant(xq, xs, work) @ block_dequantize(w, s, work).T
    if bias is not None:
        out = out + bias.to(work)
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def fp8_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32), w [N, K] e4m3, s [ceil(N/128), ceil(K/128)] fp32, bias [N]
    | None -> [..., N] in x.dtype: W8A8 with dynamic 1 x 128 activation scales. Triton on CUDA
    (x's codes and scales read from x when its producer wrote them: hyla.ops.fp8_activation; the
    reshape below is a view of a contiguous x, which the lookup sees through),
    `fp8_linear_torch` elsewhere."""
    from hyla.ops import dispatch

    if dispatch.backend_for(x, x, [x], heads=False) == "triton":
        from hyla.ops.triton import fp8_gemm

        check_fp8_weight(w, s)
        flat = x.reshape(-1, x.shape[-1])
        out = fp8_gemm.fp8_linear(flat, w, s, bias)
        return out.reshape(*x.shape[:-1], w.shape[0])
    return fp8_linear_torch(x, w, s, bias)


def dequantize_gate_up(w13: torch.Tensor, s13: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stacked gate/up experts w13 [E, 2I, H] e4m3 with scales [E, 2 ceil(I/128), ceil(H/128)]
    (the gate rows' blocks, then the up rows': each half blocked on its own, as the per-expert
    checkpoint tensors are) -> [E, 2I, H] in dtype."""
    I = w13.shape[1] // 2
    ni = cdiv(I, BLOCK)
    if s13.shape[1] != 2 * ni:
        raise ValueError(f"gate_up scales {tuple(s13.shape)} must hold 2 x {ni} row blocks (gate, then up) "
                         f"for I = {I}")
    return torch.cat([block_dequantize(w13[:, :I], s13[:, :ni], dtype),
                      block_dequantize(w13[:, I:], s13[:, ni:], dtype)], dim=1)


def quantize_gate_up(w13: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate/up experts w13 [..., 2I, H] -> (e4m3 [..., 2I, H], scales [..., 2 ceil(I/128), ceil(H/128)]):
    the gate rows and the up rows block-quantised apart (the layout `dequantize_gate_up` reads).
    power_of_two: as block_quantize's."""
    I = w13.shape[-2] // 2
    (qg, sg), (qu, su) = (block_quantize(w13[..., :I, :], power_of_two=power_of_two),
                          block_quantize(w13[..., I:, :], power_of_two=power_of_two))
    return torch.cat([qg, qu], dim=-2), torch.cat([sg, su], dim=-2)


def _per_expert(a: torch.Tensor, w: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Rows a [P, K] sorted by expert (expert e owns rows bounds[e]..bounds[e+1]-1) times w[e].T
    ([E, N, K]) -> [P, N]."""
    out = a.new_empty(a.shape[0], w.shape[1])
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi > lo:
            out[lo:hi] = a[lo:hi] @ w[e].T
    return out


def fp8_moe_experts_torch(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                          s2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                          activation: GatedActivation = SILU) -> torch.Tensor:
    """Routed experts with FP8 weights, computed as the fused kernel does: x quantised per token
    group; per (token, slot) pair gate/up in fp32, the gated activation in fp32, h quantised per
    pair and group; down in fp32 times the routing weight, rounded to x.dtype per pair; the k
    pairs of a token summed in fp32 in slot order, rounded once. Experts dequantised to fp32 (fp64
    for fp64 x) per call: the reference and the CPU path, not a fast path."""
    check_fp8_experts(x, w13, s13, w2, s2, weights, ids)
    work = work_dtype(x)
    M, k = ids.shape
    I = w13.shape[1] // 2
    if M * k == 0:
        return x.new_zeros(x.shape)
    W13, W2 = dequantize_gate_up(w13, s13, work), block_dequantize(w2, s2, work)
    xa = _group_dequant(*per_token_group_quant(x), work)
    order, ends = sort_pairs_by_expert(ids, w13.shape[0])
    bounds = [0] + ends.tolist()  # a host read: this is the reference, not a graph-captured path
    gu = _per_expert(xa[order // k], W13, bounds)  # [P, 2I]
    h = activation(gu[:, :I], gu[:, I:])
    ha = _group_dequant(*per_token_group_quant(h), work)
    y = _per_expert(ha, W2, bounds) * weights.reshape(-1)[order].to(work)[:, None]
    y = y.to(x.dtype)  # per pair in x's dtype, as the kernel writes it
    unsorted = torch.empty_like(y, dtype=work).index_copy_(0, order, y.to(work))
    return unsorted.view(M, k, -1).sum(1).to(x.dtype)


def fp8_moe_experts(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor, activation: GatedActivation = SILU) -> torch.Tensor:
    """x [M, H]; w13 [E, 2I, H] e4m3 + s13 [E, 2 ceil(I/128), ceil(H/128)]; w2 [E, H, I] e4m3 + s2
    [E, ceil(H/128), ceil(I/128)]; weights [M, k] fp32; ids [M, k] int64 -> [M, H] in x.dtype. The
    block-FP8 fused-MoE kernels on CUDA (hyla.ops.triton.fused_moe_fp8), `fp8_moe_experts_torch`
    elsewhere."""
    from hyla.ops import dispatch

    if dispatch.backend_for(x, x, [x], heads=False) == "triton":
        from hyla.ops.triton.fused_moe_fp8 import fused_moe_fp8

        return fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, activation=activation)
    return fp8_moe_experts_torch(x, w13, s13, w2, s2, weights, ids, activation)
