"""The shape contract of block-FP8 weights, shared by the torch definitions (hyla.ops.fp8) and the
Triton kernels (hyla.ops.triton.fp8_gemm, hyla.ops.triton.fused_moe_fp8); imports nothing from hyla."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
BLOCK = 128  # rows and columns of a weight block; columns of an activation group


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(rows: int, cols: int, block: int = BLOCK) -> tuple[int, int]:
    """The block-scale shape of a [rows, cols] weight: (ceil(rows / block), ceil(cols / block))."""
    return cdiv(rows, block), cdiv(cols, block)


def check_fp8_experts(x, w13, s13, w2, s2, weights, ids) -> None:
    """x [M, H]; w13 [E, 2I, H] and w2 [E, H, I] e4m3 with their block scales; weights / ids [M, k]."""
    if x.ndim != 2 or w13.ndim != 3 or w2.ndim != 3:
        raise ValueError(f"expected x [M, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    E, two_i, H = w13.shape
    if two_i % 2 or x.shape[1] != H or tuple(w2.shape) != (E, H, two_i // 2):
        raise ValueError(f"inconsistent expert shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if weights.shape != ids.shape or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"weights and ids must both be [M={x.shape[0]}, k]; got {tuple(weights.shape)}, "
                         f"{tuple(ids.shape)}")
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 experts must be float8_e4m3fn, got {w13.dtype}, {w2.dtype}")
    I = two_i // 2
    if tuple(s13.shape) != (E, 2 * cdiv(I, BLOCK), cdiv(H, BLOCK)) or tuple(s2.shape) != (E, *scale_shape(H, I)):
        raise ValueError(f"FP8 expert scales {tuple(s13.shape)}, {tuple(s2.shape)} do not match the blocks of "
                         f"w13 {tuple(w13.shape)} (gate and up blocked apart) and w2 {tuple(w2.shape)}")
    if s13.dtype != torch.float32 or s2.dtype != torch.float32:
        raise ValueError(f"FP8 expert scales must be float32, got {s13.dtype}, {s2.dtype}")
