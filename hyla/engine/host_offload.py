"""Device -> host copies of the prefix cache's host tier, on a side stream (CUDA).

An eviction to the host tier moves a checkpoint (~42 MB on the Kimi-Linear-48B shape) or a batch
of KV pages over PCIe. Run on the compute stream, the step's forward waited for every such copy:
on the H200 host-tier round (BENCHMARKS.md "Prefix cache tiers") evictions moved 86 GB there. Here
each source is first copied on the compute stream into a fresh device buffer, at device memory
bandwidth (tens of times PCIe's), so the slot or page it came from may be reused at once, later in
the plan or in the forward, exactly as the prefix cache plans (it frees an index as soon as its
copy is planned); the buffer's copy to pinned host memory runs on a side stream, overlapped with
the forward, and the caching allocator keeps the buffer until that copy has finished
(`record_stream`).

Ordering, the only rules this module adds:
- the side stream waits for the compute stream before each batch of copies: the buffers are
  written there, and a host entry about to be overwritten may still be read by a restore queued
  there earlier;
- a restore (a host -> device copy, on the compute stream) first makes the compute stream wait for
  the side stream's last batch (`fence`): the host entry it reads may have been written there; by
  then that copy has almost always completed, and the wait costs nothing;
- at most `budget` bytes of buffers are in flight; a copy beyond that goes to the host directly on
  the compute stream, after a fence (two writes to one host entry stay in plan order).
On the CPU, or with a budget of 0, every copy is direct and synchronous with the host.
"""

from __future__ import annotations

from collections import deque

import torch

STAGING_BYTES = 512 << 20  # device bytes of buffers in flight to the host (~12 checkpoints of the 48B shape)


class DeviceToHost:
    """Copies device tensors into pinned host tensors through buffers and a side stream (module
    docstring). `copy` queues a copy, `flush` starts the queued ones, `fence` orders the compute
    stream after everything started."""

    def __init__(self, device: torch.device, budget_bytes: int = STAGING_BYTES):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and budget_bytes > 0 else None
        self.budget = budget_bytes
        self._queued: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host view, device buffer)
        self._queued_bytes = 0
        self._in_flight: deque[tuple[torch.cuda.Event, int]] = deque()  # (event after a batch, its bytes)
        self._in_flight_bytes = 0
        self._last: torch.cuda.Event | None = None  # the last batch's event
        self.direct_bytes = 0  # bytes copied on the compute stream for want of buffer room

    def copy(self, host: torch.Tensor, source: torch.Tensor, owned: bool = False) -> None:
        """host <- source (same shape and dtype). source: a device tensor; `owned` when it is a
        temporary nothing else writes (a gather's or a quantisation's result), used as the buffer
        itself; else a view of a pool, copied into a buffer first."""
        nbytes = source.numel() * source.element_size()
        if self.stream is None or not self._room(nbytes):
            if self.stream is not None:
                self.fence()
                self.direct_bytes += nbytes
            host.copy_(source, non_blocking=True)
            return
        self._queued.append((host, source if owned else source.clone()))
        self._queued_bytes += nbytes

    def flush(self) -> None:
        """Start the queued copies on the side stream, after the compute stream's work so far."""
        if not self._queued:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            for host, buffer in self._queued:
                host.copy_(buffer, non_blocking=True)
                buffer.record_stream(self.stream)  # the allocator reuses it only after this copy
            event = torch.cuda.Event()
            event.record(self.stream)
        self._in_flight.append((event, self._queued_bytes))
        self._in_flight_bytes += self._queued_bytes
        self._last = event
        self._queued, self._queued_bytes = [], 0

    def fence(self) -> None:
        """Make the compute stream's later work wait for every copy queued or started so far."""
        if self.stream is None:
            return
        self.flush()
        if self._last is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self._last)

    def _room(self, nbytes: int) -> bool:
        while self._in_flight and self._in_flight[0][0].query():  # completed batches give their room back
            self._in_flight_bytes -= self._in_flight.popleft()[1]
        return self._in_flight_bytes + self._queued_bytes + nbytes <= self.budget
