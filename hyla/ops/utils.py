"""Input validation and layout helpers shared by the naive, chunk and recurrent ops.

Every public op validates its arguments here so that a bad call fails with a ValueError that
names the offending argument, before any work is done.
"""

from __future__ import annotations

import functools
import inspect

import torch

from hyla.ops.dtypes import work_dtype
from hyla.ops.gate import gdn_gate, kda_gate
from hyla.ops.norm import l2norm

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def backend_twin(reference, core, **fixed):
    """Another backend's version of the public op `reference` (hyla.ops.chunk / recurrent) with
    `reference`'s own signature and docstring: positional arguments are named by that signature
    (no per-call binding: the decode path calls this per layer) and handed to `core` as keywords,
    plus `fixed` (the gate rule; `g=None` for the ops without a gate); core's defaults are the
    reference's. One public signature per op, whichever backend runs it."""
    names = list(inspect.signature(reference).parameters)  # positional order; defaults equal core's

    @functools.wraps(reference)
    def op(*args, **kwargs):
        if len(args) > len(names):
            raise TypeError(f"{reference.__name__}() takes {len(names)} positional arguments, got {len(args)}")
        a = {**fixed, **dict(zip(names, args)), **kwargs}
        q, k, v, g, beta = (a.pop(n, None) for n in ("q", "k", "v", "g", "beta"))
        return core(q, k, v, g, beta, **a)

    return op


def _version(t: torch.Tensor) -> int:
    """t's in-place version counter; inference tensors have none (0): an engine step's
    cu_seqlens, made under inference_mode, is never written after it is built."""
    return 0 if t.is_inference() else t._version


def remember_host_values(t: torch.Tensor, values: list) -> torch.Tensor:
    """Record the host-side values of a small device tensor built from a python list (an engine
    step's cu_seqlens), so ops that need them on the host (`host_values`) do not copy them back
    and sync the stream. Kept on the tensor itself with its version: an in-place change
    invalidates it. Returns t."""
    t._hyla_host = (_version(t), list(values))
    return t


def host_values(t: torch.Tensor) -> list:
    """t.tolist(), without a device sync when `remember_host_values` recorded them (or an
    earlier call did) and t has not changed since."""
    values = known_host_values(t)
    if values is None:
        values = t.tolist()
        t._hyla_host = (_version(t), values)
    return values


def known_host_values(t: torch.Tensor) -> list | None:
    """The host-side values `remember_host_values` (or an earlier `host_values`) recorded for t,
    if t has not changed since; else None (reading them would sync)."""
    hit = getattr(t, "_hyla_host", None)
    return hit[1] if hit is not None and hit[0] == _version(t) else None


def any_index_at_least(indices: torch.Tensor, limit: int) -> bool:
    """Whether an index (state slot) is >= limit, for the ops' range checks: read from the host
    values an engine step recorded when it built the tensor (no device sync: an eager step synced
    once per check and layer before), else from the device, and False while a CUDA graph is being
    captured (a capture cannot sync). A 2-D tensor's recorded values are nested lists."""
    return _any_index(indices, lambda i: i >= limit, lambda t: t >= limit)


def any_index_outside(indices: torch.Tensor, limit: int) -> bool:
    """Whether an index is < 0 or >= limit (read as any_index_at_least reads them)."""
    return _any_index(indices, lambda i: i < 0 or i >= limit, lambda t: (t < 0) | (t >= limit))


def _any_index(indices: torch.Tensor, on_host, on_device) -> bool:
    known = known_host_values(indices)
    if known is not None:
        rows = (v if isinstance(v, (list, tuple)) else (v,) for v in known)
        return any(on_host(i) for row in rows for i in row)
    return not is_capturing(indices) and bool(on_device(indices).any())


def check_slot_indices(ssm_state_indices, initial_state: torch.Tensor | None) -> None:
    """What every op over a state pool requires of its slot indices: a pool to index
    (`initial_state`) and an int32 / int64 tensor (shapes and values are each op's)."""
    if initial_state is None:
        raise ValueError("`ssm_state_indices` needs `initial_state` (the state pool [num_slots, HV, K, V])")
    if not isinstance(ssm_state_indices, torch.Tensor) or ssm_state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError("`ssm_state_indices` must be an int32/int64 tensor")


def check_chunk_pool(initial_state: torch.Tensor | None, ssm_state_indices: torch.Tensor | None,
                     has_initial_state: torch.Tensor | None, n: int) -> None:
    """The chunk ops' pool arguments: `ssm_state_indices` [N] int32 / int64 slots of the pool
    `initial_state` [num_slots, HV, K, V] (each >= 0 and inside it), `has_initial_state` [N] bool
    (only with a pool). Shapes of the pool itself are check_inputs'."""
    if ssm_state_indices is None:
        if has_initial_state is not None:
            raise ValueError("`has_initial_state` needs `ssm_state_indices` (it masks the pool's slots)")
        return
    check_slot_indices(ssm_state_indices, initial_state)
    if ssm_state_indices.shape != (n,):
        raise ValueError(f"`ssm_state_indices` must be [N] with N={n} for the chunk ops, "
                         f"got {tuple(ssm_state_indices.shape)}")
    if ssm_state_indices.device != initial_state.device:
        raise ValueError("`ssm_state_indices` must be on the pool's device")
    if n and any_index_outside(ssm_state_indices, initial_state.shape[0]):
        raise ValueError(f"`ssm_state_indices` must lie in [0, {initial_state.shape[0]}) (the pool's slots)")
    if has_initial_state is not None:
        if (not isinstance(has_initial_state, torch.Tensor) or has_initial_state.dtype != torch.bool
                or has_initial_state.shape != (n,) or has_initial_state.device != initial_state.device):
            raise ValueError(f"`has_initial_state` must be a bool tensor [N] with N={n} on the pool's device")


def cached_on(t: torch.Tensor, name: str, build):
    """build() once per (tensor, version): tables derived from an engine step's cu_seqlens are
    made once for all the layers of the step, not once per layer."""
    attr = f"_hyla_{name}"
    hit = getattr(t, attr, None)
    if hit is not None and hit[0] == _version(t):
        return hit[1]
    value = build()
    setattr(t, attr, (_version(t), value))
    return value


def is_capturing(t: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on the current stream of `t`'s device. Value
    checks (anything that reads a device tensor on the host) must be skipped then: a sync is not
    allowed inside a capture."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_tensor(name: str, x, ndim: int | None = None, floating: bool = True) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"`{name}` must have {ndim} dims, got shape {tuple(x.shape)}")
    if floating and x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"`{name}` must be fp64/fp32/bf16/fp16, got {x.dtype}")


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    *,
    gate: str | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    check_gate_sign: bool = True,
    state_is_pool: bool = False,
) -> int:
    """Validate the common op arguments and return N, the number of sequences.

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H; g: [B, T, HV, K] (gate="kda"),
    [B, T, HV] (gate="gdn") or None; beta: [B, T, HV] or None; initial_state: [N, HV, K, V]
    (or a pool [num_slots, HV, K, V] when state_is_pool); cu_seqlens: [N+1] int, B must be 1.
    """
    check_tensor("q", q, 4)
    check_tensor("k", k, 4)
    check_tensor("v", v, 4)
    if k.shape != q.shape:
        raise ValueError(f"`k` shape {tuple(k.shape)} must equal `q` shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"`v` shape {tuple(v.shape)} must start with [B, T] = {[B, T]}")
    HV = v.shape[2]
    if HV % H != 0:
        raise ValueError(f"`v` has {HV} heads, which is not a multiple of the {H} q/k heads")
    tensors = {"q": q, "k": k, "v": v}
    if gate == "kda":
        check_tensor("g", g, 4)
        if g.shape != (B, T, HV, K):
            raise ValueError(f"`g` must have shape {[B, T, HV, K]} (per-channel), got {tuple(g.shape)}")
    elif gate == "gdn":
        check_tensor("g", g, 3)
        if g.shape != (B, T, HV):
            raise ValueError(f"`g` must have shape {[B, T, HV]} (one gate per head), got {tuple(g.shape)}")
    if g is not None:
        tensors["g"] = g
    if beta is not None:
        check_tensor("beta", beta, 3)
        if beta.shape != (B, T, HV):
            raise ValueError(f"`beta` must have shape {[B, T, HV]}, got {tuple(beta.shape)}")
        tensors["beta"] = beta
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
            raise ValueError("`cu_seqlens` must be a 1-D tensor [N+1] of cumulative lengths")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"`cu_seqlens` must be int32/int64, got {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"with `cu_seqlens` the batch size must be 1, got B={B}")
        cu = host_values(cu_seqlens)
        if cu[0] != 0 or cu[-1] != T:
            raise ValueError(f"`cu_seqlens` must start at 0 and end at T={T}, got {cu[0]}..{cu[-1]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError("`cu_seqlens` must be non-decreasing")
        n = len(cu) - 1
    else:
        n = B
    if initial_state is not None:
        check_tensor("initial_state", initial_state, 4)
        if initial_state.shape[1:] != (HV, K, v.shape[3]):
            raise ValueError(
                f"`initial_state` must have shape [N, {HV}, {K}, {v.shape[3]}], got {tuple(initial_state.shape)}"
            )
        if not state_is_pool and initial_state.shape[0] != n:
            raise ValueError(f"`initial_state` has {initial_state.shape[0]} rows for {n} sequences")
        tensors["initial_state"] = initial_state
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if check_gate_sign and g is not None and g.numel() and bool((g > 0).any()):
        raise ValueError("`g` is a log-decay and must be <= 0 everywhere (found positive entries)")
    return n


def fused_preprocessing(q, k, g, beta, *, gate, dt, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                        use_beta_sigmoid_in_kernel, use_qk_l2norm_in_kernel):
    """What the ops' fused flags ask for, applied once: raw gate -> log-decay (kda_gate /
    gdn_gate), beta logits -> sigmoid, q / k -> L2-normalised (in the work dtype `dt`).
    Returns (q, k, g, beta)."""
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("`use_gate_in_kernel=True` needs `A_log`")
        g = kda_gate(g, A_log, dt_bias, lower_bound) if gate == "kda" else gdn_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.to(dt)), l2norm(k.to(dt))
    return q, k, g, beta


def seq_bounds(cu_seqlens: torch.Tensor | None, B: int, T: int) -> list[tuple[int, int, int]]:
    """[(batch_row, start, end)] per sequence: fixed-length rows, or packed varlen segments."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = host_values(cu_seqlens)
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """Repeat q/k heads for grouped value heads: [B, T, H, K] -> [B, T, HV, K] (head hv uses hv // (HV // H))."""
    h = x.shape[2]
    return x if h == hv else x.repeat_interleave(hv // h, dim=2)


def check_checkpoints(checkpoint_positions, lengths: list[int]) -> list[list[int]]:
    """Validate per-sequence checkpoint token counts (0 < p <= len) and return them as int lists."""
    if len(checkpoint_positions) != len(lengths):
        raise ValueError(
            f"`checkpoint_positions` needs one list per sequence ({len(lengths)}), got {len(checkpoint_positions)}"
        )
    out = []
    for n, (ps, length) in enumerate(zip(checkpoint_positions, lengths)):
        ps = [int(p) for p in ps]
        for p in ps:
            if not 0 < p <= length:
                raise ValueError(f"`checkpoint_positions[{n}]` has {p}, outside 1..{length} for that sequence")
        out.append(ps)
    return out
