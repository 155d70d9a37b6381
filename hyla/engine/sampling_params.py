"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's field names)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

GREEDY_BELOW = 1e-5  # temperature under which sampling is greedy (see SamplingParams.greedy)
MAX_BAD_WORD_SEQUENCES = 128  # token sequences bad_words may expand to (vLLM's VLLM_MAX_NUM_BAD_WORDS)
MAX_BAD_WORD_TOKENS = 1024  # their tokens in all (vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS)


class GuideMatcher(Protocol):
    """One sequence's place in a grammar (structured outputs); used by the engine loop only."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write row `index` of bitmask (int32 [M, ceil(V / 32)] on the CPU): bit j of word w set
        = token 32 w + j may come next (xgrammar's and llguidance's layout)."""

    def accept_token(self, token: int) -> bool:
        """Advance past `token`; False when the grammar does not allow it."""

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding checks a request's
        drafts against its grammar, then keeps only the tokens the verify step emitted)."""


class Guide(Protocol):
    """A compiled grammar that output must follow; every sequence gets its own matcher."""

    def matcher(self) -> GuideMatcher: ...


@dataclass
class SamplingParams:
    """Per-request sampling and stopping controls.

    temperature: 0 (or below GREEDY_BELOW = 1e-5) = greedy; otherwise scales the logits before
        sampling. Every number must be finite.
    top_p, top_k, min_p: nucleus, top-k (0 or -1 = off) and min-p filtering.
    seed: per-request seed; the same seed gives the same tokens whatever else is batched.
    max_tokens: new tokens to generate at most (None = up to the model's max length); 0 = prefill
        only: the request ends once its prompt is computed, with no token sampled (finish_reason
        "length"), as a request that only scores its prompt (prompt_logprobs) runs.
    stop: strings that end the output; the matched string is not emitted unless
        include_stop_str_in_output.
    stop_token_ids: extra token ids that end the output (emitted, as vLLM does).
    ignore_eos: keep generating past the EOS token.
    logprobs: when set, the top-n log-probabilities of every emitted token are returned.
    prompt_logprobs: when set, the log-probability of every prompt token after the first under
        the tokens before it, and the top-n there (vLLM's prompt_logprobs; the first token has
        none). Computed during prefill over every prompt position, so such a request does not
        take a prefix-cache hit (the positions a hit skips would have no logits).
    repetition_penalty (multiplicative, prompt + output), presence_penalty and frequency_penalty
    (additive, output only), as in vLLM / OpenAI.
    logit_bias: {token id: bias in [-100, 100]} added to the logits before any sampling rule
        (greedy too), as OpenAI's.
    guide: a compiled grammar (structured outputs) the output must follow: the tokens it does not
        allow are masked out of the logits before sampling, and the output ends when it is
        complete. Not combined with min_tokens or ignore_eos (the grammar decides the end).
    reasoning_end_token_ids: with a guide, the grammar waits for a reasoning model's end of
        thinking: it neither masks nor advances until the output's tokens end with this sequence
        (e.g. the ids of "</think>"), and applies from the token after it on (vLLM's structured
        outputs with a reasoning parser). The sequence is matched as these ids: the same text
        written with other tokens does not count. None: the grammar applies from the first token.
    allowed_token_ids: only these ids may be sampled (every other logit is masked to -inf, greedy
        too), as vLLM's; a non-empty list of ids inside the vocabulary (the engine checks the bound).
    bad_words: words that may not be generated (vLLM's rule): each word, and the word after a
        space, is tokenised (`resolve_bad_words`, done by the engine with its tokenizer); the last
        token of such a sequence is masked whenever the output ends with the tokens before it.
    priority: the request's place in the waiting queue under the engine's "priority" scheduling
        policy (lower first, arrival order among equals); must be 0 under "fcfs" (vLLM's rule).
    cache_salt: a non-empty string that keeps this request's prefix-cache entries apart (vLLM's
        cache_salt): it hits only what requests with the same salt filed, and what it files only
        they can hit; None shares the unsalted cache. A tenant's secret salt keeps another
        tenant from learning its prompts from hit timings.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    guide: Guide | None = None
    reasoning_end_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    cache_salt: str | None = None
    stop_strings: list[str] = field(init=False, repr=False)
    # bad_words as token sequences (resolve_bad_words); None until resolved or without bad_words
    bad_words_token_ids: list[list[int]] | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        def num(name, lo=None, hi=None, lo_open=False):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if lo is not None and (value <= lo if lo_open else value < lo):
                raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
            if hi is not None and value > hi:
                raise ValueError(f"{name} must be <= {hi}, got {value}")

        num("temperature", 0.0)
        num("top_p", 0.0, 1.0, lo_open=True)
        num("min_p", 0.0, 1.0)
        num("repetition_penalty", 0.0, lo_open=True)
        num("presence_penalty", -2.0, 2.0)
        num("frequency_penalty", -2.0, 2.0)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(1 << 63) <= self.seed < (1 << 64)):
            raise ValueError(f"seed must be an integer in -2^63..2^64-1, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in 0..20, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in 0..20, got {self.prompt_logprobs!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        self.stop_strings = stop
        ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {ids!r}")
        self.stop_token_ids = ids
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {t!r}")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias values must be numbers in -100..100, got {b!r} for token {t}")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        if self.guide is not None:
            if not callable(getattr(self.guide, "matcher", None)):
                raise ValueError(f"guide must be a compiled grammar with a matcher() method, got {self.guide!r}")
            if self.min_tokens or self.ignore_eos:
                raise ValueError("min_tokens and ignore_eos cannot be combined with structured outputs: the grammar "
                                 "decides where the output ends")
        if self.reasoning_end_token_ids is not None:
            ids = self.reasoning_end_token_ids
            if (not isinstance(ids, (list, tuple)) or not ids
                    or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
                raise ValueError(f"reasoning_end_token_ids must be a non-empty list of token ids, got {ids!r}")
            self.reasoning_end_token_ids = list(ids)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (not isinstance(ids, (list, tuple)) or not ids
                    or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            self.allowed_token_ids = sorted(set(ids))
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) or not w for w in words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r}")
            self.bad_words = list(dict.fromkeys(words)) or None
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")

    def resolve_bad_words(self, encode: Callable[[str], list[int]]) -> None:
        """Fill bad_words_token_ids from bad_words with `encode` (text -> ids, no special
        tokens), as vLLM's update_from_tokenizer: each word with its leading whitespace stripped,
        then the same after one space (the word in mid-text), the latter only when it tokenises
        to as many tokens as the former with a different first token (else it adds nothing).
        ValueError when a word tokenises to nothing or the sequences pass MAX_BAD_WORD_SEQUENCES
        / MAX_BAD_WORD_TOKENS."""
        if not self.bad_words:
            self.bad_words_token_ids = None
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            bare = list(encode(word.lstrip()))
            if not bare:
                raise ValueError(f"bad_words entry {word!r} tokenises to no token")
            sequences.append(bare)
            spaced = list(encode(" " + word.lstrip()))
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORD_SEQUENCES:
            raise ValueError(f"bad_words expand to {len(sequences)} token sequences; at most "
                             f"{MAX_BAD_WORD_SEQUENCES} are allowed")
        if sum(map(len, sequences)) > MAX_BAD_WORD_TOKENS:
            raise ValueError(f"bad_words expand to more than {MAX_BAD_WORD_TOKENS} tokens")
        self.bad_words_token_ids = sequences

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW (1e-5, vLLM's rule) decode greedily: dividing the
        logits by a tinier one overflows, and the distribution is a point mass anyway."""
        return self.temperature < GREEDY_BELOW
