"""A burst of arrivals is admitted together (hyla.server.admission): the registry, the engine
loop's wait before a step of new requests only, and the middleware that announces requests."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from hyla.engine.outputs import RequestOutput
from hyla.server import admission
from hyla.server.admission import Arrivals
from hyla.server.async_engine import AsyncEngine
from tests.server.test_structured import engine  # noqa: F401 (fixture)


def test_arrivals_pending_settle_and_stale(monkeypatch):
    arrivals = Arrivals()
    a, b = arrivals.announce(), arrivals.announce()
    assert arrivals.pending() == 2
    arrivals.settle(a)
    arrivals.settle(a)  # idempotent
    assert arrivals.pending() == 1
    assert arrivals.pending(now=time.monotonic() + admission.STALE_S) == 0  # a stale one is dropped
    arrivals.settle(b)
    assert arrivals.pending() == 0


def test_settle_current_settles_this_contexts_arrival():
    arrivals = Arrivals()

    async def handler(settle: bool):
        arrivals.announce()
        await asyncio.sleep(0)
        if settle:
            admission.settle_current()

    async def main():
        await asyncio.gather(handler(True), handler(False))

    asyncio.run(main())
    assert arrivals.pending() == 1  # the other handler's arrival is its own


class StepRecorder:
    """An engine stand-in: each step finishes every request it holds and records their ids."""

    def __init__(self):
        self.requests: dict[str, list[int]] = {}
        self.steps: list[list[str]] = []
        self.scheduler = SimpleNamespace(incoming=None)
        self.step_log = None

    def add_request(self, rid, ids, params):
        self.requests[rid] = ids

    def abort_request(self, rid):
        self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        ids, self.requests = sorted(self.requests), {}
        self.steps.append(ids)
        return [RequestOutput(r, None, [], [], finished=True) for r in ids]


def _burst(wait: float, late_by: float) -> list[list[str]]:
    """Three requests announced together; the first is submitted at once, the others `late_by`
    seconds later (their preparation) -> the engine's steps."""
    engine = StepRecorder()
    arrivals = Arrivals()
    loop_engine = AsyncEngine(engine, arrivals=arrivals, admission_wait=wait)
    loop_engine.start()

    async def request(name: str, delay: float):
        arrivals.announce()
        await asyncio.sleep(delay)
        out = loop_engine.submit(name, [1, 2], None)
        await out.get()

    async def main():
        await asyncio.gather(request("a", 0), request("b", late_by), request("c", late_by))

    try:
        asyncio.run(main())
    finally:
        loop_engine.shutdown()
    return engine.steps


def test_an_idle_engine_admits_a_burst_in_one_step():
    assert _burst(wait=0.5, late_by=0.05) == [["a", "b", "c"]]


def test_the_wait_is_bounded_and_can_be_off():
    steps = _burst(wait=0.01, late_by=0.2)  # the others come after the window: a's step runs first
    assert steps[0] == ["a"] and sorted(sum(steps, [])) == ["a", "b", "c"]
    assert _burst(wait=0, late_by=0.05)[0] == ["a"]


def test_a_lone_request_does_not_wait():
    engine = StepRecorder()
    arrivals = Arrivals()
    loop_engine = AsyncEngine(engine, arrivals=arrivals, admission_wait=5.0)
    loop_engine.start()

    async def main():
        arrivals.announce()
        start = time.monotonic()
        await loop_engine.submit("solo", [1], None).get()
        return time.monotonic() - start

    try:
        took = asyncio.run(main())
    finally:
        loop_engine.shutdown()
    assert took < 1.0 and engine.steps == [["solo"]]


def test_running_requests_never_wait_for_arrivals():
    """A step with earlier requests running is not delayed by announced ones (decode goes on)."""
    engine = StepRecorder()
    arrivals = Arrivals()
    loop_engine = AsyncEngine(engine, arrivals=arrivals, admission_wait=5.0)
    engine.requests["running"] = [1]
    arrivals.announce()  # announced and never submitted
    stepped = threading.Event()
    real_step = engine.step
    engine.step = lambda: (stepped.set(), real_step())[1]
    loop_engine.start()
    try:
        assert stepped.wait(1.0)
    finally:
        loop_engine.shutdown()


def test_the_scheduler_hears_of_incoming_requests():
    """An announced request, or a command the loop has not handled yet, is incoming: the
    scheduler then launches no step ahead (Scheduler.reserve_ahead); settled and handled, not."""
    engine = StepRecorder()
    arrivals = Arrivals()
    loop_engine = AsyncEngine(engine, arrivals=arrivals)
    incoming = engine.scheduler.incoming
    assert not incoming()
    arrival = arrivals.announce()
    assert incoming()
    arrivals.settle(arrival)
    assert not incoming()
    loop_engine.abort("nothing")  # queued for the loop (not started)
    assert incoming()
    assert not AsyncEngine(StepRecorder()).engine.scheduler.incoming()  # no arrivals registry: commands only
    assert engine.scheduler.admission_hold_s == 0.0  # the window holds new requests back as long as it waits
    assert AsyncEngine(StepRecorder(), admission_wait=0.02).engine.scheduler.admission_hold_s == 0.02


def test_negative_wait_is_refused():
    with pytest.raises(ValueError, match="admission_wait"):
        AsyncEngine(StepRecorder(), admission_wait=-1)


def test_the_server_announces_generation_requests_and_settles_them(engine):  # noqa: F811
    """Through the app: a chat request is announced on arrival and settled by the time it is
    answered, a refused one (400) too; other routes are not announced."""
    from hyla.server.api import create_app

    app = create_app(engine, "tiny")
    arrivals = app.state.server.async_engine.arrivals
    seen = []
    announce = arrivals.announce
    arrivals.announce = lambda: (seen.append(1), announce())[1]
    with TestClient(app) as http:
        ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        bad = http.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2})
        http.get("/v1/models")
        http.post("/tokenize", json={"prompt": "hi"})
    assert ok.status_code == 200 and bad.status_code == 400
    assert len(seen) == 2 and arrivals.pending() == 0


def test_the_default_window_is_on_for_cuda_only():
    """On CUDA a small prefill step is mostly fixed host time (merging a burst serves it sooner);
    on the CPU a step's time grows with its tokens (merging delays the first arrivals)."""
    import torch

    from hyla.server.admission import CUDA_WAIT_S, default_admission_wait

    assert default_admission_wait(torch.device("cuda", 0)) == CUDA_WAIT_S > 0
    assert default_admission_wait(torch.device("cpu")) == 0.0


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "soon"])
def test_admission_wait_ms_refuses_what_is_not_a_finite_time(value, capsys):
    from hyla.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--admission-wait-ms", value])
    err = capsys.readouterr().err
    assert "argument --admission-wait-ms" in err and "milliseconds" in err


def test_serve_leaves_what_startup_made_to_the_collector_no_more(monkeypatch):
    """`hyla serve` freezes the objects of startup before it serves (hyla.cli._serve): full
    collections then do not traverse them. Checked where the server would start, then thawed."""
    import gc

    import hyla.server.shutdown as shutdown
    from hyla.cli import main

    seen = {}
    monkeypatch.setattr(shutdown, "serve", lambda app, host, port, drain_s: seen.update(frozen=gc.get_freeze_count()))
    before = gc.get_freeze_count()
    try:
        main(["serve", "--port", "1"])  # the bundled model
    finally:
        gc.unfreeze()
    assert seen["frozen"] > before + 10_000  # the model's, torch's and the server's objects
