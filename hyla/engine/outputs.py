"""What the engine returns: one RequestOutput per request, cumulative (as vLLM's default)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """index: always 0 (one completion per request); text / token_ids: everything generated so far;
    logprobs: per emitted token a dict {token_id: logprob} holding the emitted token and the top-n
    (None unless SamplingParams.logprobs is set); finish_reason: None while running, then "stop",
    "length", "abort" or "error"."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request went through the engine, in time.monotonic() seconds (vLLM's RequestMetrics
    fields of the same names): arrival_time (added to the engine), first_scheduled_time (first
    admitted into a step), first_token_time and last_token_time (its first and latest output
    token). None for what has not happened (a request aborted while waiting)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class RequestOutput:
    """prompt_token_ids: the request's prompt ids, the engine's own list in every output of the
    request (read it; do not change it). prompt_logprobs: with SamplingParams.prompt_logprobs, one entry per prompt token: None for
    the first, then {token_id: logprob} holding the prompt token and the top-n at its position
    (filled as the prefill goes; complete once the first output token exists, or, with
    max_tokens=0, once the request finished); prompt_token_ranks: with them, each prompt token's
    rank at its position (how many tokens are at least as likely, itself included: vLLM's rank,
    1 = the most likely; None for the first). num_cached_tokens: the prompt tokens a prefix-cache hit served when the
    request started (0 without one). metrics: the request's timestamps (RequestMetrics), on its
    finished output only (None before)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
