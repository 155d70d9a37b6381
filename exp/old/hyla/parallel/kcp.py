"""KCP: context parallelism for KDA / Gated DeltaNet over torch.distributed.

One long sequence is cut into contiguous slices, one per rank of a process group, in rank
order (rank 0 holds the first tokens). The recurrence

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T

is an affine map of the state, so a whole slice r is one map S -> M_r S + S~_r with M_r
[K, K] and S~_r [K, V] per (batch, head) -- a size that does not depend on the slice length.
Each rank therefore

1. runs one chunked pass over its slice (local, parallel) that gives both its summary and its
   outputs up to the unknown incoming state (see "One local pass" below);
2. all-gathers the summaries of every rank                      (B*HV*(K^2 + K*V) values sent)
3. scans them in rank order from ``initial_state``:
       S_in(0) = initial_state,   S_in(r+1) = M_r S_in(r) + S~_r
   which gives its own incoming state and the final state (the same on every rank)
4. adds the incoming state's share to its outputs: one batched matmul, no second pass.

One local pass. The recurrence is linear in (state, values) jointly, so run it with K + V value
columns, values [v | 0] and initial state [0 | I]: the state after token t is [S~_t | A_t], where
S~_t is the state reached from zero and A_t the product of the transition matrices so far (the
final [S~ | A] is the summary (S~, M)), and the output is scale * q_t^T [S~_t | A_t] =
[o~_t | P_t]. From the true incoming state S_in, S_t = A_t S_in + S~_t, hence

    o_t = o~_t + P_t S_in          (P_t: [K] per head, S_in: [K, V])

one [T, K] x [K, V] matmul per head. Each rank thus costs one chunk pass over K + V columns
instead of a summary pass plus a second pass from S_in.

The first slice pays no summary. Rank 0 knows its incoming state (``initial_state``, or zeros)
before anything is exchanged, so it runs the plain chunk pass over V columns from it: exact
outputs at once, and its final state S_1, which is all later slices need from it. It sends
(M, S~) = (0, S_1): the scan's first step 0 @ S_in(0) + S_1 gives S_1 as before, so the scan and
the message size are unchanged. Only ranks 1.. carry the K extra columns (about 1.5x the cost
of a plain pass per token on an H200, BENCHMARKS.md "KCP on two GPUs"); ``balanced_slice_lengths``
gives rank 0 correspondingly more tokens so that every rank finishes at once.

Why the states cannot simply be added, as for plain linear attention (S = sum_t k_t v_t^T):
the (I - b k k^T) Diag(a) factors of later tokens act on everything written before them and do
not commute, so sum_r S~_r drops every M_r acting on earlier slices. It is wrong by O(1)
(``scripts/kcp_demo.py`` measures it), while the scan is exact to rounding.

Communication. Each rank contributes one buffer of B * HV * (K^2 + K*V) elements of the
summary dtype (fp32, or fp64 for fp64 inputs) per layer, whatever its slice length; softmax
context parallelism instead exchanges the slice's K and V, which grow with T
(:func:`softmax_cp_comm_bytes`). :func:`count_comm_bytes` counts what was actually handed to
the collective, so tests and the example can check the formula :func:`kcp_comm_bytes`.

Only the forward pass is distributed: the all-gather does not carry gradients across ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from hyla.ops.affine import identity
from hyla.ops.chunk import SUB_BLOCK
from hyla.ops.dispatch import chunk_gated_delta_rule, chunk_kda  # the Triton kernels on CUDA
from hyla.ops.dtypes import work_dtype
from hyla.ops.utils import check_inputs

__all__ = [
    "chunk_kda_cp",
    "chunk_gated_delta_rule_cp",
    "scan_summaries",
    "local_pass",
    "first_pass",
    "add_incoming",
    "balanced_slice_lengths",
    "simulate_kcp",
    "count_comm_bytes",
    "CommCounter",
    "kcp_comm_bytes",
    "softmax_cp_comm_bytes",
]


# ---------------------------------------------------------------------------------------------
# Counting what is sent
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CommCounter:
    """Bytes this process handed to collectives while the counter was active.

    bytes_sent: sum of the nbytes of the tensors this rank contributed (its own send buffer,
    not the gathered result); calls: number of collectives.
    """

    bytes_sent: int = 0
    calls: int = 0


_ACTIVE_COUNTERS: list[CommCounter] = []


@contextlib.contextmanager
def count_comm_bytes() -> Iterator[CommCounter]:
    """Count the bytes KCP sends from this process inside the ``with`` block.

    Example::

        with count_comm_bytes() as c:
            o, S = chunk_kda_cp(q, k, v, g, beta)
        assert c.bytes_sent == kcp_comm_bytes(B, HV, K, V, torch.float32)
    """
    counter = CommCounter()
    _ACTIVE_COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE_COUNTERS.remove(counter)


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); both
# are one collective into a preallocated buffer, supported by gloo and NCCL.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(buf: torch.Tensor, world: int, group) -> torch.Tensor:
    """All-gather a flat buffer [n] into [world, n] (row r = rank r's buffer), counting bytes."""
    out = buf.new_empty(world * buf.numel())
    _gather_into(out, buf, group=group)
    for counter in _ACTIVE_COUNTERS:
        counter.bytes_sent += buf.numel() * buf.element_size()
        counter.calls += 1
    return out.view(world, buf.numel())


def _itemsize(dtype) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if isinstance(dtype, bool) or not isinstance(dtype, int) or dtype < 1:
        raise ValueError(f"dtype must be a torch.dtype or a positive itemsize in bytes, got {dtype!r}")
    return dtype


def kcp_comm_bytes(batch: int, heads: int, head_k_dim: int, head_v_dim: int, dtype=torch.float32) -> int:
    """Bytes one rank sends per KCP layer: batch * heads * (K^2 + K*V) * itemsize.

    ``heads`` counts value heads (HV); ``dtype`` is the summary dtype (fp32, or fp64 for fp64
    inputs) or an itemsize in bytes. Independent of the number of tokens on the rank.
    """
    for name, n in (("batch", batch), ("heads", heads), ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    return batch * heads * (head_k_dim * head_k_dim + head_k_dim * head_v_dim) * _itemsize(dtype)


def softmax_cp_comm_bytes(
    batch: int, kv_heads: int, head_k_dim: int, head_v_dim: int, tokens_per_rank: int, dtype=torch.bfloat16
) -> int:
    """Bytes one rank sends per softmax-attention layer under all-gather context parallelism.

    Every rank needs the keys and values of all earlier tokens, so it contributes its slice's
    K and V: batch * tokens_per_rank * kv_heads * (K + V) * itemsize. (Ring attention passes each
    block on world - 1 times, so it sends that much again per hop.) Grows linearly with T.
    """
    if isinstance(tokens_per_rank, bool) or not isinstance(tokens_per_rank, int) or tokens_per_rank < 0:
        raise ValueError(f"tokens_per_rank must be a non-negative int, got {tokens_per_rank!r}")
    for name, n in (("batch", batch), ("kv_heads", kv_heads), ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    return batch * tokens_per_rank * kv_heads * (head_k_dim + head_v_dim) * _itemsize(dtype)


# ---------------------------------------------------------------------------------------------
# The scan (pure; shared by the distributed path and the single-process simulation)
# ---------------------------------------------------------------------------------------------


def scan_summaries(
    M_all: torch.Tensor, S_all: torch.Tensor, initial_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix-scan slice summaries in sequence order.

    M_all: [W, B, HV, K, K]; S_all: [W, B, HV, K, V] (slice r maps S -> M_all[r] S + S_all[r]);
    initial_state: [B, HV, K, V] or None (zeros), the state before slice 0.
    Returns (incoming [W, B, HV, K, V], final [B, HV, K, V]) in the dtype of the summaries:
    incoming[r] is the state entering slice r, final the state after the last slice.
    """
    if not (isinstance(M_all, torch.Tensor) and isinstance(S_all, torch.Tensor)):
        raise ValueError("M_all and S_all must be tensors")
    if M_all.dim() != 5 or M_all.shape[-1] != M_all.shape[-2]:
        raise ValueError(f"M_all must be [W, B, HV, K, K], got {tuple(M_all.shape)}")
    if S_all.dim() != 5 or S_all.shape[:-1] != M_all.shape[:-1]:
        raise ValueError(
            f"S_all must be [W, B, HV, K, V] matching M_all {tuple(M_all.shape)}, got {tuple(S_all.shape)}"
        )
    if initial_state is None:
        state = torch.zeros_like(S_all[0])
    elif not isinstance(initial_state, torch.Tensor) or initial_state.shape != S_all.shape[1:]:
        got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else initial_state
        raise ValueError(f"initial_state must be [B, HV, K, V] = {list(S_all.shape[1:])}, got {got}")
    else:
        state = initial_state.to(device=S_all.device, dtype=S_all.dtype)
    incoming = []
    for M, S in zip(M_all, S_all):  # sequential on purpose: W is the number of ranks, small
        incoming.append(state)
        state = M @ state + S
    return torch.stack(incoming), state


# ---------------------------------------------------------------------------------------------
# Distributed forward
# ---------------------------------------------------------------------------------------------


def _validate(q, k, v, g, beta, gate, initial_state, chunk_size):
    """Local checks, done before any collective so a bad call fails here with a ValueError.

    Cross-rank agreement (same B, H, HV, K, V and dtype on every rank) is not checked: that would
    cost an extra collective per layer. A mismatch makes the all-gather fail or hang.
    """
    check_inputs(q, k, v, g, beta, gate=gate, initial_state=None, cu_seqlens=None)
    B, _, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise ValueError("initial_state must be a floating-point tensor [B, HV, K, V]")
        if initial_state.shape != (B, HV, K, V):
            raise ValueError(
                f"initial_state must be [B, HV, K, V] = {[B, HV, K, V]} (the state before rank 0's "
                f"first token, passed on every rank), got {tuple(initial_state.shape)}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    # The same rule as chunk_kda, checked here so that it cannot fail after the collective.
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
            or (chunk_size > SUB_BLOCK and chunk_size % SUB_BLOCK)):
        raise ValueError(f"chunk_size must be <= {SUB_BLOCK} or a multiple of {SUB_BLOCK}, got {chunk_size!r}")


def _group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("KCP needs an initialised torch.distributed process group (dist.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def local_pass(q, k, v, g, beta, *, gate, scale=None, use_qk_l2norm_in_kernel=False, chunk_size=64):
    """One chunked pass over a slice from an unknown incoming state (module docstring).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta as for ``chunk_kda`` / ``chunk_gated_delta_rule``.
    Returns (o_zero [B, T, HV, V] in v.dtype: the outputs from a zero incoming state,
    P [B, T, HV, K] in v.dtype: o_t = o_zero_t + P_t @ S_in, M [B, HV, K, K] and
    S~ [B, HV, K, V] in fp32 (fp64 for fp64 inputs): the slice maps S_in to M S_in + S~).
    """
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    work = work_dtype(v)
    if T == 0:  # an empty slice maps every state to itself
        return (v.new_zeros(B, 0, HV, V), v.new_zeros(B, 0, HV, K),
                *identity(B, HV, K, V, dtype=work, device=v.device))
    v_ext = torch.cat([v, v.new_zeros(B, T, HV, K)], dim=-1)  # [B, T, HV, V + K]
    eye = torch.eye(K, dtype=work, device=v.device).expand(B, HV, K, K)
    s0 = torch.cat([eye.new_zeros(B, HV, K, V), eye], dim=-1)  # [B, HV, K, V + K]
    op = chunk_kda if gate == "kda" else chunk_gated_delta_rule
    o_ext, final = op(q, k, v_ext, g, beta, scale=scale, initial_state=s0, output_final_state=True,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    final = final.to(work)
    return o_ext[..., :V], o_ext[..., V:], final[..., V:].contiguous(), final[..., :V].contiguous()


def first_pass(q, k, v, g, beta, *, gate, initial_state=None, scale=None, use_qk_l2norm_in_kernel=False,
               chunk_size=64):
    """The first slice's pass: its incoming state is known, so a plain chunk pass (V columns)
    gives its outputs, and its summary is (M, S~) = (0, its final state).

    Shapes as for ``local_pass``; initial_state: [B, HV, K, V] or None (zeros). Returns
    (o [B, T, HV, V] in v.dtype, M = 0 [B, HV, K, K], S~ [B, HV, K, V] in fp32 / fp64).
    """
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    work = work_dtype(v)
    M = torch.zeros(B, HV, K, K, dtype=work, device=v.device)
    if T == 0:
        S = torch.zeros(B, HV, K, V, dtype=work, device=v.device) if initial_state is None else initial_state
        return v.new_zeros(B, 0, HV, V), M, S.to(work)
    op = chunk_kda if gate == "kda" else chunk_gated_delta_rule
    h0 = None if initial_state is None else initial_state.to(work)
    o, final = op(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    return o, M, final.to(work)


def balanced_slice_lengths(tokens: int, world: int, extended_cost: float = 1.5, multiple: int = 64) -> list[int]:
    """Slice lengths (rank order, summing to `tokens`) under which every rank's pass takes about
    the same time: rank 0 runs the plain pass (cost 1 per token), ranks 1.. the pass with K extra
    value columns (`extended_cost` per token; ~1.5 for K = V on an H200). Lengths are multiples
    of `multiple` (whole chunks) except the last slice's."""
    for name, n in (("tokens", tokens), ("world", world), ("multiple", multiple)):
        if isinstance(n, bool) or not isinstance(n, int) or n < (0 if name == "tokens" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name == 'tokens' else 'positive'} int, got {n!r}")
    if not extended_cost >= 1.0:
        raise ValueError(f"extended_cost must be >= 1 (the extended pass does more work), got {extended_cost!r}")
    per_other = tokens / (extended_cost + world - 1)
    lengths = [round(extended_cost * per_other / multiple) * multiple]
    lengths += [round(per_other / multiple) * multiple for _ in range(world - 2)]
    lengths = [min(n, tokens) for n in lengths]
    while sum(lengths) > tokens:  # rounding up overshot: trim from the end
        i = max(i for i, n in enumerate(lengths) if n)
        lengths[i] -= min(lengths[i], sum(lengths) - tokens)
    return lengths + [tokens - sum(lengths)] if world > 1 else [tokens]


def add_incoming(o_zero: torch.Tensor, P: torch.Tensor, incoming: torch.Tensor) -> torch.Tensor:
    """o = o_zero + P @ S_in per token and head.

    o_zero: [B, T, HV, V]; P: [B, T, HV, K]; incoming: [B, HV, K, V]. Returns [B, T, HV, V] in
    o_zero.dtype. fp32 / fp64 outputs are computed in the incoming state's precision. For bf16 /
    fp16 outputs the matmul runs on the tensor cores with S_in rounded to the output dtype and fp32
    accumulation: the chunk kernels themselves read the state in the input dtype for their
    q @ S product, so this adds no error of a new kind; an fp32 matmul here took 30% of a rank's
    time at 256K tokens x 32 heads on an H200 (BENCHMARKS.md, "KCP on two GPUs")."""
    if o_zero.dtype in (torch.bfloat16, torch.float16):
        return o_zero + torch.einsum("bthk,bhkv->bthv", P, incoming.to(o_zero.dtype))
    work = incoming.dtype
    corr = torch.einsum("bthk,bhkv->bthv", P.to(work), incoming)
    return (o_zero.to(work) + corr).to(o_zero.dtype)


def _cp_forward(q, k, v, g, beta, *, gate, group, scale, initial_state, use_qk_l2norm_in_kernel, chunk_size):
    _validate(q, k, v, g, beta, gate, initial_state, chunk_size)
    rank, world = _group_info(group)
    B, _, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]

    # 1. One pass: this slice's outputs up to the incoming state, and its summary (M, S~),
    # whose shape does not depend on T_local. Rank 0 knows its incoming state: a plain pass.
    opts = dict(gate=gate, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    if rank == 0:
        o, M, S = first_pass(q, k, v, g, beta, initial_state=initial_state, **opts)
    else:
        o_zero, P, M, S = local_pass(q, k, v, g, beta, **opts)
    # 2. One collective: M and S~ travel in a single flat buffer.
    buf = torch.cat([M.reshape(-1), S.reshape(-1)]).contiguous()  # [B*HV*(K*K + K*V)]
    gathered = _all_gather(buf, world, group)  # [W, B*HV*(K*K + K*V)]
    nm = M.numel()
    M_all = gathered[:, :nm].reshape(world, B, HV, K, K)
    S_all = gathered[:, nm:].reshape(world, B, HV, K, V)
    # 3. Every rank scans all W summaries: W small matmuls, and the final state comes out the
    # same everywhere without a second collective.
    incoming, final = scan_summaries(M_all, S_all, initial_state)
    # 4. The incoming state's share of the outputs (rank 0's are complete).
    return (o if rank == 0 else add_incoming(o_zero, P, incoming[rank])), final


_CP_DOC = """
    Each rank of ``group`` (default: the world group) holds a contiguous slice of one long
    sequence; rank order is sequence order and slices may have different lengths (0 included).

    q, k: [B, T_local, H, K]; v: [B, T_local, HV, V] (HV a multiple of H); beta: [B, T_local, HV];
    initial_state: [B, HV, K, V] or None, the state before rank 0's first token, passed on every
    rank; scale defaults to K^-1/2; with use_qk_l2norm_in_kernel, q and k are L2-normalised.
    Returns (o_local [B, T_local, HV, V] in v.dtype, final_state [B, HV, K, V]), final_state being
    the state after the whole sequence, identical on every rank, in fp32 (fp64 for fp64 inputs).

    Sends B * HV * (K^2 + K*V) * itemsize bytes per rank (one all-gather of (M, S~)), independent
    of T_local; see ``kcp_comm_bytes`` and ``count_comm_bytes``. Forward only. Works with any
    backend that supports all_gather_single (all_gather_into_tensor) on the inputs' device:
    gloo on CPU, NCCL on GPU.
"""


def chunk_kda_cp(q, k, v, g, beta, *, group=None, scale=None, initial_state=None,
                 use_qk_l2norm_in_kernel=False, chunk_size=64):
    """Context-parallel chunkwise KDA. g: [B, T_local, HV, K] per-channel log-decay (<= 0).

    Equal, up to rounding, to ``chunk_kda`` on the concatenation of all ranks' slices.
    """
    return _cp_forward(q, k, v, g, beta, gate="kda", group=group, scale=scale, initial_state=initial_state,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)


def chunk_gated_delta_rule_cp(q, k, v, g, beta, *, group=None, scale=None, initial_state=None,
                              use_qk_l2norm_in_kernel=False, chunk_size=64):
    """Context-parallel chunkwise Gated DeltaNet. g: [B, T_local, HV] log-decay per head (<= 0).

    Equal, up to rounding, to ``chunk_gated_delta_rule`` on the concatenation of all slices.
    """
    return _cp_forward(q, k, v, g, beta, gate="gdn", group=group, scale=scale, initial_state=initial_state,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)


chunk_kda_cp.__doc__ += _CP_DOC
chunk_gated_delta_rule_cp.__doc__ += _CP_DOC


# ---------------------------------------------------------------------------------------------
# Single-process simulation (for the demo, the plots and debugging)
# ---------------------------------------------------------------------------------------------


def simulate_kcp(q, k, v, g, beta, lengths: Sequence[int], *, gate="kda", scale=None, initial_state=None,
                 use_qk_l2norm_in_kernel=False, chunk_size=64):
    """What the ranks of ``chunk_kda_cp`` compute, in one process, without the collective.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] (gate="kda") or [B, T, HV] ("gdn");
    beta: [B, T, HV]; lengths: slice lengths in rank order, summing to T.
    Returns (o [B, T, HV, V], final [B, HV, K, V], M_all [W, B, HV, K, K], S_all [W, B, HV, K, V],
    incoming [W, B, HV, K, V]).
    """
    if gate not in ("kda", "gdn"):
        raise ValueError(f"gate must be 'kda' or 'gdn', got {gate!r}")
    _validate(q, k, v, g, beta, gate, initial_state, chunk_size)
    lengths = list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of non-negative ints, got {lengths!r}")
    if sum(lengths) != q.shape[1]:
        raise ValueError(f"lengths sum to {sum(lengths)} but the sequence has T={q.shape[1]} tokens")
    bounds = [(sum(lengths[:r]), sum(lengths[: r + 1])) for r in range(len(lengths))]
    opts = dict(gate=gate, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    (s0, e0), rest = bounds[0], bounds[1:]
    o_first, M0, S0 = first_pass(q[:, s0:e0], k[:, s0:e0], v[:, s0:e0], g[:, s0:e0], beta[:, s0:e0],
                                 initial_state=initial_state, **opts)
    passes = [local_pass(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], **opts) for s, e in rest]
    M_all = torch.stack([M0] + [p[2] for p in passes])
    S_all = torch.stack([S0] + [p[3] for p in passes])
    incoming, final = scan_summaries(M_all, S_all, initial_state)
    outs = [o_first] + [add_incoming(o_zero, P, incoming[r + 1]) for r, (o_zero, P, _, _) in enumerate(passes)]
    return torch.cat(outs, dim=1), final, M_all, S_all, incoming
