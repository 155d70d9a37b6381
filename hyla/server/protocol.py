"""OpenAI-compatible request bodies (pydantic) and their translation to SamplingParams.

Every field OpenAI or vLLM defines is honoured or refused: those whose effect hyla does not
implement (NOT_IMPLEMENTED, and values outside what it runs) get a 400 that names them. Fields that
only label a request, with no effect on its answer, are accepted as such: user, metadata, store,
service_tier, safety_identifier, prompt_cache_key, and OpenAI's prediction (predicted output only
speeds up an answer that stays the same). Other unknown fields are ignored (clients send many).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from hyla.engine.sampling_params import SamplingParams
from hyla.server.errors import UnsupportedParameter
from hyla.server.structured_protocol import StructuredFields

MAX_STOP = 16
MAX_CHOICES = 16  # n and best_of: sequences one request may run
MAX_PROMPTS = 256  # prompts one /v1/completions request may batch (vLLM has no bound)
MAX_REQUEST_ID = 256  # characters of a client's request id (request_id, or the X-Request-Id header)
REQUEST_ID = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: it goes into ids, logs and headers
MAX_CACHE_SALT = 1024
_SEED_RANGE = 1 << 64  # torch seeds are -2^63..2^64-1


def child_seed(seed: int | None, i: int) -> int | None:
    """Sequence i of a request with n > 1 draws with seed + i (vLLM's rule), wrapped into the
    range torch takes: distinct, and reproducible from the one seed."""
    if seed is None:
        return None
    s = seed + i
    return s - _SEED_RANGE if s >= _SEED_RANGE else s


# Request fields defined by OpenAI or vLLM, not implemented here: a 400 naming the field rather than
# silence when the client gave it a value (null, or an empty list or object, asks for nothing, except
# for ASKS_WHEN_EMPTY: OpenAI's `web_search_options: {}` turns search on with its defaults)
NOT_IMPLEMENTED = {
    "functions": "functions (the deprecated form of tools) is not supported: send tools",
    "function_call": "function_call (the deprecated form of tool_choice) is not supported: send tool_choice",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported",
    "logits_processors": "logits_processors is not supported: hyla loads no code named by a request",
    "prompt_embeds": "prompt_embeds is not supported: send text or token ids",
    "kv_transfer_params": "kv_transfer_params is not supported: hyla has no disaggregated prefill",
    "vllm_xargs": "vllm_xargs is not supported: no extension of this server reads them",
    "audio": "audio output is not supported: this server answers in text",
    "web_search_options": "web_search_options is not supported: this server does not search the web",
    "verbosity": "verbosity is not supported: the model's answers follow the prompt alone",
}
ASKS_WHEN_EMPTY = ("audio", "web_search_options")
GUIDED_BACKENDS = (None, "auto", "xgrammar")  # the structured-output backend hyla runs


@dataclass
class Plan:
    """What to run for one HTTP request: the sequences' params (one per choice or candidate) and,
    for best_of, how many of the candidates to return (the highest cumulative logprob first);
    truncate_prompt_tokens: keep only the prompt's last tokens (`prompt_ids`)."""

    params: list[SamplingParams]
    keep: int | None = None
    strip_logprobs: bool = False  # logprobs were switched on only to rank best_of candidates
    truncate_prompt_tokens: int | None = None

    def prompt_ids(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt the sequences run on: with truncate_prompt_tokens k, its last k tokens
        (vLLM's rule: k may not exceed max_model_len - max_tokens, the room the output leaves;
        -1 keeps that many; 0 keeps none, which the engine then refuses as an empty prompt)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        room = max_model_len - (self.params[0].max_tokens or 0)
        if k > room:
            raise UnsupportedParameter("truncate_prompt_tokens", f"truncate_prompt_tokens={k} cannot be greater "
                                       f"than max_model_len - max_tokens = {room}: ask for a smaller truncation")
        keep = room if k == -1 else k
        return ids[-keep:] if keep else []


def fan_out(params: SamplingParams, n: int) -> list[SamplingParams]:
    return [dataclasses.replace(params, seed=child_seed(params.seed, i)) for i in range(n)]


def refuse_stream_obfuscation(options: dict) -> None:
    """OpenAI's stream_options.include_obfuscation (random padding in each event) is not
    implemented: true is a 400 on every route that streams (false or absent asks for nothing)."""
    if options.get("include_obfuscation"):
        raise UnsupportedParameter("stream_options.include_obfuscation", "stream obfuscation is not supported "
                                   "(send include_obfuscation false or leave it out)")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk (with include_usage)

    def given(self) -> bool:
        """Whether the client wrote anything in it: vLLM accepts an empty `{}` without stream."""
        return bool(self.model_fields_set or self.model_extra)


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
    best_of: int | None = None  # candidates to sample, of which the n best are returned (`choose`)
    # completions: the prompt in front of each choice; chat (vLLM's): the final message's text in
    # front of the reply when that message is the assistant's (hyla.server.choices.EchoedChat)
    echo: bool = False
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
    # vLLM's extra sampling fields
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words the output may not contain (SamplingParams.bad_words)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the prompt's last k tokens (-1: all that fit)
    priority: int = 0  # lower runs first; needs the server's --scheduling-policy priority
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:N"
    use_beam_search: bool = False  # refused when true: hyla has no beam search
    length_penalty: float = 1.0  # beam search's: refused unless 1
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs and the top-n at each

    # vLLM's; its rule for the tokenizers hyla loads (`tokenizers`' fast ones, tiktoken): no effect
    # either way (only a slow tokenizer puts spaces between special tokens), so both values hold
    spaces_between_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the response
    # vLLM's: the response's id is named after it (hyla.server.prepare.request_ids)
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID, pattern=f"^{REQUEST_ID.pattern}$")
    # vLLM's: a prefix-cache tree of the salt's own (SamplingParams.cache_salt)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)

    def _reject_unimplemented(self) -> None:
        extra = self.model_extra or {}
        for name, message in NOT_IMPLEMENTED.items():
            value = extra.get(name)
            if value is not None and (name in ASKS_WHEN_EMPTY or value not in ([], {})):
                raise UnsupportedParameter(name, message)
        if extra.get("guided_decoding_backend") not in GUIDED_BACKENDS:
            raise UnsupportedParameter("guided_decoding_backend", "guided_decoding_backend must be \"xgrammar\" "
                                       "(or \"auto\"), the structured-output backend this server runs; got "
                                       f"{extra['guided_decoding_backend']!r}")
        modalities = extra.get("modalities")
        if modalities is not None and (not isinstance(modalities, list) or any(m != "text" for m in modalities)):
            raise UnsupportedParameter("modalities", f'modalities must be ["text"] (this server answers in '
                                       f"text), got {modalities!r}")
        if self.use_beam_search:
            raise UnsupportedParameter("use_beam_search", "use_beam_search is not supported: hyla has no beam "
                                       "search (sample n or best_of candidates instead)")
        if self.length_penalty != 1.0:
            raise UnsupportedParameter("length_penalty", "length_penalty applies to beam search, which hyla "
                                       "does not implement")

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

    def _prompt_logprobs(self) -> int | None:
        """How many top tokens the engine scores at each prompt position (None: none)."""
        return self.prompt_logprobs

    def _prefill_only(self) -> bool:
        """Whether max_tokens 0 is allowed: the request wants its prompt alone."""
        return False

    def _check_prompt_logprobs(self) -> None:
        """vLLM's rules for the prompt_logprobs field (the engine bounds it to 0..20)."""
        if self.prompt_logprobs is None:
            return
        if self.prompt_logprobs == -1:
            raise UnsupportedParameter("prompt_logprobs", "prompt_logprobs -1 (the whole vocabulary at every "
                                       "position) is not supported: at most 20")
        if self.stream and self.prompt_logprobs > 0:
            raise UnsupportedParameter("prompt_logprobs", "prompt_logprobs are not available when stream is true")

    def choose(self, params: SamplingParams) -> Plan:
        """n sequences of params; with best_of, best_of candidates of which the n with the
        highest cumulative logprob are returned (ranking needs each token's logprob: asked for
        internally and dropped from the answer when the client did not ask)."""
        best_of = self.best_of if self.best_of is not None else self.n
        if not self.n <= best_of <= MAX_CHOICES:
            raise UnsupportedParameter("best_of", f"best_of must be in n..{MAX_CHOICES} (n={self.n}), got {best_of}")
        if best_of == self.n:
            return Plan(fan_out(params, self.n), truncate_prompt_tokens=self.truncate_prompt_tokens)
        if self.stream:
            raise UnsupportedParameter("best_of", "best_of > n cannot be streamed (the best are known only at the end)")
        strip = params.logprobs is None
        if strip:
            params = dataclasses.replace(params, logprobs=0)
        return Plan(fan_out(params, best_of), keep=self.n, strip_logprobs=strip,
                    truncate_prompt_tokens=self.truncate_prompt_tokens)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self._reject_unimplemented()
        if max_tokens is not None and max_tokens < 1 and not (max_tokens == 0 and self._prefill_only()):
            raise UnsupportedParameter("max_tokens", f"max_tokens must be at least 1, got {max_tokens} (0 only "
                                       "with echo on /v1/completions: the prompt alone)")
        self._check_prompt_logprobs()
        if self.stream_options is not None and self.stream_options.given() and not self.stream:
            raise UnsupportedParameter("stream_options", "stream_options is only allowed when stream is true")
        if self.stream_options is not None:
            refuse_stream_obfuscation(self.stream_options.model_extra or {})
        if not 1 <= self.n <= MAX_CHOICES:
            raise UnsupportedParameter("n", f"n must be in 1..{MAX_CHOICES}, got {self.n}")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stop) > MAX_STOP:
            raise UnsupportedParameter("stop", f"at most {MAX_STOP} stop sequences are allowed")
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
                max_tokens=max_tokens, stop=stop or None, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=self._prompt_logprobs(),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self._logit_bias(),
                allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words, priority=self.priority,
                cache_salt=self.cache_salt,
            )
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            raise UnsupportedParameter(param, str(e)) from None


class CompletionRequest(SamplingRequest):
    # one prompt (text or token ids) or a batch of them (texts or token-id lists)
    prompt: str | list[int] | list[str] | list[list[int]] = Field(...)
    max_tokens: int | None = 16  # 0 with echo: the prompt alone, nothing generated
    logprobs: int | None = None  # with echo, the prompt's tokens' too (the first one's null)
    suffix: str | None = None

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """(the prompts, whether the request sent a batch: a list of texts or of token-id lists,
        each prompt answered with its own choices)."""
        batch = isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)
        if not batch:
            return [self.prompt], False
        if len(self.prompt) > MAX_PROMPTS:
            raise UnsupportedParameter("prompt", f"a batch holds at most {MAX_PROMPTS} prompts, got "
                                       f"{len(self.prompt)}")
        return list(self.prompt), True

    def _prompt_logprobs(self) -> int | None:
        # echo with logprobs shows the prompt's tokens with theirs (vLLM: prompt_logprobs, when the
        # request leaves it unset, takes logprobs' value under echo)
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def _prefill_only(self) -> bool:
        return self.echo

    def to_params(self) -> SamplingParams:
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix is not supported")
        return self.sampling_params(self.max_tokens, self.logprobs)

    def plan(self) -> Plan:
        return self.choose(self.to_params())
