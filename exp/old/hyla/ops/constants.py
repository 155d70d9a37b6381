"""Constant tensors an engine step needs (aranges, index tables), made once per device and shape.

Inside a CUDA graph every `torch.arange` / `torch.zeros` is a kernel, replayed with every step;
for a tiny model a step is bound by its kernel count. The tensors here depend on shapes only, so
they are built once and read by every later step (a graph reads them as it reads its weights).

Callers must treat them as read-only. They are plain tensors (built outside inference mode), so
a gradient-recording op may save them. None is cached while a CUDA graph is being captured on
the device: a tensor built inside a capture holds nothing until the first replay. The runners
warm every graph up outside its capture first, so a capture finds its constants built; a miss
during a capture is computed in place (one kernel more, still correct).
"""

from __future__ import annotations

import torch

_CACHE: dict[tuple, torch.Tensor] = {}


def _device(device) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def constant(key: tuple, device, build) -> torch.Tensor:
    """build(device) -> a tensor, once per (key, device); key names what build makes (its shape
    arguments included)."""
    device = _device(device)
    hit = _CACHE.get((key, device))
    if hit is not None:
        return hit
    with torch.inference_mode(False):
        t = build(device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _CACHE[(key, device)] = t
    return t


def arange(n: int, device, step: int = 1) -> torch.Tensor:
    """[0, step, .., (n - 1) * step] int64 on device (step W: the cu_seqlens of rows of W tokens)."""
    return constant(("arange", n, step), device, lambda d: torch.arange(n, device=d) * step)


def full(shape: tuple[int, ...], value: int, device) -> torch.Tensor:
    """torch.full(shape, value) int64 on device (e.g. a head step's unused state slots)."""
    shape = tuple(shape)
    return constant(("full", shape, value), device, lambda d: torch.full(shape, value, dtype=torch.long, device=d))
