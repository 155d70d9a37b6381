"""When requests are sent: arrival times (`--request-rate`, `--burstiness`, or a ramp of the rate:
`--ramp-up-strategy`), the warm-up (`--num-warmups`) and the run itself (`--max-concurrency`).

Each conversation (one request, or an agent session) arrives at its arrival time; a session's
turns then follow one another, each sent once the previous reply is complete and the session's
tool has run (`--tool-latency-ms`, `--tool-latency-dist`: a pause drawn per turn, 0 by default),
while the sessions run concurrently. At most --max-concurrency requests are in flight (the others
wait, and the wait is their queue_time; a session pausing for its tool holds no place); every
request of every conversation ends up in the outputs, a turn after a failed turn as a failure
that was never sent. Each request carries the header x-request-id {prefix}{i} (vLLM's
--request-id-prefix), i counting the requests in the order they come to be sent (at their
arrival, or a turn's once the previous reply is complete and the tool's pause has passed; before
any wait for --max-concurrency); warm-ups carry {prefix}warmup-{j}. A server's logs and traces
then tell which run, and which request of it, they saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time

import numpy as np

from hyla.bench.serve.client import OpenAIClient, RequestOutput
from hyla.bench.serve.datasets import Conversation, SampleRequest


def arrival_times(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Seconds after the start at which each of n arrivals happens (non-decreasing).

    request_rate inf: all at 0. Otherwise vLLM's process: gaps drawn from a gamma distribution of
    shape `burstiness` and mean 1 / request_rate (burstiness 1: a Poisson process; below 1
    burstier, above 1 more even, inf: every gap exactly 1 / request_rate), summed, then scaled so
    that the last arrival is at n / request_rate (the sum of random gaps drifts by a percent or
    two, which would make the throughput depend on the seed)."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be positive, got {request_rate} and {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if n and times[-1] > 0:
        times *= (n / request_rate) / times[-1]
    return times.tolist()


RAMP_UP_STRATEGIES = ("linear", "exponential")


def ramp_rates(n: int, strategy: str, start_rps: float, end_rps: float) -> list[float]:
    """The request rate of each of n arrivals as it moves from start_rps (the first) to end_rps
    (the last): linearly, or by a constant factor per request (exponential); n = 1: start_rps."""
    if strategy not in RAMP_UP_STRATEGIES:
        raise ValueError(f"unknown ramp-up strategy {strategy!r}; choose from {', '.join(RAMP_UP_STRATEGIES)}")
    progress = np.arange(n) / max(n - 1, 1)
    if strategy == "linear":
        return (start_rps + (end_rps - start_rps) * progress).tolist()
    return (start_rps * (end_rps / start_rps) ** progress).tolist()


def ramp_arrival_times(n: int, strategy: str, start_rps: float, end_rps: float, burstiness: float,
                       rng: np.random.Generator) -> list[float]:
    """Arrival times of a ramped rate (vLLM's --ramp-up-strategy): the gap before arrival i is
    drawn from a gamma distribution of shape `burstiness` and mean 1 / ramp_rates(...)[i]
    (burstiness inf: exactly that mean), and the arrivals are the running sum of the gaps. Unlike
    arrival_times nothing is rescaled: the ramp is the point, and its duration follows from it."""
    if not (0 < start_rps < math.inf and 0 < end_rps < math.inf) or not burstiness > 0:
        raise ValueError(f"the ramp's rates and burstiness must be positive and the rates finite, got {start_rps}, "
                         f"{end_rps} and {burstiness}")
    means = 1.0 / np.asarray(ramp_rates(n, strategy, start_rps, end_rps), dtype=np.float64)
    gaps = means if math.isinf(burstiness) else rng.gamma(shape=burstiness, scale=means / burstiness)
    return np.cumsum(gaps).tolist()


TOOL_LATENCY_DISTS = ("fixed", "exponential")


def tool_latencies(turns: list[int], mean_ms: float, dist: str, seed: int) -> list[list[float]]:
    """The seconds each conversation pauses before each of its turns, as if a tool ran between a
    reply and the next turn (real agent traffic has one; without it every session sends the
    instant its reply ends, and sessions started together stay in lockstep). turns: each
    conversation's number of turns; element [c][t] is the pause before turn t of conversation c,
    0 for every first turn (a conversation's arrival sets when it starts). fixed: every pause
    mean_ms; exponential: drawn with mean mean_ms. Drawn here, all at once and in conversation
    order, rather than as replies come back, so that a seed gives the same pauses however the
    server's timing interleaves the sessions; from a stream of its own (a child of `seed`'s
    SeedSequence), so that the arrival times drawn from `seed` are the same with and without it."""
    if dist not in TOOL_LATENCY_DISTS:
        raise ValueError(f"unknown tool latency distribution {dist!r}; choose from {', '.join(TOOL_LATENCY_DISTS)}")
    if not 0 <= mean_ms < math.inf:
        raise ValueError(f"the mean tool latency must be non-negative and finite, got {mean_ms} ms")
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])
    pauses = []
    for n in turns:
        later = max(n - 1, 0)
        drawn = np.full(later, mean_ms) if dist == "fixed" else rng.exponential(mean_ms, size=later)
        pauses.append([0.0, *(drawn / 1e3).tolist()] if n else [])
    return pauses


def _request_id(prefix: str | None, suffix: object) -> str | None:
    return None if prefix is None else f"{prefix}{suffix}"


async def warm_up(client: OpenAIClient, request: SampleRequest, n: int, max_concurrency: int | None,
                  request_id_prefix: str | None = None) -> list[RequestOutput]:
    """Send n copies of `request` (as a first turn) under the --max-concurrency limit and return
    their outputs: what a server does once only (compile, allocate its caches, open the
    connections) is then done before the run that is measured."""
    limit = _concurrency_limit(max_concurrency)
    prompt = request_prompt(client, request, [])
    origin = time.perf_counter()

    async def one(j: int) -> RequestOutput:
        async with limit:
            return await client.send(prompt, request.expected_output_len, request.prompt_len, origin,
                                     _request_id(request_id_prefix, f"warmup-{j}"))

    return list(await asyncio.gather(*(one(j) for j in range(n))))


def chat_messages(request: SampleRequest, history: list[dict]) -> list[dict]:
    """A chat request's messages: the system message, the conversation so far, the new user turn."""
    system = [{"role": "system", "content": request.system}] if request.system is not None else []
    return [*system, *history, {"role": "user", "content": request.prompt}]


def request_prompt(client: OpenAIClient, request: SampleRequest, history: list[dict]) -> str | list[int] | list[dict]:
    """What a request sends: its prompt, or for a chat client its messages after `history`."""
    return chat_messages(request, history) if client.chat else request.prompt


def _concurrency_limit(max_concurrency: int | None):
    """An async context manager that holds at most max_concurrency requests in flight (None: no limit)."""
    return asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()


async def run_workload(client: OpenAIClient, conversations: list[Conversation], arrivals: list[float],
                       max_concurrency: int | None, progress=None, request_id_prefix: str | None = None,
                       pauses: list[list[float]] | None = None,
                       origin: float | None = None) -> tuple[list[RequestOutput], float]:
    """Run every conversation; returns (the outputs in conversation order, then turn order;
    the benchmark's duration in seconds, from the start to the last reply). progress: a tqdm bar
    (or anything with update(n)) advanced once per request. request_id_prefix: the requests'
    x-request-id is it followed by their index in the order they are sent (None: no header).
    pauses: seconds to wait before each turn of each conversation (tool_latencies; None: none),
    after the previous reply and before the request is sent, so they count in the duration but in
    no request's TTFT or E2E latency; a turn that is not sent (its predecessor failed) waits none.
    origin: the time.perf_counter() the start times count from (None: now)."""
    origin = time.perf_counter() if origin is None else origin
    limit = _concurrency_limit(max_concurrency)
    sent = itertools.count()
    if pauses is None:
        pauses = [[0.0] * len(c.requests) for c in conversations]

    async def converse(conversation: Conversation, arrival: float, waits: list[float]) -> list[RequestOutput]:
        delay = origin + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        history: list[dict] = []
        outputs: list[RequestOutput] = []
        for turn, (request, wait) in enumerate(zip(conversation.requests, waits, strict=True)):
            if outputs and not outputs[-1].success:
                out = RequestOutput(prompt_len=request.prompt_len, start_time=time.perf_counter() - origin,
                                    error=f"not sent: turn {turn - 1} of its conversation failed")
            else:
                if wait > 0:  # the tool runs; no sleep at all when there is none (the default's timing)
                    await asyncio.sleep(wait)
                prompt = request_prompt(client, request, history)
                request_id = _request_id(request_id_prefix, next(sent))
                queued = time.perf_counter()
                async with limit:
                    out = await client.send(prompt, request.expected_output_len, request.prompt_len, origin,
                                            request_id)
                out.queue_time = origin + out.start_time - queued
                if client.chat:
                    history += [{"role": "user", "content": request.prompt},
                                {"role": "assistant", "content": out.generated_text}]
            out.turn = turn
            outputs.append(out)
            if progress is not None:
                progress.update(1)
        return outputs

    per_conversation = await asyncio.gather(*(converse(c, a, w) for c, a, w in
                                              zip(conversations, arrivals, pauses, strict=True)))
    duration = time.perf_counter() - origin
    return [out for outputs in per_conversation for out in outputs], duration
