"""The affine view of the delta-rule recurrence: segment summaries, composition, prefix scan.

Each token maps the state S [K, V] affinely,

    S -> M_t S + B_t,     M_t = (I - b_t k_t k_t^T) Diag(a_t),     B_t = b_t k_t v_t^T,

so any run of tokens is one affine map ``(M [K, K], S~ [K, V])``: S_out = M @ S_in + S~. Its
size does not depend on the run's length, which is what chunkwise prefill, state checkpoints and
context parallelism (KCP) exchange. Composition is associative but not commutative:
(M2, S2) after (M1, S1) = (M2 M1, M2 S1 + S2), identity (I, 0).

How a segment is summarised: one chunkwise pass
-----------------------------------------------
The recurrence is linear in (S, v) jointly. Run it over the segment with K + V value columns,
values [0 | v] and initial state [I | 0]: the state after the segment is [M I + 0 | M 0 + S~] =
[M | S~]. So one call of the chunkwise op (torch on the CPU, the Triton kernel on CUDA) gives
the exact summary, with all of the chunk path's numerical care (no positive exponent is ever
evaluated, so unbounded gates are fine), and no per-chunk Python loop.
"""

from __future__ import annotations

import torch

from hyla.ops.dispatch import chunk_delta_rule, chunk_gated_delta_rule, chunk_kda
from hyla.ops.dtypes import work_dtype

__all__ = ["segment_affine", "compose", "prefix_scan", "apply", "identity"]

Affine = tuple[torch.Tensor, torch.Tensor]  # (M [..., K, K], S~ [..., K, V])

_GATES = ("kda", "gdn", "none")


def _check_segment(k, v, g, beta, gate):
    """Validate shapes; return (B, T, H, HV, K, V)."""
    if gate not in _GATES:
        raise ValueError(f"gate must be one of {_GATES}, got {gate!r}")
    for name, t in (("k", k), ("v", v), ("beta", beta)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor")
    if k.dim() != 4:
        raise ValueError(f"k must be [B, T, H, K], got shape {tuple(k.shape)}")
    B, T, H, K = k.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % max(H, 1) != 0:
        raise ValueError(f"v must be [B={B}, T={T}, HV (a multiple of H={H}), V], got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B={B}, T={T}, HV={HV}], got {tuple(beta.shape)}")
    want = {"kda": (B, T, HV, K), "gdn": (B, T, HV), "none": None}[gate]
    if want is None:
        if g is not None:
            raise ValueError("g must be None when gate='none'")
    elif not isinstance(g, torch.Tensor) or not g.is_floating_point() or g.shape != want:
        got = tuple(g.shape) if isinstance(g, torch.Tensor) else g
        layout = "[B, T, HV, K]" if gate == "kda" else "[B, T, HV]"
        raise ValueError(f"g must be {layout} = {list(want)} for gate={gate!r}, got {got}")
    return B, T, H, HV, K, V


def identity(B: int, HV: int, K: int, V: int, *, dtype=torch.float32, device=None) -> Affine:
    """The identity map (I, 0): M [B, HV, K, K], S~ [B, HV, K, V]."""
    M = torch.eye(K, dtype=dtype, device=device).expand(B, HV, K, K).clone()
    return M, torch.zeros(B, HV, K, V, dtype=dtype, device=device)


def segment_affine(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    gate: str = "kda",
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
) -> Affine:
    """Summarise a segment as one affine map, S_out = M @ S_in + S~.

    k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H; value head hv uses key head
    hv // (HV // H)); g: [B, T, HV, K] log-decay for gate="kda", [B, T, HV] for "gdn", None for
    "none" (plain DeltaNet); beta: [B, T, HV]. With use_qk_l2norm_in_kernel, k is L2-normalised.
    Returns M: [B, HV, K, K] and S~: [B, HV, K, V] in fp32 (fp64 when k is fp64). T = 0 gives
    the identity (I, 0).
    """
    B, T, H, HV, K, V = _check_segment(k, v, g, beta, gate)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    dtype = work_dtype(k)
    if T == 0:
        return identity(B, HV, K, V, dtype=dtype, device=k.device)
    # Values [0 | v] from the state [I | 0]: the final state is [M | S~] (see the module docstring).
    v_ext = torch.cat([v.new_zeros(B, T, HV, K), v], dim=-1)  # [B, T, HV, K + V]
    eye = torch.eye(K, dtype=dtype, device=k.device).expand(B, HV, K, K)
    s0 = torch.cat([eye, eye.new_zeros(B, HV, K, V)], dim=-1)  # [B, HV, K, K + V]
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
              chunk_size=chunk_size)
    q = k  # the outputs are not used; any query of the right shape will do
    if gate == "kda":
        _, final = chunk_kda(q, k, v_ext, g, beta, **kw)
    elif gate == "gdn":
        _, final = chunk_gated_delta_rule(q, k, v_ext, g, beta, **kw)
    else:
        _, final = chunk_delta_rule(q, k, v_ext, beta, **kw)
    final = final.to(dtype)
    return final[..., :K].contiguous(), final[..., K:].contiguous()


def _check_affine(name: str, a) -> Affine:
    if not (isinstance(a, (tuple, list)) and len(a) == 2 and all(isinstance(t, torch.Tensor) for t in a)):
        raise ValueError(f"{name} must be a pair (M [..., K, K], S~ [..., K, V])")
    M, S = a
    if M.dim() < 2 or M.shape[-1] != M.shape[-2] or S.dim() != M.dim() or S.shape[:-1] != M.shape[:-1]:
        raise ValueError(
            f"{name} must be (M [..., K, K], S~ [..., K, V]), got {tuple(M.shape)}, {tuple(S.shape)}"
        )
    return M, S


def compose(first: Affine, second: Affine) -> Affine:
    """The map "apply ``first``, then ``second``": (M2 M1, M2 S1 + S2).

    first, second: (M [..., K, K], S~ [..., K, V]) with equal shapes.
    """
    M1, S1 = _check_affine("first", first)
    M2, S2 = _check_affine("second", second)
    if M1.shape != M2.shape or S1.shape != S2.shape:
        raise ValueError(
            f"second has shapes {tuple(M2.shape)}, {tuple(S2.shape)} but first has "
            f"{tuple(M1.shape)}, {tuple(S1.shape)}"
        )
    return M2 @ M1, M2 @ S1 + S2


def apply(affine: Affine, S: torch.Tensor) -> torch.Tensor:
    """M @ S + S~. affine: (M [..., K, K], S~ [..., K, V]); S: [..., K, V]."""
    M, St = _check_affine("affine", affine)
    if not isinstance(S, torch.Tensor) or S.shape != St.shape:
        got = tuple(S.shape) if isinstance(S, torch.Tensor) else S
        raise ValueError(f"S must have shape {tuple(St.shape)}, got {got}")
    return M @ S.to(M.dtype) + St


def prefix_scan(
    segments: list[Affine], initial_state: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Sequential scan of segment maps.

    segments: list of (M [..., K, K], S~ [..., K, V]); initial_state: [..., K, V] or None (zeros).
    Returns (incoming, final): incoming[i] is the state entering segment i ([..., K, V], in the
    dtype of the maps), final the state after the last one.
    """
    if not isinstance(segments, (list, tuple)):
        raise ValueError(f"segments must be a list of (M, S~) pairs, got {type(segments).__name__}")
    if len(segments) == 0:
        if initial_state is None:
            raise ValueError("segments is empty and initial_state is None: no state to return")
        return [], initial_state
    M0, S0 = _check_affine("segments[0]", segments[0])
    if initial_state is None:
        state = torch.zeros_like(S0)
    elif not isinstance(initial_state, torch.Tensor) or initial_state.shape != S0.shape:
        got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else initial_state
        raise ValueError(f"initial_state must have shape {tuple(S0.shape)}, got {got}")
    else:
        state = initial_state.to(M0.dtype)
    incoming = []
    for i, seg in enumerate(segments):
        incoming.append(state)
        state = apply(_check_affine(f"segments[{i}]", seg), state)
    return incoming, state
