"""AsyncEngine: runs one LLMEngine in a background thread and streams its outputs to asyncio.

The engine is not thread-safe, so only the loop thread touches it: HTTP handlers send commands
(add / abort) through a queue, and the loop hands every RequestOutput back to the handler's
asyncio queue: a step's outputs in one `call_soon_threadsafe` per event loop (each call wakes
the loop through a write to its self-pipe: one per output took a tenth of the loop thread's time
at 256 running requests). Validation (`encode` / `validate`) is read-only and
runs for the handler in a worker thread (off the event loop), so a bad request is answered before
it reaches the loop thread.

Shutdown: `stop_all` (at the end of the server's drain, hyla.server.shutdown) aborts every
request and hands each handler a `Shutdown` in place of its next output, as it does to any
request submitted after; the handlers answer 503 (or end their stream with an error event).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hyla.engine.llm_engine import LLMEngine
from hyla.engine.outputs import RequestOutput
from hyla.engine.sampling_params import SamplingParams
from hyla.server.admission import Arrivals, settle_current

log = logging.getLogger("hyla.server")


@dataclass(frozen=True)
class Shutdown:
    """Delivered in place of a request's output when the server stops it (`stop_all`)."""

    request_id: str


UNREAD_OUTPUTS = 16  # unread outputs an OutputQueue holds before a new one replaces its request's last


class OutputQueue(asyncio.Queue):
    """The outputs of one HTTP request's engine requests, on their way to its handler.

    An output is cumulative (its text and token ids so far), so a later one of the same request
    says everything an unread earlier one does. While the handler lags -- a slow or stalled client
    whose writes wait on the socket -- the engine still produces one output per step: once
    UNREAD_OUTPUTS are waiting, a new output replaces its request's last unread one unless that
    one ended the request. The handler then streams the skipped tokens in one chunk, and the
    memory a stalled stream holds stays bounded (each output copies the token ids so far: a 32K-
    token generation to a client that reads nothing would otherwise hold ~500M of them)."""

    def _put(self, item) -> None:
        pending = self._queue
        if len(pending) >= UNREAD_OUTPUTS and isinstance(item, RequestOutput):
            for i in range(len(pending) - 1, -1, -1):
                old = pending[i]
                if isinstance(old, RequestOutput) and old.request_id == item.request_id:
                    if not old.finished:
                        del pending[i]  # superseded by `item`
                    break
        pending.append(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_output: Callable[[RequestOutput, float], None] | None = None,
                 on_abort: Callable[[str], None] | None = None, arrivals: Arrivals | None = None,
                 admission_wait: float = 0.0):
        """arrivals: the server's announced requests (hyla.server.admission); when the engine is
        about to start a step with nothing running, it waits up to `admission_wait` seconds for
        those still being prepared, so that a burst shares its first step (0: never waits)."""
        if admission_wait < 0:
            raise ValueError(f"admission_wait must be >= 0 seconds, got {admission_wait}")
        self.engine = engine
        self.on_output = on_output  # on_output(output: RequestOutput, now: time.monotonic()) in the loop thread
        self.on_abort = on_abort  # on_abort(request_id) in the loop thread: it ends with no finished output
        self.arrivals = arrivals
        self.admission_wait = admission_wait
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputQueue]] = {}
        self._stop = threading.Event()
        self._stopping = False  # stop_all ran: every request is answered with a Shutdown
        self._thread: threading.Thread | None = None
        # while a request is on its way no engine step is launched ahead of the one running, and
        # with requests running the waiting ones are admitted together with it (up to the window)
        engine.scheduler.incoming = self._incoming
        engine.scheduler.admission_hold_s = admission_wait

    def start(self) -> None:
        """Start the loop thread; again after a shutdown too (an app whose lifespan runs twice,
        as an in-process test client does per session)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="hyla-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               out: OutputQueue | None = None) -> OutputQueue:
        """Queue a validated request; returns the queue its outputs arrive on (the last one has
        .finished set): `out` when given, so that several requests (the n choices of one HTTP
        request) share one queue, told apart by RequestOutput.request_id."""
        out = out if out is not None else OutputQueue()
        self._streams[request_id] = (asyncio.get_running_loop(), out)
        self._commands.put(("add", request_id, prompt_ids, params, time.perf_counter()))
        settle_current()  # after the put: the engine, if waiting for it, finds its command queued
        return out

    def abort(self, request_id: str) -> None:
        """Abort (e.g. the client went away): frees its slot and pages at the next loop turn."""
        self._commands.put(("abort", request_id))

    def stop_all(self) -> None:
        """Stop serving (any thread): at the next loop turn every request is aborted and its
        handler gets a Shutdown, as does every request submitted from then on."""
        self._commands.put(("stop_all",))

    # ---- loop thread ---------------------------------------------------------------------------
    def _deliver(self, request_id: str, output: RequestOutput | Shutdown) -> None:
        self._deliver_all([(request_id, output)])

    def _deliver_all(self, outputs: list[tuple[str, RequestOutput | Shutdown]]) -> None:
        """Hand each output to its request's queue: one call into each event loop for them all."""
        per_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, output in outputs:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            loop, q = stream
            if isinstance(output, Shutdown) or output.finished:
                self._streams.pop(request_id, None)
            per_loop.setdefault(loop, []).append((q, output))
        for loop, items in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the handler's event loop is gone
                pass

    def _handle(self, command) -> None:
        kind = command[0]
        if kind == "add":
            _, rid, ids, params, submitted = command
            if self._stopping:
                self._deliver(rid, Shutdown(rid))
                return
            try:
                self.engine.add_request(rid, ids, params)
            except ValueError as e:
                self._deliver(rid, RequestOutput(rid, None, ids, [], finished=True, error=str(e)))
                return
            if self.engine.step_log is not None:
                self.engine.step_log.arrival(rid, submitted)
        elif kind == "abort":
            rid = command[1]
            self.engine.abort_request(rid)
            self._streams.pop(rid, None)
            self._aborted(rid)
        elif kind == "stop_all":
            self._stopping = True
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
                self._aborted(rid)
            for rid in list(self._streams):
                self._deliver(rid, Shutdown(rid))

    def _admit_arrivals(self) -> None:
        """Handle commands while announced requests are still being prepared, up to the
        admission window (the loop thread, before a step that runs no earlier request)."""
        if self.arrivals is None or self.admission_wait <= 0:
            return
        deadline = time.monotonic() + self.admission_wait
        while self.arrivals.pending() and not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:  # a short poll: a request refused before submit settles without a command
                self._handle(self._commands.get(timeout=min(remaining, 0.002)))
            except queue.Empty:
                pass
        try:  # a request settles after its command is queued: what settled last is queued by now
            while True:
                self._handle(self._commands.get_nowait())
        except queue.Empty:
            pass

    def _incoming(self) -> bool:
        """Whether a command waits for the loop (a request submitted, an abort) or an announced
        request is still being prepared (any thread)."""
        return not self._commands.empty() or (self.arrivals is not None and self.arrivals.pending() > 0)

    def _aborted(self, request_id: str) -> None:
        if self.on_abort is not None:
            self.on_abort(request_id)

    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished_requests()
            try:
                command = self._commands.get(timeout=0.05) if idle else self._commands.get_nowait()
                self._handle(command)
                while True:
                    self._handle(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished_requests():
                continue
            if idle:  # a step of new requests only: let the rest of their burst join it
                self._admit_arrivals()
            try:
                outputs = self.engine.step()
            except Exception:  # noqa: BLE001 - a failure must not stop the loop thread
                log.exception("engine step failed")
                continue
            now = time.monotonic()
            if self.on_output is not None:
                for out in outputs:
                    self.on_output(out, now)
            self._deliver_all([(out.request_id, out) for out in outputs])


def _put_all(items: list[tuple[OutputQueue, RequestOutput | Shutdown]]) -> None:
    for q, output in items:
        q.put_nowait(output)
