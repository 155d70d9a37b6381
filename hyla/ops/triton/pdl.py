"""Programmatic dependent launch (Hopper and later) for the small kernels of a decode step.

A decode step at batch 1 replays a CUDA graph of some 13 kernels a layer (a KDA + MoE layer of
the 48B shape), most of them a few microseconds long, so the gap between one kernel's end and the next one's first instruction is
a large part of the step (BENCHMARKS.md, the 48B decode table: 2.1x its memory floor at batch 1).
With programmatic dependent launch the next kernel is launched while the current one still runs:
its blocks are scheduled and wait at `griddepcontrol.wait` until the kernel before it has
completed and its writes are visible, so only the launch latency overlaps, never a read or a
write. A kernel opts in by calling `dependent_launch_prologue(PDL)` first, before touching any
global memory, and by being launched with `**pdl_launch(device)`; a kernel that does not opt in
(cuBLAS, torch's own) is launched as before and waits for its predecessor in full.

On for CUDA devices of compute capability 9.0 and later (BENCHMARKS.md "Launches of a batch-1
decode step": with the decode-path fusions, the 48B shape's batch-1 step 4.6% shorter on an H100,
half of it from this); the interpreter and the CPU never use it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Tests switch it off to compare outputs with and without (tests/gpu/test_pdl.py).
_ENABLED = True


@triton.jit
def dependent_launch_prologue(PDL: tl.constexpr):
    """The first statement of a kernel launched with `pdl_launch`: wait until the kernel before
    it has completed (its writes visible), then let the kernel after it be launched."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _supported(device_index: int) -> bool:
    """An NVIDIA GPU of compute capability >= 9.0 (a ROCm build also says "cuda", and its
    capability numbers are not NVIDIA's), outside Triton's interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Launch keyword arguments of an opted-in kernel on `device`: {"PDL": True, "launch_pdl":
    True} where programmatic dependent launch is on (module docstring), else {"PDL": False}."""
    if _ENABLED and device.type == "cuda" and _supported(device.index if device.index is not None
                                                           else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
