"""Triton helpers for FP8 (e4m3) KV pages (the format: hyla.ops.kv_fp8).

Writing: a row group's dynamic scale and its e4m3 codes are the FP8 GEMMs' activation quantiser
(hyla.ops.triton.fp8_gemm.quantize_rows: s = max(amax, 1e-10) / 448 and x / s by correctly
rounded divisions, rounded to e4m3 in fp32 arithmetic, so that Triton's CPU interpreter, whose
own fp32 -> fp8 cast is wrong, gives the GPU's codes), bit for bit torch's
hyla.ops.fp8.per_token_group_quant up to the sign of zero. Reading: `compute_dtype`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.kv_fp8 import FP8_DTYPE
from hyla.ops.triton.fp8_gemm import quantize_rows

__all__ = ["quantize_groups", "compute_dtype"]


@triton.jit
def quantize_groups(v):
    """v [R, G] fp32, one group per row (masked-out columns 0) -> (e4m3-valued fp32 codes [R, G],
    scales [R] fp32), as hyla.ops.kv_fp8.quantize_rows computes them."""
    return quantize_rows(v, 1e-10)  # hyla.ops.fp8.ACT_EPS


def compute_dtype(cache: torch.Tensor, q: torch.Tensor):
    """The tl dtype rows of `cache` are read in: the cache's own, or for FP8 pages the queries'
    (the model dtype, which dequantised rows are rounded to)."""
    dt = q.dtype if cache.dtype == FP8_DTYPE else cache.dtype
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dt]
