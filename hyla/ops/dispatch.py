"""Backend choice for the chunk, recurrent and short-conv update ops: Triton kernels on CUDA,
torch elsewhere.

`hyla.ops.chunk_kda` (and the other six ops below) route a call to hyla.ops.triton when

  - the inputs live on a CUDA device and triton can be imported,
  - no input needs a gradient (the kernels are forward only; training stays on the
    differentiable torch path),
  - the inputs are not fp64 (the kernels compute in fp32; fp64 is the exactness reference),
  - K and V are at most 256 (the chunk and recurrent ops);

otherwise to the torch implementation (hyla.ops.chunk / hyla.ops.recurrent), whose contract the
kernels share. The environment variable HYLA_BACKEND overrides the device rule:
`torch` forces torch, `triton` forces the kernels also for CPU tensors (useful only under
TRITON_INTERPRET=1), `auto` (the default) is the rule above.
"""

from __future__ import annotations

import functools
import os

import torch

from hyla.ops import chunk as _torch_chunk
from hyla.ops import conv as _torch_conv
from hyla.ops import recurrent as _torch_recurrent
from hyla.ops import triton as _triton

__all__ = ["backend_for", "chunk_kda", "chunk_gated_delta_rule", "chunk_delta_rule",
           "fused_recurrent_kda", "fused_recurrent_gated_delta_rule", "causal_conv1d_update",
           "causal_conv1d_verify"]

_BACKENDS = ("auto", "torch", "triton")
_MAX_HEAD_DIM = 256


def backend_for(q: torch.Tensor, v: torch.Tensor, tensors, *, heads: bool = True) -> str:
    """'triton' or 'torch' for a call with query `q`, value `v` and all tensor arguments `tensors`.
    heads=False for the short conv (x as both q and v): no [B, T, H, D] layout or head-size rule."""
    choice = os.environ.get("HYLA_BACKEND", "auto").strip().lower() or "auto"
    if choice not in _BACKENDS:
        raise ValueError(f"HYLA_BACKEND must be one of {_BACKENDS}, got {choice!r}")
    if choice == "torch":
        return "torch"
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor)):
        return "torch"  # let the torch path raise its argument errors
    if heads and (q.ndim != 4 or v.ndim != 4):
        return "torch"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "torch"
    if q.dtype == torch.float64 or v.dtype == torch.float64:
        return "torch"
    if heads and (q.shape[-1] > _MAX_HEAD_DIM or v.shape[-1] > _MAX_HEAD_DIM):
        return "torch"
    if choice == "triton":
        if not _triton.is_available():
            raise RuntimeError("HYLA_BACKEND=triton but triton is not installed")
        if not q.is_cuda and not _triton.interpreting():
            raise RuntimeError("HYLA_BACKEND=triton with CPU tensors needs TRITON_INTERPRET=1")
        return "triton"
    return "triton" if q.is_cuda and _triton.is_available() else "torch"


def _dispatched(torch_fn, name: str, q_name: str = "q", v_name: str = "v", heads: bool = True):
    params = torch_fn.__code__.co_varnames[: torch_fn.__code__.co_argcount]
    i_q, i_v = params.index(q_name), params.index(v_name)

    @functools.wraps(torch_fn)
    def op(*args, **kwargs):
        q = args[i_q] if len(args) > i_q else kwargs.get(q_name)
        v = args[i_v] if len(args) > i_v else kwargs.get(v_name)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if backend_for(q, v, tensors, heads=heads) == "triton":
            return getattr(_triton, name)(*args, **kwargs)
        return torch_fn(*args, **kwargs)

    return op


chunk_kda = _dispatched(_torch_chunk.chunk_kda, "chunk_kda")
chunk_gated_delta_rule = _dispatched(_torch_chunk.chunk_gated_delta_rule, "chunk_gated_delta_rule")
chunk_delta_rule = _dispatched(_torch_chunk.chunk_delta_rule, "chunk_delta_rule")
fused_recurrent_kda = _dispatched(_torch_recurrent.fused_recurrent_kda, "fused_recurrent_kda")
fused_recurrent_gated_delta_rule = _dispatched(_torch_recurrent.fused_recurrent_gated_delta_rule,
                                               "fused_recurrent_gated_delta_rule")
causal_conv1d_update = _dispatched(_torch_conv.causal_conv1d_update, "causal_conv1d_update", "x", "x",
                                   heads=False)
causal_conv1d_verify = _dispatched(_torch_conv.causal_conv1d_verify, "causal_conv1d_verify", "x", "x",
                                   heads=False)
