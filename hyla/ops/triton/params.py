"""Host-side argument preparation shared by the Triton chunk and recurrent wrappers."""

from __future__ import annotations

import functools

import torch


def token_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t [B, T, ...] -> (t, or a contiguous copy when its B and T dims cannot share one stride;
    the elements between its token rows b * T + t, so that row r is at r * stride)."""
    B, T = t.shape[:2]
    if B > 1 and T > 1 and t.stride(0) != T * t.stride(1):
        t = t.contiguous()
    return t, t.stride(0) if T == 1 else t.stride(1)


def _param(name: str, t, n: int, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() != n:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must have {n} elements, got {got}")
    return t.reshape(n).to(device=device, dtype=torch.float32).contiguous()


def gate_params(gate: str, use_gate_in_kernel: bool, A_log, dt_bias, lower_bound, HV: int, K: int, device):
    """The fused gate's kernel arguments: (GATE_FN, A_log [HV] fp32 | None, dt_bias fp32 | None,
    lower bound). GATE_FN 0: g is already a log-decay; 1: -exp(A_log) * softplus(g + dt_bias);
    2: lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (KDA safe gate)."""
    if not use_gate_in_kernel:
        return 0, None, None, 0.0
    if A_log is None:
        raise ValueError("`use_gate_in_kernel=True` needs `A_log`")
    a_log = _param("A_log", A_log, HV, device)
    dtb = None if dt_bias is None else _param("dt_bias", dt_bias, HV * K if gate == "kda" else HV, device)
    if gate == "kda" and lower_bound is not None:
        lb = float(lower_bound)
        if not lb < 0 or lb != lb or lb == float("-inf"):
            raise ValueError(f"lower_bound must be a finite negative float, got {lower_bound!r}")
        return 2, a_log, dtb, lb
    return 1, a_log, dtb, 0.0


@functools.lru_cache(maxsize=None)
def num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
