"""hyla.server.async_engine.OutputQueue: a lagging handler's unread outputs stay bounded (a new
cumulative output replaces its request's last unread one past UNREAD_OUTPUTS), a finishing output
is never replaced, other requests' outputs and non-output items keep their order."""

import asyncio

from hyla.engine.outputs import CompletionOutput, RequestOutput
from hyla.server import async_engine
from hyla.server.async_engine import OutputQueue, Shutdown


def _out(rid: str, n: int, finished: bool = False) -> RequestOutput:
    c = CompletionOutput(0, "x" * n, list(range(n)), None, "stop" if finished else None)
    return RequestOutput(rid, None, [1, 2], [c], finished=finished)


def _drain(q: OutputQueue) -> list:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


def test_a_stalled_reader_holds_a_bounded_backlog_that_ends_with_every_request_final():
    async def run():
        q = OutputQueue()
        for n in range(1, 1001):  # two choices of one HTTP request, one output per step each
            q.put_nowait(_out("a", n))
            q.put_nowait(_out("b", n, finished=n == 1000))
        q.put_nowait(_out("a", 1001, finished=True))
        assert q.qsize() <= async_engine.UNREAD_OUTPUTS + 2
        return _drain(q)
    items = asyncio.run(run())
    for rid, last in (("a", 1001), ("b", 1000)):
        mine = [o for o in items if o.request_id == rid]
        lengths = [len(o.outputs[0].token_ids) for o in mine]
        assert lengths == sorted(lengths) and lengths[0] == 1 and lengths[-1] == last  # in order, the latest kept
        assert mine[-1].finished and sum(o.finished for o in mine) == 1


def test_below_the_backlog_every_output_arrives_and_finals_are_kept():
    async def run():
        q = OutputQueue()
        for n in range(1, async_engine.UNREAD_OUTPUTS):
            q.put_nowait(_out("a", n))
        first = [len(o.outputs[0].token_ids) for o in _drain(q)]
        for _ in range(async_engine.UNREAD_OUTPUTS):  # a full backlog of other items
            q.put_nowait(Shutdown("x"))
        q.put_nowait(_out("a", 5, finished=True))
        q.put_nowait(_out("a", 6))  # (an engine never sends one after a final: the final stays)
        return first, _drain(q)
    first, rest = asyncio.run(run())
    assert first == list(range(1, async_engine.UNREAD_OUTPUTS))
    assert [type(i).__name__ for i in rest].count("Shutdown") == async_engine.UNREAD_OUTPUTS
    assert [o.finished for o in rest if isinstance(o, RequestOutput)] == [True, False]
