"""Backend choice for the chunk, recurrent and short-conv update ops and the fused decode norms
and gates: Triton kernels on CUDA, torch elsewhere.

`hyla.ops.chunk_kda` (and the other six ops below) route a call to hyla.ops.triton when

  - the inputs live on a CUDA device and triton can be imported,
  - no input needs a gradient (the kernels are forward only; training stays on the
    differentiable torch path),
  - the inputs are not fp64 (the kernels compute in fp32; fp64 is the exactness reference),
  - K and V are at most 256 (the chunk and recurrent ops);

otherwise to the torch implementation (hyla.ops.chunk / hyla.ops.recurrent), whose contract the
kernels share. The process-wide backend choice overrides the device rule: `torch` forces torch,
`triton` forces the kernels also for CPU tensors (useful only under TRITON_INTERPRET=1), `auto`
(the default) is the rule above. It is read once: from the environment variable HYLA_BACKEND when
this module is imported, then `set_backend` (EngineConfig.backend, applied by the engine at
startup; tests) changes it; no op call reads the environment.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from hyla.ops import chunk as _torch_chunk
from hyla.ops import conv as _torch_conv
from hyla.ops import gate as _torch_gate
from hyla.ops import gated_act as _torch_gated_act
from hyla.ops import mla as _torch_mla
from hyla.ops import mtp_input as _torch_mtp_input
from hyla.ops import norm as _torch_norm
from hyla.ops import paged_attention as _torch_paged_attention
from hyla.ops import recurrent as _torch_recurrent
from hyla.ops import step_rows as _torch_step_rows
from hyla.ops import triton as _triton
from hyla.ops.dtypes import check_lower_bound

__all__ = ["backend_for", "get_backend", "set_backend", "chunk_kda", "chunk_gated_delta_rule", "chunk_delta_rule",
           "fused_recurrent_kda", "fused_recurrent_gated_delta_rule", "causal_conv1d_update",
           "causal_conv1d_verify", "rms_norm_rounded", "rms_norm_zero_centred", "add_rms_norm", "gated_rms_norm",
           "lowrank_gated_rms_norm", "silu_gated_rms_norm", "kda_gate_beta", "kda_lowrank_gate_beta", "gdn_gate_beta",
           "gdn_projected_gate_in_kernel", "gdn_projected_gate_beta", "causal_conv1d_update_packed",
           "causal_conv1d_fn", "causal_conv1d_prefill_packed",
           "write_latents", "paged_mla_decode", "gated_attention_kernels", "qk_norm_rope_write",
           "paged_window_attention", "silu_mul", "mtp_fc_input", "derive_step_rows"]

BACKENDS = ("auto", "torch", "triton")
_MAX_HEAD_DIM = 256
# Token rows up to which a gate's input projection runs inside the gate's kernel (a decode step's
# batch): KDA's low-rank gates (the forget gate, the output norm's gate: their up-projection),
# GDN's b and a where a checkpoint keeps them apart from the FP8 GEMM, and Qwen3-Next's
# shared-expert gate in the routing kernel (hyla.ops.moe.softmax_topk_route). Above, the projection
# is a GEMM (tensor cores) and the gate a second launch.
LOWRANK_GATE_MAX_ROWS = 16


def projects_in_kernel(rows: int) -> bool:
    """Whether a gate's input projection over `rows` token rows runs inside the gate's kernel: the
    one row rule (LOWRANK_GATE_MAX_ROWS) of every fused projected gate (here and in
    hyla.ops.moe)."""
    return rows <= LOWRANK_GATE_MAX_ROWS


def _parse_backend(choice) -> str:
    value = (choice.strip().lower() if isinstance(choice, str) else choice) or "auto"
    if value not in BACKENDS:
        raise ValueError(f"the backend (EngineConfig.backend, HYLA_BACKEND) must be one of {BACKENDS}, got {choice!r}")
    return value


# The backend choice of this process: HYLA_BACKEND at import (so that a test or a child process
# setting it before importing hyla gets it), then whatever set_backend sets.
_backend = _parse_backend(os.environ.get("HYLA_BACKEND", "auto"))


def set_backend(choice: str) -> str:
    """Choose the backend of every dispatched op in this process: "auto", "torch" or "triton"
    (see the module docstring) -> the previous choice. ValueError for anything else."""
    global _backend
    previous, _backend = _backend, _parse_backend(choice)
    return previous


def get_backend() -> str:
    """The backend choice in force: "auto", "torch" or "triton"."""
    return _backend


def backend_for(q: torch.Tensor, v: torch.Tensor, tensors, *, heads: bool = True) -> str:
    """'triton' or 'torch' for a call with query `q`, value `v` and all tensor arguments `tensors`.
    heads=False for the short conv (x as both q and v): no [B, T, H, D] layout or head-size rule."""
    choice = _backend
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
            raise RuntimeError("backend 'triton' (HYLA_BACKEND / set_backend) but triton is not installed")
        if not q.is_cuda and not _triton.interpreting():
            raise RuntimeError("backend 'triton' (HYLA_BACKEND / set_backend) with CPU tensors needs "
                               "TRITON_INTERPRET=1")
        return "triton"
    return "triton" if q.is_cuda and _triton.is_available() else "torch"


# (op, dtype, q's and v's last dims) the Triton kernels found no room for on this device: such
# calls take the torch path from then on (see _dispatched).
_NO_FIT: set = set()
_log = logging.getLogger("hyla.ops")


def _dispatched(torch_fn, name: str, q_name: str = "q", v_name: str = "v", heads: bool = True):
    """torch_fn's op, run by the Triton kernel of the same name when backend_for says so. A
    kernel whose block config does not fit the device (Triton's OutOfResources at launch, e.g.
    fp32 inputs on a config sized for bf16) is not an error in the auto mode: the call, and every
    later call of that op, dtype and head size, runs the torch path, with one warning. Under the
    backend "triton" it is raised."""
    params = torch_fn.__code__.co_varnames[: torch_fn.__code__.co_argcount]
    i_q, i_v = params.index(q_name), params.index(v_name)

    @functools.wraps(torch_fn)
    def op(*args, **kwargs):
        q = args[i_q] if len(args) > i_q else kwargs.get(q_name)
        v = args[i_v] if len(args) > i_v else kwargs.get(v_name)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if backend_for(q, v, tensors, heads=heads) == "triton":
            key = (name, q.dtype, q.shape[-1], v.shape[-1])
            if key not in _NO_FIT:
                try:
                    return getattr(_triton, name)(*args, **kwargs)
                except Exception as err:  # noqa: BLE001 - only OutOfResources is caught
                    if type(err).__name__ != "OutOfResources" or _backend == "triton":
                        raise
                    _NO_FIT.add(key)
                    _log.warning("%s: the Triton kernel does not fit this device for %s at head sizes %d/%d "
                                 "(%s); using the torch path", name, q.dtype, q.shape[-1], v.shape[-1], err)
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
causal_conv1d_fn = _dispatched(_torch_conv.causal_conv1d_fn, "causal_conv1d_fn", "x", "x", heads=False)
causal_conv1d_update_packed = _dispatched(_torch_conv.causal_conv1d_update_packed, "causal_conv1d_update_packed",
                                          "x", "x", heads=False)
causal_conv1d_prefill_packed = _dispatched(_torch_conv.causal_conv1d_prefill_packed, "causal_conv1d_prefill_packed",
                                           "x", "x", heads=False)

write_latents = _dispatched(_torch_mla.write_latents, "write_latents", "kv", "cache", heads=False)
paged_mla_decode = _dispatched(_torch_mla.paged_mla_decode, "paged_mla_decode", "q_lat", "cache", heads=False)


# -- fused decode norms and gates (hyla.ops.triton.norm / gate; torch: hyla.ops.norm / gate) ------
# fp8_output (the norms here and silu_mul below): on the Triton path the kernel also writes its
# output's block-FP8 form for the FP8 GEMMs it feeds (hyla.ops.fp8_activation); the torch path
# ignores it (its consumers quantise, as before).

_LOW = (torch.float32, torch.bfloat16, torch.float16)
_MAX_NORM_D = 16384


def _elementwise_triton(x: torch.Tensor, tensors) -> bool:
    """The device / grad / backend rule of backend_for, for an element-wise op on x; every tensor
    in fp32 / bf16 / fp16 (fp64 is the exactness reference and stays on torch)."""
    if not isinstance(x, torch.Tensor) or any(not isinstance(t, torch.Tensor) or t.dtype not in _LOW
                                              for t in tensors if t is not None):
        return False
    return backend_for(x, x, [t for t in tensors if t is not None], heads=False) == "triton"


def _norm_triton(x, weight, *others) -> bool:
    return (_elementwise_triton(x, (x, weight, *others)) and x.dim() >= 1 and 0 < x.shape[-1] <= _MAX_NORM_D
            and (weight is None or weight.shape == (x.shape[-1],)))


def rms_norm_rounded(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                     fp8_output: bool = False) -> torch.Tensor:
    """hyla.ops.norm.rms_norm_rounded (Kimi's RMSNorm), one Triton launch on CUDA."""
    if _norm_triton(x, weight):
        return _triton.rms_norm_rounded(x, weight, eps, fp8_output)
    return _torch_norm.rms_norm_rounded(x, weight, eps)


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                          fp8_output: bool = False) -> torch.Tensor:
    """hyla.ops.norm.rms_norm_zero_centred (Qwen3-Next's RMSNorm), one Triton launch on CUDA."""
    if _norm_triton(x, weight):
        return _triton.rms_norm_zero_centred(x, weight, eps, fp8_output)
    return _torch_norm.rms_norm_zero_centred(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6,
                 zero_centred: bool = False, fp8_output: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """hyla.ops.norm.add_rms_norm -> (norm(residual + x), residual + x), one Triton launch on CUDA."""
    if _norm_triton(x, weight, residual) and (residual is None or (residual.shape == x.shape
                                                                  and residual.dtype == x.dtype)):
        return _triton.add_rms_norm(x, residual, weight, eps, zero_centred, fp8_output)
    return _torch_norm.add_rms_norm(x, residual, weight, eps, zero_centred)


def _gate_ok(x, gate) -> bool:
    return isinstance(gate, torch.Tensor) and gate.numel() == x.numel() and gate.shape[-1] == x.shape[-1]


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6,
                   activation: str = "sigmoid", fp8_output: bool = False) -> torch.Tensor:
    """hyla.ops.norm.gated_rms_norm, one Triton launch on CUDA. On that path gate may also be a
    view with x's rows in order but other leading dims (read in place); torch reshapes it."""
    if _norm_triton(x, weight, gate) and _gate_ok(x, gate) and activation in ("sigmoid", "silu", "swish"):
        return _triton.gated_rms_norm(x, gate, weight, eps, activation, fp8_output)
    return _torch_norm.gated_rms_norm(x, gate.reshape(x.shape), weight, eps, activation)


def lowrank_gated_rms_norm(x: torch.Tensor, g_in: torch.Tensor, w_up: torch.Tensor, weight: torch.Tensor | None,
                           eps: float = 1e-6, activation: str = "sigmoid", fp8_output: bool = False) -> torch.Tensor:
    """hyla.ops.norm.lowrank_gated_rms_norm (the gate from g_in @ w_up^T): one launch on CUDA up to
    LOWRANK_GATE_MAX_ROWS token rows, else the up-projection's GEMM and `gated_rms_norm`."""
    ok = (isinstance(x, torch.Tensor) and x.dim() == 4 and isinstance(g_in, torch.Tensor) and g_in.dim() == 3
          and isinstance(w_up, torch.Tensor) and w_up.dim() == 2 and g_in.shape[:2] == x.shape[:2]
          and w_up.shape == (x.shape[2] * x.shape[3], g_in.shape[2]) and activation in ("sigmoid", "silu", "swish"))
    if ok and projects_in_kernel(x.shape[0] * x.shape[1]) and _norm_triton(x, weight, g_in, w_up):
        return _triton.lowrank_gated_rms_norm(x, g_in, w_up, weight, eps, activation, fp8_output)
    if not ok:  # the reference names what is wrong
        return _torch_norm.lowrank_gated_rms_norm(x, g_in, w_up, weight, eps, activation)
    gate = torch.nn.functional.linear(g_in, w_up).unflatten(-1, x.shape[-2:])
    return gated_rms_norm(x, gate, weight, eps, activation, fp8_output)


def silu_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                        fp8_output: bool = False) -> torch.Tensor:
    """hyla.ops.norm.silu_gated_rms_norm (GDN's output norm), one Triton launch on CUDA; gate as in
    gated_rms_norm."""
    if _norm_triton(x, weight, gate) and _gate_ok(x, gate):
        return _triton.silu_gated_rms_norm(x, gate, weight, eps, fp8_output)
    return _torch_norm.silu_gated_rms_norm(x, gate.reshape(x.shape), weight, eps)


def kda_gate_beta(f: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None,
                  lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hyla.ops.gate.kda_gate_beta -> (g fp32 [B, T, H, K], beta [B, T, H]), one launch on CUDA."""
    ok = (isinstance(f, torch.Tensor) and f.dim() == 4 and isinstance(b, torch.Tensor)
          and b.shape == f.shape[:3] and isinstance(A_log, torch.Tensor) and A_log.numel() == f.shape[2]
          and (dt_bias is None or dt_bias.numel() == f.shape[2] * f.shape[3]))
    if ok and _elementwise_triton(f, (f, b, A_log, dt_bias)):
        if lower_bound is not None:
            check_lower_bound(lower_bound)
        return _triton.kda_gate_beta(f, b, A_log, dt_bias, lower_bound)
    return _torch_gate.kda_gate_beta(f, b, A_log, dt_bias, lower_bound)


def kda_lowrank_gate_beta(fa: torch.Tensor, w_up: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                          dt_bias: torch.Tensor | None = None,
                          lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hyla.ops.gate.kda_lowrank_gate_beta (f = fa @ w_up^T, then the gates): one launch on CUDA up
    to LOWRANK_GATE_MAX_ROWS token rows, else the up-projection's GEMM and `kda_gate_beta`."""
    ok = (isinstance(fa, torch.Tensor) and fa.dim() == 3 and isinstance(b, torch.Tensor) and b.dim() == 3
          and isinstance(w_up, torch.Tensor) and w_up.dim() == 2 and w_up.shape[1] == fa.shape[2]
          and b.shape[:2] == fa.shape[:2] and w_up.shape[0] % max(b.shape[2], 1) == 0
          and isinstance(A_log, torch.Tensor) and A_log.numel() == b.shape[2]
          and (dt_bias is None or dt_bias.numel() == w_up.shape[0]))
    if (ok and projects_in_kernel(fa.shape[0] * fa.shape[1])
            and _elementwise_triton(fa, (fa, w_up, b, A_log, dt_bias))):
        if lower_bound is not None:
            check_lower_bound(lower_bound)
        return _triton.kda_lowrank_gate_beta(fa, w_up, b, A_log, dt_bias, lower_bound)
    if not ok:  # the reference names what is wrong
        return _torch_gate.kda_lowrank_gate_beta(fa, w_up, b, A_log, dt_bias, lower_bound)
    f = torch.nn.functional.linear(fa, w_up).unflatten(-1, (b.shape[2], -1))
    return kda_gate_beta(f, b, A_log, dt_bias, lower_bound)


def gdn_gate_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hyla.ops.gate.gdn_gate_beta -> (g fp32 [B, T, HV], beta [B, T, HV]), one launch on CUDA."""
    ok = (isinstance(a, torch.Tensor) and a.dim() in (3, 4) and isinstance(b, torch.Tensor)
          and b.shape == a.shape and isinstance(A_log, torch.Tensor)
          and A_log.numel() == a.shape[2:].numel() and (dt_bias is None or dt_bias.numel() == A_log.numel()))
    if ok and _elementwise_triton(a, (a, b, A_log, dt_bias)):
        return _triton.gdn_gate_beta(a, b, A_log, dt_bias)
    return _torch_gate.gdn_gate_beta(a, b, A_log, dt_bias)


def gdn_projected_gate_in_kernel(x: torch.Tensor, w_b: torch.Tensor, w_a: torch.Tensor, A_log: torch.Tensor,
                                 dt_bias: torch.Tensor | None = None) -> bool:
    """Whether gdn_projected_gate_beta with these arguments computes b and a inside the gate's
    kernel (one launch): x [B, T, hidden] of at most LOWRANK_GATE_MAX_ROWS token rows (a decode
    step), w_b and w_a [HV, hidden] or [H, r, hidden] in x's dtype, on the Triton path. A layer asks
    before it leaves b and a out of its projections' GEMM (hyla.layers.gdn)."""
    if not (isinstance(x, torch.Tensor) and x.dim() == 3 and isinstance(w_b, torch.Tensor)
            and isinstance(w_a, torch.Tensor) and isinstance(A_log, torch.Tensor)):
        return False
    hv = w_b.shape[:-1].numel()
    return (projects_in_kernel(x.shape[0] * x.shape[1]) and w_b.dim() in (2, 3) and w_a.dim() in (2, 3)
            and w_b.shape[-1] == w_a.shape[-1] == x.shape[-1] and w_a.shape[:-1].numel() == hv
            and w_b.dtype == w_a.dtype == x.dtype and A_log.numel() == hv
            and (dt_bias is None or dt_bias.numel() == hv) and _elementwise_triton(x, (x, w_b, w_a, A_log, dt_bias)))


def gdn_projected_gate_beta(x: torch.Tensor, w_b: torch.Tensor, w_a: torch.Tensor, A_log: torch.Tensor,
                            dt_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hyla.ops.gate.gdn_projected_gate_beta (b = x @ w_b^T, a = x @ w_a^T, then the gate) -> (g fp32
    [B, T, HV], beta [B, T, HV]): one launch on CUDA where gdn_projected_gate_in_kernel says so,
    else the reference (the two linears, then the gate)."""
    if gdn_projected_gate_in_kernel(x, w_b, w_a, A_log, dt_bias):
        return _triton.gdn_projected_gate_beta(x, w_b, w_a, A_log, dt_bias)
    return _torch_gate.gdn_projected_gate_beta(x, w_b, w_a, A_log, dt_bias)


# -- gated attention of a decode / verify step over paged KV (hyla.ops.triton.paged_attention) ------


def gated_attention_kernels(x: torch.Tensor, cache_k: torch.Tensor, fp8: bool = False) -> bool:
    """Whether a decode / verify step's gated attention (activations x, key pool cache_k
    [pages, page_size, Hkv, D]) runs as the two fused ops below on the Triton path: the device /
    grad / backend rule of backend_for, fp32 / bf16 / fp16, D <= 256. fp8: the pools are FP8
    pages with per-token scales (hyla.ops.kv_fp8), which the kernels dequantise as they read, so
    only the activations' dtype counts. Otherwise the layer keeps its torch code (the CPU path,
    which the transformers oracles check)."""
    return _attention_triton(x, cache_k, fp8)


def _attention_triton(x: torch.Tensor, cache_k: torch.Tensor, fp8: bool = False) -> bool:
    return (isinstance(cache_k, torch.Tensor) and cache_k.ndim == 4 and cache_k.shape[-1] <= _MAX_HEAD_DIM
            and _elementwise_triton(x, (x,) if fp8 else (x, cache_k)))


def qk_norm_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, positions: torch.Tensor,
                       cache_k: torch.Tensor, cache_v: torch.Tensor, block_tables: torch.Tensor,
                       width: int, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """hyla.ops.paged_attention.qk_norm_rope_write, one Triton launch on CUDA; k_scale / v_scale:
    FP8 pages' per-token scales (None: pools in an activation dtype)."""
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    if _attention_triton(q, cache_k, bool(scales)) and _elementwise_triton(q, (k, v, q_weight, k_weight)):
        return _triton.qk_norm_rope_write(q, k, v, q_weight, k_weight, eps, inv_freq, positions, cache_k, cache_v,
                                          block_tables, width, **scales)
    return _torch_paged_attention.qk_norm_rope_write(q, k, v, q_weight, k_weight, eps, inv_freq, positions, cache_k,
                                                     cache_v, block_tables, width, **scales)


def paged_window_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           gate: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """hyla.ops.paged_attention.paged_window_attention, one or two Triton launches on CUDA;
    k_scale / v_scale as in qk_norm_rope_write."""
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    if _attention_triton(q, cache_k, bool(scales)) and _elementwise_triton(q, (gate,) if scales else (cache_v, gate)):
        return _triton.paged_window_attention(q, cache_k, cache_v, block_tables, context_lens, scale, gate, **scales)
    return _torch_paged_attention.paged_window_attention(q, cache_k, cache_v, block_tables, context_lens, scale, gate,
                                                         **scales)


# -- the SwiGLU activation of a dense MLP / shared expert (hyla.ops.triton.gated_act; torch: hyla.ops.gated_act) --


def silu_mul(gate: torch.Tensor, up: torch.Tensor, fp8_output: bool = False) -> torch.Tensor:
    """hyla.ops.gated_act silu(gate) * up, one Triton launch on CUDA. gate, up: [..., I] of one
    shape and dtype, unit column stride and any row stride (the column views of a packed gate / up
    GEMM output are read in place); anything else, and the CPU / fp64 / grad cases, take torch's
    `F.silu(gate) * up` (the gated_act SILU reference) unchanged. fp8_output: as for the norms."""
    if (_elementwise_triton(gate, (gate, up)) and isinstance(up, torch.Tensor) and up.shape == gate.shape
            and up.dtype == gate.dtype and gate.dim() >= 1
            and (gate.shape[-1] == 1 or (gate.stride(-1) == 1 and up.stride(-1) == 1))):
        return _triton.silu_mul(gate, up, fp8_output)
    return _torch_gated_act.SILU(gate, up)


def mtp_fc_input(ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, w_e: torch.Tensor,
                 w_h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """hyla.ops.mtp_input.mtp_fc_input (an MTP head step's fc input), one Triton launch on CUDA."""
    if (_norm_triton(hidden, w_h, embed, w_e) and embed.dtype == hidden.dtype and hidden.dim() == 2
            and isinstance(ids, torch.Tensor) and ids.is_cuda == hidden.is_cuda):
        return _triton.mtp_fc_input(ids, embed, hidden, w_e, w_h, eps)
    return _torch_mtp_input.mtp_fc_input(ids, embed, hidden, w_e, w_h, eps)


def derive_step_rows(base: torch.Tensor, prev: torch.Tensor, vmeta: torch.Tensor, emeta: torch.Tensor,
                     vpad: torch.Tensor, epad: torch.Tensor, kept: torch.Tensor | None = None) -> None:
    """hyla.ops.step_rows.derive_step_rows (the next overlapped MTP step's input rows), one
    Triton launch on CUDA (backend "triton": also the interpreter on CPU tensors)."""
    if backend_for(prev, prev, (), heads=False) == "triton" and all(
            t.stride(-1) == 1 for t in (base, prev, vmeta, emeta, vpad, epad)):
        return _triton.derive_step_rows(base, prev, vmeta, emeta, vpad, epad, kept)
    return _torch_step_rows.derive_step_rows(base, prev, vmeta, emeta, vpad, epad, kept)
