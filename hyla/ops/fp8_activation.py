"""An activation tensor that carries its block-FP8 form, so that the FP8 GEMM or fused MoE it feeds
does not launch the activation quantiser.

Why: with block-FP8 weights each projection quantises its input per token and group of 128
columns (hyla.ops.fp8.per_token_group_quant) in a launch of its own before the GEMM. The kernel
that produced that input (an RMSNorm, a gated output norm, the SwiGLU activation: the Triton
producers of hyla.ops.triton.norm / gated_act, asked through hyla.ops.dispatch) can write the e4m3
codes and group scales in the same pass, from exactly the values it stores, and attach them here;
the consumers (hyla.ops.triton.fp8_gemm, hyla.ops.triton.fused_moe_fp8) look them up instead of
quantising. Bit for bit the same codes and scales either way (the producers run the quantiser's own
`quantize_rows` arithmetic on their stored output re-read as fp32).

The carried form is layout-free: for a contiguous tensor whose rows are whole groups (last dim a
multiple of 128), per-token groups are the tensor's consecutive 128-element chunks, whatever its
shape. So a producer's [T, H, 128] output serves o_proj's `y.flatten(-2)` [T, H * 128] (a
different Python object, a view of it) as well as the [T * H, 128] rows it was quantised as; the
lookup goes through the view's `_base` to the producer's tensor.

Safety: a lookup serves the form only to a contiguous view covering exactly the attached memory
(same data_ptr, element count, dtype and device) whose version counter has not moved since the
attach (an in-place change misses). A miss quantises as before. Inference tensors keep no version
counter, so they carry nothing: a producer's output from `producer_buffers` is a normal tensor,
also under torch.inference_mode.

Only producers attach (`carry_produced`): the launch that writes the values writes the codes, into
its own fresh output, so whatever rewrites that memory later (a CUDA-graph replay of the same
launch) rewrites both, and the form is served anywhere, also while a graph is captured. A consumer
that had to quantise its input keeps the result to itself: that input may be memory a graph replay
or a Triton kernel rewrites without moving the version counter (the prefill graphs' static span
buffers, which the eager cores read between replays), where a kept form would go stale.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hyla.ops.fp8_checks import BLOCK, FP8_DTYPE

__all__ = ["producer_buffers", "carry_produced", "lookup"]

_ATTR = "_hyla_fp8"  # the attribute on the producer's (base) tensor


class _Form(NamedTuple):
    q: torch.Tensor  # [N] e4m3 codes of the N carried elements, in memory order
    s: torch.Tensor  # [N / 128] fp32 scales, one per consecutive 128-element group
    data_ptr: int  # the carried region: start, element count, dtype and device of the tensor attached to
    numel: int
    dtype: torch.dtype
    device: torch.device
    version: int  # its version counter at the attach


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor every view of t shares: its `_base` (views of views point to the first one)."""
    return t if t._base is None else t._base


def _may_carry(t: torch.Tensor) -> bool:
    """Contiguous, whole 128-column groups per row, and a version counter (not an inference tensor)."""
    return (t.dim() >= 1 and t.numel() > 0 and t.shape[-1] % BLOCK == 0 and t.is_contiguous()
            and not t.is_inference())


def producer_buffers(rows: int, cols: int, dtype: torch.dtype, device: torch.device,
                     fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The buffers of a producer kernel's output y [rows, cols]: (y, codes [rows, cols] e4m3, scales
    [rows, cols / 128] fp32) when fp8 is asked and cols is whole groups of 128 (y then a normal
    tensor, with a version counter, also under torch.inference_mode, where torch.empty makes
    inference tensors); else (y, None, None), y as torch.empty makes it."""
    if not (fp8 and cols % BLOCK == 0):
        return torch.empty(rows, cols, dtype=dtype, device=device), None, None
    with torch.inference_mode(False):
        y = torch.empty(rows, cols, dtype=dtype, device=device)
    return (y, torch.empty(rows, cols, dtype=FP8_DTYPE, device=device),
            torch.empty(rows, cols // BLOCK, dtype=torch.float32, device=device))


def carry_produced(y: torch.Tensor, q: torch.Tensor | None, s: torch.Tensor | None) -> torch.Tensor:
    """y (a view of `producer_buffers`' y), carrying the codes and scales q, s the same launch wrote
    (nothing when they are None) -> y."""
    if q is not None:
        _attach(y, q, s)
    return y


def _attach(t: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """Record (q, s), t's block-FP8 form (q: t's elements as e4m3 codes, s one fp32 scale per 128
    of them, both contiguous, in per_token_group_quant's layout), on t's owner for `lookup`."""
    if not _may_carry(t):
        return
    n = t.numel()
    if (q.dtype != FP8_DTYPE or s.dtype != torch.float32 or q.numel() != n or s.numel() * BLOCK != n
            or not (q.is_contiguous() and s.is_contiguous()) or q.device != t.device or s.device != t.device):
        raise ValueError(f"an FP8 form of a {tuple(t.shape)} tensor needs e4m3 codes of its {n} elements and "
                         f"{n // BLOCK} fp32 group scales on {t.device}, got {tuple(q.shape)} {q.dtype}, "
                         f"{tuple(s.shape)} {s.dtype}")
    setattr(_owner(t), _ATTR, _Form(q.view(-1), s.view(-1), t.data_ptr(), n, t.dtype, t.device, t._version))


def lookup(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The attached FP8 form of x [..., K] as the 2-D input a consumer sees: (q [M, K] e4m3,
    s [M, K / 128] fp32) with M = x.numel() / K, bit for bit per_token_group_quant(x.reshape(M, K));
    None when x carries none, is not a contiguous view of exactly the attached tensor, or changed
    in place since."""
    if not _may_carry(x):
        return None
    form = getattr(_owner(x), _ATTR, None)
    if (form is None or x.data_ptr() != form.data_ptr or x.numel() != form.numel or x.dtype != form.dtype
            or x.device != form.device or x._version != form.version):
        return None
    K = x.shape[-1]
    return form.q.view(-1, K), form.s.view(-1, K // BLOCK)
