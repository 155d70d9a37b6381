"""One streamed request to an OpenAI-compatible server, timed token chunk by token chunk.

Requests always stream (`stream: true`, `stream_options.include_usage: true`), so that the
time to the first token and the gaps between tokens can be seen. A token chunk is a completions
chunk with a choice, or a chat chunk whose delta carries text (content, reasoning) or tool calls
or whose choice finishes: the first chunk of a chat stream, sent before any token with only the
assistant's role, is not one. TTFT = first token chunk - send; ITL = the gaps between token
chunks; latency (E2EL) = last token chunk - send (vLLM's definitions).

Output tokens are the usage's completion_tokens when the server reports a usage, else the token
chunks counted (one token per chunk, as servers stream without speculative decoding). Any
failure (a connection error, a status other than 200, an error event in the stream, a stream
without a token) is recorded in the output with its message; nothing is raised.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

CHAT_TOKEN_FIELDS = ("content", "reasoning", "reasoning_content", "tool_calls")


@dataclass
class RequestOutput:
    """What one request measured. Times in seconds; start_time from the benchmark's start;
    queue_time: waited for --max-concurrency before sending. prompt_len / output_tokens: the
    server's usage when reported (usage_reported), else the dataset's count / token chunks.
    cached_tokens: usage.prompt_tokens_details.cached_tokens, None when not reported.
    turn: its index in its conversation (0: a first turn, or a request of a one-turn dataset).
    response_id: the stream's `id` (the server's request id: what `hyla serve --step-log` names)."""

    prompt_len: int
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    usage_reported: bool = False
    cached_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    queue_time: float = 0.0
    generated_text: str = ""
    turn: int = 0
    response_id: str | None = None


async def sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The data of each server-sent event (data lines joined by newlines; comments skipped)."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


def _error_message(status: int, body: bytes) -> str:
    """`HTTP 400: message` from an OpenAI-style error body ({"error": {"message"}}), FastAPI's
    {"detail"}, or the raw text."""
    text = body.decode("utf-8", "replace")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        payload = None
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            text = str(error["message"])
        elif isinstance(error, str):
            text = error
        elif "detail" in payload:
            text = json.dumps(payload["detail"]) if not isinstance(payload["detail"], str) else payload["detail"]
    return f"HTTP {status}: {text.strip()[:1000]}"


def _chunk_text(choice: dict, chat: bool) -> str | None:
    """The text a choice adds, or None when it is not a token chunk."""
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    if any(delta.get(k) for k in CHAT_TOKEN_FIELDS) or choice.get("finish_reason") is not None:
        return delta.get("content") or ""
    return None


class OpenAIClient:
    """Sends the benchmark's requests over one connection pool (`http`).

    api_url: .../v1/completions or .../v1/chat/completions (chat: `messages` instead of
    `prompt`, `max_completion_tokens` instead of `max_tokens`); extra_body: fields added to every
    request (sampling parameters, --extra-body); ignore_eos is sent only when set (vLLM's
    extension); logprobs (--logprobs N): a completion's `logprobs: N`, a chat's `logprobs: true,
    top_logprobs: N`, not sent when None; headers: those of every request (--header, the key),
    to which request_headers adds each one's x-request-id."""

    def __init__(self, http: httpx.AsyncClient, api_url: str, model: str, chat: bool, ignore_eos: bool,
                 extra_body: dict | None = None, headers: dict[str, str] | None = None,
                 logprobs: int | None = None):
        self.http, self.api_url, self.model, self.chat = http, api_url, model, chat
        self.ignore_eos, self.extra_body, self.headers = ignore_eos, dict(extra_body or {}), dict(headers or {})
        self.logprobs = logprobs

    def request_headers(self, request_id: str | None) -> dict[str, str]:
        """One request's headers (built here only): the common ones, and its x-request-id when it
        has one (replacing any --header of that name, whatever its case)."""
        if request_id is None:
            return dict(self.headers)
        return {**{k: v for k, v in self.headers.items() if k.lower() != "x-request-id"}, "x-request-id": request_id}

    def payload(self, prompt: str | list[int] | list[dict], max_tokens: int) -> dict:
        body: dict = {"model": self.model}
        if self.chat:
            body.update(messages=prompt, max_completion_tokens=max_tokens)
        else:
            body.update(prompt=prompt, max_tokens=max_tokens)
        body.update(stream=True, stream_options={"include_usage": True})
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.logprobs is not None and self.chat:
            body.update(logprobs=True, top_logprobs=self.logprobs)
        elif self.logprobs is not None:
            body["logprobs"] = self.logprobs
        body.update(self.extra_body)
        return body

    async def send(self, prompt: str | list[int] | list[dict], max_tokens: int, prompt_len: int,
                   clock_origin: float, request_id: str | None = None) -> RequestOutput:
        """Send one request (a prompt, or chat messages) and time its stream. clock_origin: the
        perf_counter() value start_time counts from; request_id: its x-request-id header."""
        out = RequestOutput(prompt_len=prompt_len)
        start = time.perf_counter()
        out.start_time = start - clock_origin
        last = start
        chunks, text = 0, []
        try:
            async with self.http.stream("POST", self.api_url, json=self.payload(prompt, max_tokens),
                                        headers=self.request_headers(request_id)) as response:
                if response.status_code != 200:
                    out.error = _error_message(response.status_code, await response.aread())
                    return out
                async for data in sse_events(response):
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        raise ValueError(f"a stream event is not a JSON object: {data[:200]}")
                    if "error" in event:
                        error = event["error"]
                        message = error.get("message") if isinstance(error, dict) else error
                        out.error = f"error event in the stream: {message}"
                        return out
                    now = time.perf_counter()
                    if out.response_id is None and isinstance(event.get("id"), str):
                        out.response_id = event["id"]
                    for choice in event.get("choices") or ():
                        piece = _chunk_text(choice, self.chat)
                        if piece is None:
                            continue
                        if chunks == 0:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last, chunks = now, chunks + 1
                        text.append(piece)
                    usage = event.get("usage")
                    if usage:
                        self._read_usage(out, usage)
        except Exception as e:  # noqa: BLE001 (any failure is this request's result, never the benchmark's end)
            out.error = f"{type(e).__name__}: {e}"
            return out
        out.generated_text = "".join(text)
        if chunks == 0:
            out.error = "the stream ended without a token"
            return out
        out.latency = last - start
        if not out.usage_reported:
            out.output_tokens = chunks
        out.success = True
        return out

    @staticmethod
    def _read_usage(out: RequestOutput, usage: dict) -> None:
        if isinstance(usage.get("completion_tokens"), int):
            out.output_tokens = usage["completion_tokens"]
            out.usage_reported = True
        if isinstance(usage.get("prompt_tokens"), int):
            out.prompt_len = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            out.cached_tokens = details["cached_tokens"]
