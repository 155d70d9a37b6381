"""When requests are sent: arrival times (`--request-rate`, `--burstiness`) and the run itself
(`--max-concurrency`).

Each conversation (one request, or an agent session) arrives at its arrival time; a session's
turns then follow one another, each sent once the previous reply is complete, while the sessions
run concurrently. At most --max-concurrency requests are in flight (the others wait, and the
wait is their queue_time); every request of every conversation ends up in the outputs, a turn
after a failed turn as a failure that was never sent.
"""

from __future__ import annotations

import asyncio
import contextlib
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


def chat_messages(request: SampleRequest, history: list[dict]) -> list[dict]:
    """A chat request's messages: the system message, the conversation so far, the new user turn."""
    system = [{"role": "system", "content": request.system}] if request.system is not None else []
    return [*system, *history, {"role": "user", "content": request.prompt}]


async def run_workload(client: OpenAIClient, conversations: list[Conversation], arrivals: list[float],
                       max_concurrency: int | None, progress=None) -> tuple[list[RequestOutput], float]:
    """Run every conversation; returns (the outputs in conversation order, then turn order;
    the benchmark's duration in seconds, from the start to the last reply). progress: a tqdm bar
    (or anything with update(n)) advanced once per request."""
    origin = time.perf_counter()
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def converse(conversation: Conversation, arrival: float) -> list[RequestOutput]:
        delay = origin + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        history: list[dict] = []
        outputs: list[RequestOutput] = []
        for turn, request in enumerate(conversation.requests):
            if outputs and not outputs[-1].success:
                out = RequestOutput(prompt_len=request.prompt_len, start_time=time.perf_counter() - origin,
                                    error=f"not sent: turn {turn - 1} of its conversation failed")
            else:
                prompt = chat_messages(request, history) if client.chat else request.prompt
                queued = time.perf_counter()
                async with limit:
                    out = await client.send(prompt, request.expected_output_len, request.prompt_len, origin)
                out.queue_time = origin + out.start_time - queued
                if client.chat:
                    history += [{"role": "user", "content": request.prompt},
                                {"role": "assistant", "content": out.generated_text}]
            out.turn = turn
            outputs.append(out)
            if progress is not None:
                progress.update(1)
        return outputs

    per_conversation = await asyncio.gather(*(converse(c, a) for c, a in zip(conversations, arrivals, strict=True)))
    duration = time.perf_counter() - origin
    return [out for outputs in per_conversation for out in outputs], duration
