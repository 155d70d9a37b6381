"""Deterministic request traces for the prefix-cache benchmark (there are no outside traces).

A trace is a list of requests in arrival order, each a prompt and the output the model
generates for it (token-id tuples). Requests are served one at a time. Outputs come from
`respond(prompt)`: by default `synthetic_output`, a fixed length and tokens drawn from a
generator seeded by the prompt, so that an identical prompt (a retry) gets the identical
output, as greedy decoding would. A test can pass a real engine as `respond`; multi-turn
sessions then grow with the engine's own outputs.

    (a) shared_system_prompts  system prompts of 300-3000 tokens + distinct questions
    (b) agent_sessions         sessions whose every turn is the previous prompt + its output +
                               a new message (tool result / user turn), interleaved
    (c) exact_retries          unique prompts, 20% of requests resend an earlier prompt verbatim
    (d) few_shot               task header + the first k of the task's examples + a query
"""

from __future__ import annotations

import hashlib
import random
from array import array
from dataclasses import dataclass
from typing import Callable

# Chat-template markers (3 tokens each, as real templates spell a role tag); random content
# tokens are drawn from ids >= FIRST_ID so that they never collide with a marker.
USER, TOOL, QUERY = (3, 4, 5), (6, 7, 5), (8, 9, 5)
FIRST_ID = 10

Tokens = tuple[int, ...]
Respond = Callable[[Tokens], Tokens]


@dataclass(frozen=True)
class Request:
    prompt: Tokens
    output: Tokens
    tag: str = ""


@dataclass(frozen=True)
class Trace:
    key: str
    title: str
    requests: list[Request]


def synthetic_output(prompt: Tokens, lengths: tuple[int, int] = (64, 384), vocab: int = 50_000) -> Tokens:
    """A deterministic stand-in for greedy decoding: same prompt, same output."""
    digest = hashlib.blake2b(array("q", prompt).tobytes(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    return tuple(rng.randrange(FIRST_ID, vocab) for _ in range(rng.randint(*lengths)))


def _text(rng: random.Random, lengths: tuple[int, int], vocab: int) -> Tokens:
    return tuple(rng.randrange(FIRST_ID, vocab) for _ in range(rng.randint(*lengths)))


def shared_system_prompts(respond: Respond, n_requests: int, n_systems: int, system_len: tuple[int, int],
                          question_len: tuple[int, int], seed: int, vocab: int) -> Trace:
    """Each request: one of n_systems system prompts (uniformly) + a question nobody else asks."""
    rng = random.Random(seed)
    systems = [_text(rng, system_len, vocab) for _ in range(n_systems)]
    requests = []
    for _ in range(n_requests):
        s = rng.randrange(n_systems)
        prompt = systems[s] + USER + _text(rng, question_len, vocab)
        requests.append(Request(prompt, respond(prompt), f"system {s}"))
    return Trace("a", f"{n_requests} requests over {n_systems} system prompts of {system_len[0]}-{system_len[1]} "
                      "tokens + distinct questions", requests)


def agent_sessions(respond: Respond, n_sessions: int, turns: int, n_systems: int, system_len: tuple[int, int],
                   message_len: tuple[int, int], concurrency: int, seed: int, vocab: int) -> Trace:
    """Sessions start on one of n_systems agent system prompts; turn t+1's prompt is turn t's
    prompt + its output + a new message. `concurrency` sessions are open at a time and the next
    turn comes from a random open one, so other sessions' traffic falls between two turns."""
    rng = random.Random(seed)
    systems = [_text(rng, system_len, vocab) for _ in range(n_systems)]
    started, open_sessions, requests = 0, [], []
    while started < n_sessions or open_sessions:
        while started < n_sessions and len(open_sessions) < concurrency:
            first = systems[rng.randrange(n_systems)] + USER + _text(rng, message_len, vocab)
            open_sessions.append({"id": started, "turn": 0, "prompt": first})
            started += 1
        session = open_sessions[rng.randrange(len(open_sessions))]
        prompt = session["prompt"]
        output = respond(prompt)
        requests.append(Request(prompt, output, f"session {session['id']} turn {session['turn']}"))
        session["turn"] += 1
        if session["turn"] == turns:
            open_sessions.remove(session)
        else:
            session["prompt"] = prompt + output + TOOL + _text(rng, message_len, vocab)
    return Trace("b", f"{n_sessions} agent sessions x {turns} turns, growing context, {concurrency} open at a time",
                 requests)


def exact_retries(respond: Respond, n_requests: int, retry_fraction: float, prompt_len: tuple[int, int],
                  window: int, seed: int, vocab: int) -> Trace:
    """Unique prompts; with probability retry_fraction a request resends, verbatim, one of the
    last `window` original prompts."""
    rng = random.Random(seed)
    originals, requests = [], []
    for _ in range(n_requests):
        if originals and rng.random() < retry_fraction:
            i = rng.randrange(max(0, len(originals) - window), len(originals))
            prompt, tag = originals[i], f"retry of {i}"
        else:
            prompt, tag = _text(rng, prompt_len, vocab), f"original {len(originals)}"
            originals.append(prompt)
        requests.append(Request(prompt, respond(prompt), tag))
    return Trace("c", f"{n_requests} requests, {retry_fraction:.0%} exact retries of a recent prompt", requests)


def few_shot(respond: Respond, n_requests: int, n_tasks: int, n_examples: int, header_len: tuple[int, int],
             example_len: tuple[int, int], query_len: tuple[int, int], seed: int, vocab: int) -> Trace:
    """A shared preamble, then a task header + the task's first k examples (k uniform in
    1..n_examples, so templates nest) + a distinct query."""
    rng = random.Random(seed)
    preamble = _text(rng, (40, 40), vocab)
    tasks = [(_text(rng, header_len, vocab), [_text(rng, example_len, vocab) for _ in range(n_examples)])
             for _ in range(n_tasks)]
    requests = []
    for _ in range(n_requests):
        t, k = rng.randrange(n_tasks), rng.randint(1, n_examples)
        header, examples = tasks[t]
        prompt = preamble + header + sum(examples[:k], ()) + QUERY + _text(rng, query_len, vocab)
        requests.append(Request(prompt, respond(prompt), f"task {t} {k}-shot"))
    return Trace("d", f"few-shot templates: {n_tasks} tasks x 1-{n_examples} examples + distinct queries", requests)


FULL = {
    "a": dict(n_requests=200, n_systems=10, system_len=(300, 3000), question_len=(20, 200)),
    "b": dict(n_sessions=50, turns=8, n_systems=4, system_len=(800, 2000), message_len=(50, 600), concurrency=8),
    "c": dict(n_requests=200, retry_fraction=0.2, prompt_len=(100, 3000), window=16),
    "d": dict(n_requests=200, n_tasks=8, n_examples=8, header_len=(50, 200), example_len=(80, 300),
              query_len=(20, 150)),
}
QUICK = {
    "a": dict(n_requests=40, n_systems=4, system_len=(200, 1200), question_len=(10, 80)),
    "b": dict(n_sessions=8, turns=4, n_systems=2, system_len=(300, 800), message_len=(20, 200), concurrency=3),
    "c": dict(n_requests=40, retry_fraction=0.2, prompt_len=(50, 1200), window=8),
    "d": dict(n_requests=40, n_tasks=4, n_examples=4, header_len=(30, 100), example_len=(40, 150),
              query_len=(10, 60)),
}
GENERATORS = {"a": shared_system_prompts, "b": agent_sessions, "c": exact_retries, "d": few_shot}


def make_traces(quick: bool = False, seed: int = 0, vocab: int = 50_000, respond: Respond | None = None,
                output_len: tuple[int, int] | None = None, keys: str = "abcd") -> list[Trace]:
    """The benchmark's traces, (a)-(d). Full: the issue's sizes; quick: a CI-sized version."""
    params = QUICK if quick else FULL
    if respond is None:
        lengths = output_len or ((16, 160) if quick else (64, 384))
        respond = lambda prompt: synthetic_output(prompt, lengths, vocab)  # noqa: E731
    return [GENERATORS[k](respond, **params[k], seed=seed * 1000 + "abcd".index(k), vocab=vocab) for k in keys]
