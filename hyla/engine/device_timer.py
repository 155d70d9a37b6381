"""Seconds of device work, measured without making the host wait for the device.

On CUDA a block of work is bracketed by two timing events recorded on the current stream; their
elapsed time is added once both completed (read later, never waited for: a block still in flight
counts at a later read). On the CPU the work is synchronous and its wall time is it. Blocks run
while a CUDA graph is being captured are not timed (an event would join the graph).
"""

from __future__ import annotations

import contextlib
import time

import torch


FOLD_AT = 64  # pending event pairs that make `measure` fold the completed ones itself


class DeviceTimer:
    """Adds up the device time of the blocks run under `measure()` (module docstring)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._seconds = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._spare: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # folded pairs, recorded again

    @contextlib.contextmanager
    def measure(self):
        if self.cuda and torch.cuda.is_current_stream_capturing():
            yield
        elif self.cuda:
            start, end = self._spare.pop() if self._spare else (torch.cuda.Event(enable_timing=True),
                                                                 torch.cuda.Event(enable_timing=True))
            start.record()
            yield
            end.record()
            self._pending.append((start, end))
            if len(self._pending) >= FOLD_AT:  # unread for a while (no metrics scrape): fold the completed
                self._fold()
        else:
            began = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - began

    @property
    def seconds(self) -> float:
        """The blocks' seconds so far (on CUDA those whose events completed)."""
        self._fold()
        return self._seconds

    def _fold(self) -> None:
        """Add the completed blocks' time and keep their events for reuse (a step's timing then
        creates none; a timer nobody reads holds at most FOLD_AT pairs, not one per step)."""
        pending = []
        for start, end in self._pending:
            if end.query():
                self._seconds += start.elapsed_time(end) / 1e3
                self._spare.append((start, end))
            else:
                pending.append((start, end))
        self._pending = pending
