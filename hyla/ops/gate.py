"""Forget-gate activations: raw projections -> log-decay g (<= 0), computed in fp32.

KDA (per channel):
    v1 (Kimi-Linear, lower_bound None): g = -exp(A_log) * softplus(f + dt_bias)   in (-inf, 0]
    v2 (safe gate):                     g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
                                                                                   in (lower_bound, 0)
GDN (per head):                         g = -exp(A_log) * softplus(a + dt_bias)

A_log has one value per head; dt_bias one per channel (KDA, H*K) or per head (GDN, HV). The
checkpoint shapes ([1, 1, H, 1], [H * K], ...) are accepted as long as the element count fits.
The result is fp32 (fp64 when the main input is fp64, so exactness tests can stay in fp64).

kda_gate_beta / gdn_gate_beta also return the write strength beta = sigmoid(b) (in b's dtype):
the pair a decode step needs, which hyla.ops.triton.gate computes in one launch.
gdn_projected_gate_beta takes GDN's b and a as their projections of the layer input (a
checkpoint keeping them in the model dtype beside FP8 projections: one kernel for the GEMV and
the gate at a decode step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyla.ops.dtypes import check_lower_bound, check_up_projection, work_dtype

__all__ = ["kda_gate", "gdn_gate", "kda_gate_beta", "gdn_gate_beta", "gdn_projected_gate_beta"]


def _per_head(name: str, t: torch.Tensor, n: int, shape: tuple[int, ...], dtype) -> torch.Tensor:
    """Reshape a parameter with exactly ``n`` elements to ``shape`` (for broadcasting)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.numel() != n:
        raise ValueError(f"{name} must have {n} elements, got shape {tuple(t.shape)}")
    return t.reshape(shape).to(dtype)


def _check_input(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor {layout}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA log-decay per channel.

    f: [B, T, H, K] raw forget-gate pre-activation; A_log: H elements; dt_bias: H*K elements or
    None; lower_bound: None for gate v1, a negative float for gate v2.
    Returns g: [B, T, H, K] in fp32 (fp64 if f is fp64).
    """
    _check_input("f", f, 4, "[B, T, H, K]")
    _, _, H, K = f.shape
    dtype = work_dtype(f)
    x = f.to(dtype)
    if dt_bias is not None:
        x = x + _per_head("dt_bias", dt_bias, H * K, (H, K), dtype)
    a = _per_head("A_log", A_log, H, (H, 1), dtype).exp()
    if lower_bound is None:
        return -a * F.softplus(x)
    lb = check_lower_bound(lower_bound)
    return lb * torch.sigmoid(a * x)


def gdn_gate(
    a: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated DeltaNet log-decay per head.

    a: [B, T, HV] raw gate pre-activation; A_log: HV elements; dt_bias: HV elements or None.
    Returns g: [B, T, HV] in fp32 (fp64 if a is fp64).
    """
    _check_input("a", a, 3, "[B, T, HV]")
    HV = a.shape[-1]
    dtype = work_dtype(a)
    x = a.to(dtype)
    if dt_bias is not None:
        x = x + _per_head("dt_bias", dt_bias, HV, (HV,), dtype)
    return -_per_head("A_log", A_log, HV, (HV,), dtype).exp() * F.softplus(x)


def kda_gate_beta(f: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None,
                  lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kda_gate(f, A_log, dt_bias, lower_bound), sigmoid(b)). f: [B, T, H, K]; b: [B, T, H]."""
    return kda_gate(f, A_log, dt_bias, lower_bound), torch.sigmoid(b)


def kda_lowrank_gate_beta(fa: torch.Tensor, w_up: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                          dt_bias: torch.Tensor | None = None,
                          lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kda_gate_beta of f = fa @ w_up^T, the forget gate's low-rank up-projection (KDA's f_b_proj,
    its output in fa's dtype as the linear gives it). fa: [B, T, r]; w_up: [H * K, r]; b: [B, T, H]."""
    _check_input("b", b, 3, "[B, T, H]")
    check_up_projection("kda_lowrank_gate_beta", fa, w_up, b.shape[2], w_up.shape[0] // max(b.shape[2], 1))
    f = F.linear(fa, w_up).unflatten(-1, (b.shape[2], -1))
    return kda_gate_beta(f, b, A_log, dt_bias, lower_bound)


def gdn_gate_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gdn_gate(a, A_log, dt_bias), sigmoid(b)), both [B, T, HV]. a, b: [B, T, HV], or
    [B, T, H, r] views (value head h * r + i), as GDN's in_proj_ba gives them."""
    if a.dim() == 4:
        a = a.flatten(-2)
    if b.dim() == 4:
        b = b.flatten(-2)
    return gdn_gate(a, A_log, dt_bias), torch.sigmoid(b)


def gdn_projected_gate_beta(x: torch.Tensor, w_b: torch.Tensor, w_a: torch.Tensor, A_log: torch.Tensor,
                            dt_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gdn_gate_beta of b = x @ w_b^T and a = x @ w_a^T, each in the linear's output dtype (x's),
    as the projections' own GEMM hands them to the gate.

    x: [B, T, hidden]; w_b, w_a: [HV, hidden], or [H, r, hidden] row views (value head h * r + i:
    the b and a rows of Qwen3-Next's head-interleaved in_proj_ba weight), in x's dtype.
    Returns (g fp32 [B, T, HV], beta [B, T, HV] in x's dtype)."""
    _check_value_head_weights("gdn_projected_gate_beta", x, w_b, w_a)
    b = F.linear(x, w_b.flatten(0, -2))
    a = F.linear(x, w_a.flatten(0, -2))
    return gdn_gate_beta(a, b, A_log, dt_bias)


def _check_value_head_weights(name: str, x: torch.Tensor, w_b: torch.Tensor, w_a: torch.Tensor) -> None:
    """GDN's b and a projection arguments: x a floating-point [B, T, hidden], w_b and w_a
    [HV, hidden] or [H, r, hidden] with as many value heads each; ValueError naming `name` otherwise."""
    _check_input("x", x, 3, "[B, T, hidden]")
    for w_name, w in (("w_b", w_b), ("w_a", w_a)):
        if (not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() not in (2, 3)
                or w.shape[-1] != x.shape[-1]):
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"{name}: {w_name} must be a floating-point tensor [HV, {x.shape[-1]}] or "
                             f"[H, r, {x.shape[-1]}], got {got}")
    if w_b.shape[:-1].numel() != w_a.shape[:-1].numel():
        raise ValueError(f"{name}: w_b and w_a must hold one row per value head each, got {tuple(w_b.shape)} "
                         f"and {tuple(w_a.shape)}")
