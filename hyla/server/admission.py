"""Requests on their way to the engine: a burst that arrives together is admitted together.

A generation request spends a few milliseconds between its arrival and `AsyncEngine.submit`
(reading the body, rendering the chat template, tokenising: `asyncio.to_thread`, hyla.server.api).
When several arrive together -- agent sessions whose turns all end in one step and come straight
back, a client that fans a batch out -- an idle engine would start a prefill step with the first
one alone, and every other one would wait for that step to end (on the 48B shape, a lone turn of
549 new tokens took 86-146 ms: BENCHMARKS "The 48B shape served"). So the server announces each
generation request when it arrives (`ArrivalMiddleware`) and settles it when the request is
submitted, or answered without being submitted; an engine that is about to start a step with only
new requests waits up to its admission window for the announced ones still being prepared
(`Arrivals.pending`). With requests running the engine never waits: its steps go on decoding, and
the waiting requests are admitted once none is announced any more, at most the window after the
first of them arrived (`Scheduler._holding_admission`), so that a burst shares one prefill step
there too. A lone request is never delayed: nothing else is announced.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import time

# The generation routes whose requests are announced (POST only).
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})
# The admission window by device (hyla serve --admission-wait-ms): on CUDA a small prefill step costs
# mostly fixed host time (a lone 549-token turn: 86-146 ms served, beside ~175 ms of kernels for
# the 14 turns after it), so one merged step serves a burst sooner; on the CPU a step's time grows
# with its tokens, and a merged step makes the first arrivals wait for the last (tiny model, 6
# lockstep agent sessions: returning turns 472-504 -> 577-613 ms), so there it is off.
CUDA_WAIT_S = 0.02


def default_admission_wait(device) -> float:
    """The admission window in seconds for an engine on `device` (a torch.device)."""
    return CUDA_WAIT_S if device.type == "cuda" else 0.0


# An announcement older than this is not waited for: its request is slow to prepare (a huge
# prompt) or was lost before it settled; either way no step should wait on it again.
STALE_S = 2.0

_current: contextvars.ContextVar[tuple[Arrivals, int] | None] = contextvars.ContextVar("hyla_arrival", default=None)


class Arrivals:
    """The generation requests announced and not yet settled (thread-safe: the event loop
    announces and settles, the engine's loop thread asks what is pending)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, float] = {}  # arrival -> time.monotonic() of its announcement
        self._ids = itertools.count()

    def announce(self) -> int:
        """A request has arrived: -> its arrival id, also made the current one of this context
        (`settle_current` in the same request's handler settles it)."""
        arrival = next(self._ids)
        with self._lock:
            self._open[arrival] = time.monotonic()
        _current.set((self, arrival))
        return arrival

    def settle(self, arrival: int) -> None:
        """The request was submitted, or answered without reaching the engine (idempotent)."""
        with self._lock:
            self._open.pop(arrival, None)

    def pending(self, now: float | None = None) -> int:
        """How many announced requests are still being prepared (announced < STALE_S ago)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for arrival in [a for a, t in self._open.items() if now - t >= STALE_S]:
                del self._open[arrival]  # stale: never waited for again
            return len(self._open)


def settle_current() -> None:
    """Settle the arrival of the request whose handler is running (no-op when there is none)."""
    current = _current.get()
    if current is not None:
        current[0].settle(current[1])


class ArrivalMiddleware:
    """Announces every POST to a generation route on arrival and settles it when the request's
    exchange ends, if its handler did not settle it earlier (at submit: AsyncEngine.submit). A
    plain ASGI middleware, as hyla.server.api's API-key check (it leaves `receive` alone)."""

    def __init__(self, app, arrivals: Arrivals):
        self.app = app
        self.arrivals = arrivals

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        arrival = self.arrivals.announce()
        try:
            await self.app(scope, receive, send)
        finally:
            self.arrivals.settle(arrival)
