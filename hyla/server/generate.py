"""Running one HTTP request's sequences and answering it, whole or as server-sent events.

A request runs m sequences (its n choices, or best_of candidates) for each of its prompts (one,
or a /v1/completions batch): sequence k = p * m + j runs prompt p with params j. The sequences
of a request are engine requests that share one output queue. Each prompt's first sequence is
submitted at once and its others once it has produced its first token: its prefill has then
filed a state checkpoint at the prompt's end in the prefix cache, so the others hit it instead
of computing the prompt again (and only the first scores the prompt when prompt logprobs are
asked for: the others report its scores). A watcher task asks the client every
DISCONNECT_CHECK_S whether it is still there; if not, every unfinished sequence is aborted. (One
task per request, not a timed wait per token: `asyncio.wait_for` costs a task and a timer per
output, about 2.5x a plain `get`: some 2 ms of the event loop per step at 256 running requests
on a 2-core CPU box.)

Choices are indexed prompt-major, as OpenAI and vLLM do: choice p * n + i is prompt p's i-th.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from hyla.engine.outputs import CompletionOutput, RequestOutput
from hyla.engine.sampling_params import SamplingParams
from hyla.server.async_engine import OutputQueue, Shutdown
from hyla.server.errors import APIError
from hyla.server.logprobs import cumulative_logprob, prompt_logprobs
from hyla.server.protocol import Plan

DISCONNECT_CHECK_S = 0.25  # how often a running request asks whether its client is still there
CLIENT_GONE = object()  # put on a request's output queue by its watcher when the client went away
SHUTDOWN_MESSAGE = "the server is shutting down: the request did not finish within its drain time"


class ChoiceBuilder(Protocol):
    """How one sequence's output becomes its choice (`index` fixed at creation)."""

    def whole(self, c: CompletionOutput) -> dict:
        """The choice of a whole response."""

    def delta(self, c: CompletionOutput) -> dict | None:
        """A stream chunk's choice: what `c` adds since the last call (None: nothing to send)."""

    def opening(self) -> dict | None:
        """The choice of a first chunk sent before any token (chat's role), or None."""


# How a sequence's output shows in its choice: view(prompt index, output) -> the CompletionOutput
# its builder reads (completions' echo puts the prompt in front); None: the output itself.
View = Callable[[int, RequestOutput], CompletionOutput]


def _prompts(ids: list[int] | list[list[int]]) -> list[list[int]]:
    """One prompt's ids, or a batch of prompts' ids -> the batch."""
    return [ids] if ids and isinstance(ids[0], int) else ids


async def outputs(request: Request, state, rid: str, ids: list[int] | list[list[int]],
                  params: list[SamplingParams]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (sequence index, cumulative output) until every sequence finished; abort the
    unfinished ones if the client goes away or the caller stops early. ids: one prompt's token
    ids, or a batch of prompts'; sequence k runs prompt k // len(params) with params[k % len(params)]."""
    prompts, m = _prompts(ids), len(params)
    total = len(prompts) * m
    rids = [rid] if total == 1 else [f"{rid}-{k}" for k in range(total)]
    index = {r: k for k, r in enumerate(rids)}
    # a prompt's later sequences take its first one's prompt scores (and its prefix-cache checkpoint)
    later = [dataclasses.replace(p, prompt_logprobs=None) if p.prompt_logprobs is not None else p for p in params]
    scored: dict[int, RequestOutput] = {}  # prompt -> its first sequence's latest output
    queue = OutputQueue()
    submitted: list[str] = []
    done: set[int] = set()

    def submit(k: int) -> None:
        p, j = divmod(k, m)
        state.metrics.arrived(rids[k])
        state.async_engine.submit(rids[k], prompts[p], params[j] if j == 0 else later[j], out=queue)
        submitted.append(rids[k])

    for p in range(len(prompts)):
        submit(p * m)
    watcher = asyncio.ensure_future(_watch_client(request, queue))
    try:
        while len(done) < total:
            out = await queue.get()
            if out is CLIENT_GONE:
                return
            k = index[out.request_id]
            if isinstance(out, Shutdown):  # the server stopped it at the end of its drain (hyla.server.shutdown)
                done.add(k)
                raise APIError(503, SHUTDOWN_MESSAGE, "server_error", code="server_shutting_down")
            p, j = divmod(k, m)
            if out.error:  # the request was validated before it was submitted: a server failure
                done.add(k)
                raise APIError(500, f"the engine failed on this request: {out.error}", "server_error")
            if j == 0:
                if p not in scored:
                    for later_k in range(k + 1, k + m):  # the prompt's prefill is in the prefix cache now
                        submit(later_k)
                scored[p] = out
            elif params[j].prompt_logprobs is not None:
                first = scored[p]
                out = dataclasses.replace(out, prompt_logprobs=first.prompt_logprobs,
                                          prompt_token_ranks=first.prompt_token_ranks)
            if out.finished:
                done.add(k)
            yield k, out
    finally:
        watcher.cancel()
        for r in submitted:
            if index[r] not in done:
                state.async_engine.abort(r)


async def _watch_client(request: Request, queue: OutputQueue) -> None:
    """Every DISCONNECT_CHECK_S, ask whether the client is still there (also while outputs keep
    coming: a non-streamed request produces one per step); put CLIENT_GONE when it is not."""
    while True:
        await asyncio.sleep(DISCONNECT_CHECK_S)
        if await request.is_disconnected():
            queue.put_nowait(CLIENT_GONE)
            return


def usage(ids: list[int] | list[list[int]], finals: dict[int, RequestOutput], per_prompt: int = 1) -> dict:
    """Each prompt once, the completion tokens of every sequence (also best_of's dropped ones),
    and the prompt tokens the prefix cache served (each prompt's first sequence's hit: the later
    ones hit its own checkpoint). per_prompt: sequences per prompt (sequence k runs prompt
    k // per_prompt)."""
    prompts = _prompts(ids)
    prompt_tokens = sum(len(p) for p in prompts)
    n = sum(len(o.outputs[0].token_ids) for o in finals.values() if o.outputs)
    cached = sum(finals[k].num_cached_tokens for k in range(0, len(prompts) * per_prompt, per_prompt) if k in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(data) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def respond(request: Request, state, req, ids: list[int] | list[list[int]], plan: Plan, head: dict,
                  make_choice: Callable[[int], ChoiceBuilder], chunk_object: str, view: View | None = None,
                  prompt_fields_in_choices: bool = False, engine_id: str | None = None):
    """Run the plan on the prompt `ids` (or on each prompt of a batch) and answer: the whole
    response, or (req.stream) server-sent events: each choice's opening, one chunk per engine
    output (that choice's delta, with its index), the usage when stream_options.include_usage,
    then `data: [DONE]`. view: how an output shows in its choice (None: as it is). engine_id:
    the engine's id of the request's sequences (default: the response's id), unique among the
    requests the engine runs.

    What the prompt adds goes where vLLM puts it: in each choice (completions,
    prompt_fields_in_choices) or in the whole response (chat): its logprobs when the params ask
    for them (a stream has none) and, with req.return_token_ids, its token ids
    (`prompt_token_ids`; streamed in a choice's first chunk, or chat's opening chunks), beside
    each choice's generated ids (`token_ids`; streamed as each chunk's new ones)."""
    prompts, m = _prompts(ids), len(plan.params)
    n_prompt_top = plan.params[0].prompt_logprobs
    tok = state.engine.tokenizer
    engine_id = engine_id or head["id"]
    with_ids = req.return_token_ids

    def shown(k: int, out: RequestOutput) -> CompletionOutput:
        return view(k // m, out) if view is not None else out.outputs[0]

    if not req.stream:
        finals: dict[int, RequestOutput] = {}
        async for k, out in outputs(request, state, engine_id, prompts, plan.params):
            finals[k] = out
        if len(finals) < len(prompts) * m or not all(o.finished for o in finals.values()):
            raise APIError(499, "client closed the request")
        keep = plan.keep if plan.keep is not None else m
        choices = []
        for p in range(len(prompts)):
            order = list(range(p * m, (p + 1) * m))
            if plan.keep is not None:  # best_of: the candidates with the highest cumulative logprob
                order = sorted(order, key=lambda k: -cumulative_logprob(finals[k].outputs[0]))[:keep]
            for i, k in enumerate(order):
                c = shown(k, finals[k])
                if plan.strip_logprobs:
                    c = dataclasses.replace(c, logprobs=None)
                choice = make_choice(p * keep + i).whole(c)
                if prompt_fields_in_choices and n_prompt_top is not None:
                    choice["prompt_logprobs"] = prompt_logprobs(tok, finals[k], n_prompt_top)
                if with_ids:  # the generated ids alone (not echo's prompt in front: vLLM's rule)
                    choice["token_ids"] = list(finals[k].outputs[0].token_ids)
                    if prompt_fields_in_choices:
                        choice["prompt_token_ids"] = list(prompts[p])
                choices.append(choice)
        body = {**head, "choices": choices, "usage": usage(prompts, finals, m)}
        if not prompt_fields_in_choices and n_prompt_top is not None:
            body["prompt_logprobs"] = prompt_logprobs(tok, finals[0], n_prompt_top)
        if with_ids and not prompt_fields_in_choices:
            body["prompt_token_ids"] = list(prompts[0])
        return body
    chunk_head = {**head, "object": chunk_object}
    options = req.stream_options  # vLLM's continuous_usage_stats: the usage so far in every chunk too
    continuous = options is not None and options.include_usage and options.continuous_usage_stats
    builders = [make_choice(k) for k in range(len(prompts) * m)]  # a stream has no best_of: choice k is sequence k
    ids_sent = [0] * len(builders)  # with_ids: generated ids each choice has streamed
    prompt_sent = [False] * len(builders)

    async def events():
        for b in builders:
            opening = b.opening()
            if opening is not None:
                chunk = {**chunk_head, "choices": [opening]}
                if with_ids and not prompt_fields_in_choices:
                    chunk["prompt_token_ids"] = list(prompts[0])
                yield sse(chunk)
        finals: dict[int, RequestOutput] = {}
        try:
            async for k, out in outputs(request, state, engine_id, prompts, plan.params):
                finals[k] = out
                c = builders[k].delta(shown(k, out))
                if c is not None:
                    if with_ids:
                        new = out.outputs[0].token_ids
                        c["token_ids"] = list(new[ids_sent[k]:])
                        ids_sent[k] = len(new)
                        if prompt_fields_in_choices and not prompt_sent[k]:
                            c["prompt_token_ids"] = list(prompts[k // m])
                            prompt_sent[k] = True
                    chunk = {**chunk_head, "choices": [c]}
                    yield sse({**chunk, "usage": usage(prompts, finals, m)} if continuous else chunk)
        except APIError as e:  # the status line is sent: an error event, then the end of the stream
            yield sse(e.body())
            yield "data: [DONE]\n\n"
            return
        if finals and req.stream_options and req.stream_options.include_usage:
            yield sse({**chunk_head, "choices": [], "usage": usage(prompts, finals, m)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
