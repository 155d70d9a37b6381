"""Host -> device transfers of an engine step's small integer tensors, without stalling the GPU.

A step's metadata (token ids, positions, cu_seqlens, block tables, slots) starts as python lists.
Two costs matter at prefill sizes (8K tokens): building a tensor from a list element by element
(`torch.tensor(list)` ~1 ms for 8K ints; `array.array` + `torch.frombuffer` ~0.15 ms), and each
separate copy (a launch and, from pageable memory, a staging copy). `stage_long` packs all the
pieces into one pinned buffer and copies it with one asynchronous transfer: the host goes on
launching kernels while the copy runs, and the caching host allocator keeps the pinned block
alive until the copy has finished.
"""

from __future__ import annotations

import array

import torch


def long_tensor(values) -> torch.Tensor:
    """A CPU int64 tensor from a python sequence of ints, or of equal-length rows of ints ([N, W]),
    or a tensor (returned as int64)."""
    if isinstance(values, torch.Tensor):
        return values.to(dtype=torch.long)
    values = list(values)
    if values and isinstance(values[0], (list, tuple)):
        width = len(values[0])
        if any(len(row) != width for row in values):
            raise ValueError("rows of an index table must have equal lengths")
        return long_tensor([v for row in values for v in row]).reshape(len(values), width)
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


def stage_long(pieces: list, device, dtype: torch.dtype = torch.long) -> list[torch.Tensor]:
    """Device tensors of `pieces` (python int lists or CPU tensors of any shape), copied in one
    transfer: each result is a view of one `dtype` (int64 or int32) device buffer, in the
    pieces' shapes, starting on a 16-byte boundary. Triton compiles a kernel once per pointer
    alignment it is given: packed back to back, a piece's alignment followed the lengths of the
    pieces before it, so new batch sizes kept compiling new variants while a server ran
    (scripts/triton_variants.py)."""
    device = torch.device("cpu" if device is None else device)
    host = [long_tensor(p) for p in pieces]
    per_16 = 16 // dtype.itemsize  # elements in 16 bytes
    offsets, at = [], 0
    for t in host:
        offsets.append(at)
        at += -(-t.numel() // per_16) * per_16
    pinned = device.type == "cuda"
    buf = torch.empty(at, dtype=dtype, pin_memory=pinned)
    for o, t in zip(offsets, host):
        buf[o:o + t.numel()] = t.reshape(-1)
    dev = buf.to(device, non_blocking=pinned) if device.type != "cpu" else buf
    return [dev[o:o + t.numel()].view(t.shape) for o, t in zip(offsets, host)]


def to_device_long(values, device) -> torch.Tensor:
    """One int64 tensor on `device` from a python list, through a pinned buffer (no stall)."""
    return stage_long([values], device)[0]


def fill_long(dst: torch.Tensor, values) -> None:
    """Copy python ints ([n] or equal rows [n, w]) into the existing int64 tensor dst (a CUDA
    graph's input buffer) without stalling the host: from pinned memory, asynchronously. (A copy
    from pageable memory synchronises the stream: the host would wait for every kernel queued
    before it, e.g. the previous replay.) The caching host allocator keeps the pinned block until
    the copy has run."""
    host = long_tensor(values)
    if dst.device.type == "cuda":
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)
