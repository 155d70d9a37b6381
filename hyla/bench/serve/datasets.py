"""The requests a benchmark sends (`--dataset-name`), deterministic for a given `--seed`.

- random: vLLM's random dataset. Per request an input length from
  [floor(L (1 - r)), ceil(L (1 + r))] (L = --random-input-len less the tokens the tokenizer adds
  around a text, r = --random-range-ratio) and an output length likewise from
  --random-output-len (at least 1); the prompt is a shared random prefix of --random-prefix-len
  tokens, then consecutive pool ids from a random offset (vLLM's form, over a whole vocabulary)
  or, from a pool under CONSECUTIVE_MIN_POOL ids (the server's tokenizer knows only WORDS' ids;
  no tokenizer), ids drawn one by one: consecutive runs of a small pool repeat, and requests
  starting at the same offset would be the same prompt, served from the prefix cache.
- sharegpt: a local ShareGPT JSON file (a list of {"conversations": [{"from": "human" | "gpt",
  "value": text}, ...]}): the first human turn is the prompt, the reply after it sets the output
  length (--sharegpt-output-len overrides it). As in vLLM: entries are shuffled, pairs with fewer
  than 4 prompt or output tokens, a prompt over 1024 tokens or more than 2048 in all are skipped,
  and too few samples are topped up by drawing again from those kept (unless --no-oversample).
- prefix: --num-prefixes shared prefixes of --prefix-len tokens (a chat request's system
  message), each request one of them (round robin) + its own --suffix-len token question (vLLM's
  prefix_repetition, with exactly --num-prompts requests).
- agent: --num-sessions sessions of --turns chat turns; each turn's user message is a tool output
  (--tool-output-len tokens) and a new question (--question-len), sent after the previous turns
  and the model's replies to them, so the prefix cache can serve each session's history. Every
  request of a session carries the same system message: --agent-system-len tokens shared by all
  sessions (an agent's instructions and tool definitions), then --agent-session-prefix-len tokens
  of the session's own (its task and context): the two prefixes of vLLM's multi-turn benchmark
  (common_prefix_num_tokens, prefix_num_tokens).

Lengths are in the tokenizer's tokens when there is one (tokens.fit_text makes the texts exact),
else see tokens.PromptMaker.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyla.bench.serve.tokens import PromptMaker, PromptTokenizer, num_special_tokens

DATASETS = ("random", "sharegpt", "prefix", "agent")
SHAREGPT_HUMAN = ("human", "user")
# vLLM's is_valid_sequence bounds for ShareGPT pairs
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048
# Pools at least this large (a vocabulary) take vLLM's consecutive ids: two of 1,000 requests then
# start at the same id with probability ~1e-3 per pair at 32K ids; smaller pools draw each id.
CONSECUTIVE_MIN_POOL = 32768


@dataclass(frozen=True)
class SampleRequest:
    """One request. prompt: the completions prompt (text or token ids), or a chat request's user
    message; prompt_len: its tokens as the dataset counted them (the server's usage, when it
    reports one, replaces it); expected_output_len: max_tokens; system: a chat request's system
    message (the prefix dataset's shared prefix), else None."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    system: str | None = None


@dataclass(frozen=True)
class Conversation:
    """Requests sent one after another; a chat request carries the ones before it and the model's
    replies as its history. An agent session; every other dataset's request is one alone."""

    requests: tuple[SampleRequest, ...]


@dataclass
class DatasetSpec:
    """The dataset flags (their vLLM defaults)."""

    name: str = "random"
    num_prompts: int = 1000
    seed: int = 0
    shuffle: bool = True
    oversample: bool = True
    path: str | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    prefix_output_len: int = 128
    num_sessions: int = 8
    turns: int = 5
    tool_output_len: int = 256
    question_len: int = 32
    agent_output_len: int = 64
    agent_range_ratio: float = 0.0
    agent_system_len: int = 0
    agent_session_prefix_len: int = 0


def check_range_ratio(flag: str, ratio: float) -> None:
    """A length range ratio (--random-range-ratio, --agent-range-ratio) must lie in [0, 1)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"{flag} must be in [0, 1), got {ratio}")


def length_bounds(n: int, ratio: float, least: int = 1) -> tuple[int, int]:
    """The inclusive range [floor(n(1 - ratio)), ceil(n(1 + ratio))] lengths are drawn from around
    n, as vLLM's --random-range-ratio, neither end below `least`."""
    return max(least, math.floor(n * (1 - ratio))), max(least, math.ceil(n * (1 + ratio)))


def random_requests(spec: DatasetSpec, maker: PromptMaker, rng: np.random.Generator) -> list[SampleRequest]:
    r = spec.random_range_ratio
    check_range_ratio("--random-range-ratio", r)
    real_input_len = max(0, spec.random_input_len - num_special_tokens(maker.tokenizer))
    input_low, input_high = length_bounds(real_input_len, r, least=0)
    output_low, output_high = length_bounds(spec.random_output_len, r)
    if spec.random_prefix_len + input_low < 1:
        raise ValueError(f"--random-input-len {spec.random_input_len} with --random-range-ratio {r} and "
                         f"--random-prefix-len {spec.random_prefix_len} can make an empty prompt")
    n, pool = spec.num_prompts, maker.pool
    input_lens = rng.integers(input_low, input_high + 1, n)
    output_lens = rng.integers(output_low, output_high + 1, n)
    offsets = rng.integers(0, len(pool), n)
    prefix = maker.random_ids(rng, spec.random_prefix_len)
    requests = []
    consecutive = len(pool) >= CONSECUTIVE_MIN_POOL
    for i in range(n):
        if consecutive:
            inner = pool[(offsets[i] + i + np.arange(input_lens[i])) % len(pool)].tolist()
        else:
            inner = maker.random_ids(rng, int(input_lens[i]))
        prompt, prompt_len = maker.render(prefix + inner, rng)
        requests.append(SampleRequest(prompt, prompt_len, int(output_lens[i])))
    return requests


def _sharegpt_pair(conversation) -> tuple[str, str] | None:
    """(the first human turn, the reply after it), or None when the entry has no such pair."""
    if not isinstance(conversation, list):
        return None
    for turn, reply in itertools.pairwise(conversation):
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            return None
        if turn.get("from") in SHAREGPT_HUMAN:
            if reply.get("from") in SHAREGPT_HUMAN or not isinstance(turn.get("value"), str) \
                    or not isinstance(reply.get("value"), str):
                return None
            return turn["value"], reply["value"]
    return None


def sharegpt_requests(spec: DatasetSpec, tokenizer: PromptTokenizer | None) -> list[SampleRequest]:
    if spec.path is None:
        raise ValueError("the sharegpt dataset needs --dataset-path (a ShareGPT JSON file)")
    if tokenizer is None:
        raise ValueError("the sharegpt dataset counts its turns' tokens with a tokenizer: pass --tokenizer "
                         "(the served model's could not be found)")
    try:
        entries = json.loads(Path(spec.path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset-path {spec.path}: {e}") from None
    if not isinstance(entries, list):
        raise ValueError(f"--dataset-path {spec.path} is not a ShareGPT file: expected a JSON list of "
                         '{"conversations": [...]} entries')
    entries = [e for e in entries if isinstance(e, dict) and len(e.get("conversations") or ()) >= 2]
    if spec.shuffle:
        random.Random(spec.seed).shuffle(entries)
    requests: list[SampleRequest] = []
    for entry in entries:
        if len(requests) == spec.num_prompts:
            break
        pair = _sharegpt_pair(entry["conversations"])
        if pair is None:
            continue
        prompt_len = len(tokenizer.encode(pair[0], add_special_tokens=True))
        reply_len = len(tokenizer.encode(pair[1]))
        output_len = reply_len if spec.sharegpt_output_len is None else spec.sharegpt_output_len
        # an output length given on the command line is never too short
        too_short = prompt_len < SHAREGPT_MIN_LEN or (
            spec.sharegpt_output_len is None and output_len < SHAREGPT_MIN_LEN)
        if too_short or prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        requests.append(SampleRequest(pair[0], prompt_len, output_len))
    if not requests:
        raise ValueError(f"--dataset-path {spec.path}: no conversation has a usable human turn and reply")
    if spec.oversample and len(requests) < spec.num_prompts:
        requests += random.Random(spec.seed).choices(requests, k=spec.num_prompts - len(requests))
    return requests


def prefix_requests(spec: DatasetSpec, maker: PromptMaker, rng: np.random.Generator,
                    chat: bool) -> list[SampleRequest]:
    if spec.num_prefixes > spec.num_prompts:
        raise ValueError(f"--num-prefixes ({spec.num_prefixes}) must not exceed --num-prompts ({spec.num_prompts})")
    prefixes = [maker.render(maker.random_ids(rng, spec.prefix_len), rng) for _ in range(spec.num_prefixes)]
    requests = []
    for i in range(spec.num_prompts):
        prefix, prefix_len = prefixes[i % spec.num_prefixes]
        suffix, suffix_len = maker.render(maker.random_ids(rng, spec.suffix_len), rng)
        if chat:
            requests.append(SampleRequest(suffix, prefix_len + suffix_len, spec.prefix_output_len, system=prefix))
        else:
            requests.append(SampleRequest(maker.join(prefix, suffix), prefix_len + suffix_len, spec.prefix_output_len))
    if spec.shuffle:
        requests = [requests[i] for i in rng.permutation(len(requests))]
    return requests


def agent_sessions(spec: DatasetSpec, maker: PromptMaker, rng: np.random.Generator) -> list[Conversation]:
    """num_sessions conversations of `turns` requests: each turn is a tool output and a new
    question after the conversation so far (the client sends the history), under the session's
    system message (the shared agent_system_len tokens, then agent_session_prefix_len of its own;
    none when both are 0). With agent_range_ratio r each session prefix's and each turn's tool
    output, question and reply lengths are drawn uniformly from [n(1 - r), n(1 + r)] around their
    flags' n (r = 0: every turn the same sizes, so sessions that start together stay in step)."""
    r = spec.agent_range_ratio
    check_range_ratio("--agent-range-ratio", r)

    def length(n: int) -> int:
        if not r:  # no draw: the seeded traces of r = 0 stay those of the runs before the flag
            return n
        low, high = length_bounds(n, r)
        return int(rng.integers(low, high + 1))

    shared, shared_len = maker.render(maker.random_ids(rng, spec.agent_system_len), rng)
    sessions = []
    for _ in range(spec.num_sessions):
        own, own_len = maker.render(maker.random_ids(rng, length(spec.agent_session_prefix_len))
                                    if spec.agent_session_prefix_len else [], rng)  # no draw without one
        system = maker.join(shared, own) if shared_len + own_len else None
        turns, history_len = [], shared_len + own_len
        for _ in range(spec.turns):
            tool, tool_len = maker.render(maker.random_ids(rng, length(spec.tool_output_len)), rng)
            question, question_len = maker.render(maker.random_ids(rng, length(spec.question_len)), rng)
            output_len = length(spec.agent_output_len)
            turn_len = tool_len + question_len
            turns.append(SampleRequest(maker.join(tool, question), history_len + turn_len, output_len, system=system))
            history_len += turn_len + output_len
        sessions.append(Conversation(tuple(turns)))
    return sessions


def build_workload(spec: DatasetSpec, tokenizer: PromptTokenizer | None, chat: bool) -> list[Conversation]:
    """The benchmark's conversations, in the order they arrive. chat: the requests go to
    /v1/chat/completions (prompts must be text)."""
    rng = np.random.default_rng(spec.seed)
    if spec.name == "sharegpt":
        return [Conversation((r,)) for r in sharegpt_requests(spec, tokenizer)]
    maker = PromptMaker(tokenizer, text=chat)
    if spec.name == "random":
        return [Conversation((r,)) for r in random_requests(spec, maker, rng)]
    if spec.name == "prefix":
        return [Conversation((r,)) for r in prefix_requests(spec, maker, rng, chat)]
    if spec.name == "agent":
        if not chat:
            raise ValueError("the agent dataset sends chat requests: use --backend openai-chat "
                             "(--endpoint /v1/chat/completions)")
        return agent_sessions(spec, maker, rng)
    raise ValueError(f"unknown dataset {spec.name!r}; choose from {', '.join(DATASETS)}")
