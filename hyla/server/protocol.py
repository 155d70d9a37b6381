"""OpenAI-compatible request bodies (pydantic) and their translation to SamplingParams.

Unknown fields are accepted and ignored (clients send many), except those whose value would
change the result in a way hyla does not implement: those are rejected with a 400 that names them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from hyla.engine.sampling_params import SamplingParams
from hyla.server.errors import UnsupportedParameter
from hyla.server.structured_protocol import StructuredFields

MAX_STOP = 16
MAX_CHOICES = 16  # n and best_of: sequences one request may run
_SEED_RANGE = 1 << 64  # torch seeds are -2^63..2^64-1


def child_seed(seed: int | None, i: int) -> int | None:
    """Sequence i of a request with n > 1 draws with seed + i (vLLM's rule), wrapped into the
    range torch takes: distinct, and reproducible from the one seed."""
    if seed is None:
        return None
    s = seed + i
    return s - _SEED_RANGE if s >= _SEED_RANGE else s


@dataclass
class Plan:
    """What to run for one HTTP request: the sequences' params (one per choice or candidate) and,
    for best_of, how many of the candidates to return (the highest cumulative logprob first)."""

    params: list[SamplingParams]
    keep: int | None = None
    strip_logprobs: bool = False  # logprobs were switched on only to rank best_of candidates


def fan_out(params: SamplingParams, n: int) -> list[SamplingParams]:
    return [dataclasses.replace(params, seed=child_seed(params.seed, i)) for i in range(n)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(StructuredFields):
    # strict: no coercion of loose types (`max_tokens: true`, `stream: "yes"`, `prompt: [true]`);
    # no NaN / Infinity in any number field (named in the 400)
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    # accepted by OpenAI / vLLM, not implemented here: a 400 naming them rather than silence
    _NOT_IMPLEMENTED = ("prompt_logprobs", "functions", "function_call", "guided_whitespace_pattern")

    def _reject_unimplemented(self) -> None:
        for name in self._NOT_IMPLEMENTED:
            if (self.model_extra or {}).get(name) is not None:
                raise UnsupportedParameter(name, f"{name} is not supported")

    def apply_defaults(self, defaults: dict) -> None:
        """Take the checkpoint's generation_config.json defaults ({SamplingParams field: value},
        LLMEngine.generation_defaults) for every field this request left unset, as vLLM does;
        `max_tokens` counts as set when `max_completion_tokens` is."""
        for name, value in defaults.items():
            unset = name not in self.model_fields_set
            if name == "max_tokens":
                unset = unset and "max_completion_tokens" not in self.model_fields_set
            if unset and name in type(self).model_fields:
                self.__dict__[name] = value  # not marked as set by the client

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise UnsupportedParameter("logit_bias", "logit_bias keys must be token ids (integers as strings)") from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self._reject_unimplemented()
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameter("stream_options", "stream_options is only allowed when stream is true")
        if not 1 <= self.n <= MAX_CHOICES:
            raise UnsupportedParameter("n", f"n must be in 1..{MAX_CHOICES}, got {self.n}")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stop) > MAX_STOP:
            raise UnsupportedParameter("stop", f"at most {MAX_STOP} stop sequences are allowed")
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
                max_tokens=max_tokens, stop=stop or None, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, logprobs=logprobs, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self._logit_bias(),
            )
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            raise UnsupportedParameter(param, str(e)) from None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] = Field(...)
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompt_value(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise UnsupportedParameter("prompt", "a batch of prompts is not supported: send one request each")
            return self.prompt[0]
        return self.prompt

    def to_params(self) -> SamplingParams:
        if self.echo and self.logprobs is not None:
            raise UnsupportedParameter("echo", "echo with logprobs needs the prompt's logprobs, which hyla does not "
                                       "compute: send echo or logprobs, not both")
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix is not supported")
        return self.sampling_params(self.max_tokens, self.logprobs)

    def plan(self) -> Plan:
        """n sequences; with best_of, best_of candidates of which the n with the highest
        cumulative logprob are returned (ranking needs each token's logprob: asked for
        internally and dropped from the answer when the client did not ask)."""
        params = self.to_params()
        best_of = self.best_of if self.best_of is not None else self.n
        if not self.n <= best_of <= MAX_CHOICES:
            raise UnsupportedParameter("best_of", f"best_of must be in n..{MAX_CHOICES} (n={self.n}), got {best_of}")
        if best_of == self.n:
            return Plan(fan_out(params, self.n))
        if self.stream:
            raise UnsupportedParameter("best_of", "best_of > n cannot be streamed (the best are known only at the end)")
        strip = params.logprobs is None
        if strip:
            params = dataclasses.replace(params, logprobs=0)
        return Plan(fan_out(params, best_of), keep=self.n, strip_logprobs=strip)
