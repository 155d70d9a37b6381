"""Backend choice for gated attention over FP8 KV pages (hyla.ops.kv_fp8): the two fused ops of a
decode / verify step, `qk_norm_rope_write` and `paged_window_attention` with their k_scale /
v_scale, on the Triton path under hyla.ops.dispatch's device / grad / backend rule (CUDA, or
HYLA_BACKEND=triton under the interpreter; activations fp32 / bf16 / fp16; D <= 256), the torch
references (hyla.ops.paged_attention) elsewhere.

The rule is dispatch.gated_attention_kernels' except for the pools' dtype: that one asks for
pools in an activation dtype, so it sends FP8 pools to the layer's torch code; these wrappers
carry the scales and accept them. (The MLA ops take their kv_scale through hyla.ops.dispatch's
wrappers as they are.)
"""

from __future__ import annotations

import torch

from hyla.ops import dispatch
from hyla.ops import paged_attention as _torch_paged_attention
from hyla.ops import triton as _triton

__all__ = ["attention_kernels", "qk_norm_rope_write", "paged_window_attention"]

_LOW = (torch.float32, torch.bfloat16, torch.float16)
_MAX_HEAD_DIM = 256


def attention_kernels(x: torch.Tensor, cache_k: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether a step with activations x (and the other activation-dtype tensors `others`) over
    FP8 key pages cache_k [pages, page_size, Hkv, D] runs the Triton kernels."""
    tensors = [t for t in (x, *others) if t is not None]
    return (isinstance(cache_k, torch.Tensor) and cache_k.ndim == 4 and cache_k.shape[-1] <= _MAX_HEAD_DIM
            and all(isinstance(t, torch.Tensor) and t.dtype in _LOW for t in tensors)
            and dispatch.backend_for(x, x, tensors, heads=False) == "triton")


def qk_norm_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, positions: torch.Tensor,
                       cache_k: torch.Tensor, cache_v: torch.Tensor, block_tables: torch.Tensor, width: int,
                       k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """hyla.ops.paged_attention.qk_norm_rope_write into FP8 pages, one Triton launch on CUDA."""
    if attention_kernels(q, cache_k, k, v, q_weight, k_weight):
        return _triton.qk_norm_rope_write(q, k, v, q_weight, k_weight, eps, inv_freq, positions, cache_k, cache_v,
                                          block_tables, width, k_scale=k_scale, v_scale=v_scale)
    return _torch_paged_attention.qk_norm_rope_write(q, k, v, q_weight, k_weight, eps, inv_freq, positions, cache_k,
                                                     cache_v, block_tables, width, k_scale=k_scale, v_scale=v_scale)


def paged_window_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           gate: torch.Tensor | None, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """hyla.ops.paged_attention.paged_window_attention over FP8 pages, one or two Triton launches
    on CUDA."""
    if attention_kernels(q, cache_k, gate):
        return _triton.paged_window_attention(q, cache_k, cache_v, block_tables, context_lens, scale, gate,
                                              k_scale=k_scale, v_scale=v_scale)
    return _torch_paged_attention.paged_window_attention(q, cache_k, cache_v, block_tables, context_lens, scale, gate,
                                                         k_scale=k_scale, v_scale=v_scale)
