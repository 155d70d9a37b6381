"""Running one HTTP request's sequences and answering it, whole or as server-sent events.

A request with n choices (or best_of candidates) is n engine requests that share one output
queue. The first is submitted alone and the others once it has produced its first token: its
prefill has then filed a state checkpoint at the prompt's end in the prefix cache, so the
others hit it instead of computing the prompt again. The client is asked about every
DISCONNECT_CHECK_S whether it is still there; if not, every unfinished sequence is aborted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from hyla.engine.outputs import CompletionOutput, RequestOutput
from hyla.engine.sampling_params import SamplingParams
from hyla.server.errors import APIError
from hyla.server.logprobs import cumulative_logprob
from hyla.server.protocol import Plan

DISCONNECT_CHECK_S = 0.25  # how often a running request asks whether its client is still there


class ChoiceBuilder(Protocol):
    """How one sequence's output becomes its choice (`index` fixed at creation)."""

    def whole(self, c: CompletionOutput) -> dict:
        """The choice of a whole response."""

    def delta(self, c: CompletionOutput) -> dict | None:
        """A stream chunk's choice: what `c` adds since the last call (None: nothing to send)."""

    def opening(self) -> dict | None:
        """The choice of a first chunk sent before any token (chat's role), or None."""


async def outputs(request: Request, state, rid: str, ids: list[int],
                  params: list[SamplingParams]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (sequence index, cumulative output) until every sequence finished; abort the
    unfinished ones if the client goes away or the caller stops early."""
    rids = [rid] if len(params) == 1 else [f"{rid}-{i}" for i in range(len(params))]
    index = {r: i for i, r in enumerate(rids)}
    queue: asyncio.Queue = asyncio.Queue()
    submitted: list[str] = []
    done: set[int] = set()

    def submit(i: int) -> None:
        state.metrics.arrived(rids[i])
        state.async_engine.submit(rids[i], ids, params[i], out=queue)
        submitted.append(rids[i])

    submit(0)
    checked = time.monotonic()
    try:
        while len(done) < len(params):
            try:
                out = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_CHECK_S)
            except asyncio.TimeoutError:
                out = None
            # asked also while outputs keep coming: a non-streamed request produces one per step
            if time.monotonic() - checked >= DISCONNECT_CHECK_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            if out is None:
                continue
            i = index[out.request_id]
            if out.error:  # the request was validated before it was submitted: a server failure
                done.add(i)
                raise APIError(500, f"the engine failed on this request: {out.error}", "server_error")
            if i == 0 and len(submitted) == 1:
                for j in range(1, len(params)):  # the prompt's prefill is in the prefix cache now
                    submit(j)
            if out.finished:
                done.add(i)
            yield i, out
    finally:
        for r in submitted:
            if index[r] not in done:
                state.async_engine.abort(r)


def usage(ids: list[int], finals: dict[int, RequestOutput]) -> dict:
    """The prompt once, the completion tokens of every sequence (also best_of's dropped ones)."""
    n = sum(len(o.outputs[0].token_ids) for o in finals.values() if o.outputs)
    return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}


def sse(data) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def respond(request: Request, state, req, ids: list[int], plan: Plan, head: dict,
                  make_choice: Callable[[int], ChoiceBuilder], chunk_object: str):
    """Run the plan and answer: the whole response, or (req.stream) server-sent events: each
    choice's opening, one chunk per engine output (that choice's delta, with its index), the
    usage when stream_options.include_usage, then `data: [DONE]`."""
    rid = head["id"]
    if not req.stream:
        finals: dict[int, RequestOutput] = {}
        async for i, out in outputs(request, state, rid, ids, plan.params):
            finals[i] = out
        if len(finals) < len(plan.params) or not all(o.finished for o in finals.values()):
            raise APIError(499, "client closed the request")
        order = sorted(finals)
        if plan.keep is not None:  # best_of: the candidates with the highest cumulative logprob
            order = sorted(order, key=lambda i: -cumulative_logprob(finals[i].outputs[0]))[: plan.keep]
        choices = []
        for new_index, i in enumerate(order):
            c = finals[i].outputs[0]
            if plan.strip_logprobs:
                c = CompletionOutput(c.index, c.text, c.token_ids, None, c.finish_reason, c.stop_reason)
            choices.append(make_choice(new_index).whole(c))
        return {**head, "choices": choices, "usage": usage(ids, finals)}
    chunk_head = {**head, "object": chunk_object}
    builders = [make_choice(i) for i in range(len(plan.params))]

    async def events():
        for b in builders:
            opening = b.opening()
            if opening is not None:
                yield sse({**chunk_head, "choices": [opening]})
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in outputs(request, state, rid, ids, plan.params):
                finals[i] = out
                c = builders[i].delta(out.outputs[0])
                if c is not None:
                    yield sse({**chunk_head, "choices": [c]})
        except APIError as e:  # the status line is sent: an error event, then the end of the stream
            yield sse(e.body())
            yield "data: [DONE]\n\n"
            return
        if finals and req.stream_options and req.stream_options.include_usage:
            yield sse({**chunk_head, "choices": [], "usage": usage(ids, finals)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
