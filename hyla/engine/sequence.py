"""Sequence: one request's tokens, its place in the pools, and its output so far.

Ownership: a running sequence owns its state slots (`slot`, plus k spare ones in `spec_slots`
with speculative "slots" rollback, `slot` being one of them) and one reference to each KV page in
`block_table`; the Scheduler hands them out (from the engine's Pools) and takes them back.
`num_computed_tokens` counts the tokens whose KV and recurrent state are in those pools (a
prefix-cache hit starts it above 0). A preempted sequence gives everything back and recomputes
prompt + output so far later.
"""

from __future__ import annotations

import dataclasses
import enum
import time

import torch

from hyla.engine.block_table import BlockTable
from hyla.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from hyla.engine.sampling_params import SamplingParams
from hyla.engine.spec.acceptance import reaches_length, stop_ids, stopping_token


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, eos_token_ids: tuple[int, ...] | list[int] | int | None = (),
                 device: torch.device | str = "cpu"):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.max_tokens = max_tokens
        # Every id that ends the request unless ignore_eos: config.json's and generation_config.json's
        # eos_token_id (a list in GLM and Qwen releases) and the tokenizer's EOS (LLMEngine.eos_token_ids).
        if eos_token_ids is None:
            eos_token_ids = ()
        self.eos_token_ids = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)
        self.status = Status.WAITING
        self.slot: int | None = None  # the slot holding the state after num_computed_tokens tokens
        self.spec_slots: list[int] = []  # speculative "slots" rollback: 1 + k slots, `slot` is one of them
        self.block_table: list[int] = BlockTable()
        self.num_computed_tokens = 0
        self.pending_checkpoints: list[int] = []  # positions whose state the prefill exports
        # On the logits' device: the sampler draws a seeded request's noise there (no host sync).
        self.generator = (torch.Generator(device).manual_seed(params.seed) if params.seed is not None else None)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # prompt_logprobs[i]: prompt token i's logprob dict (None for token 0 and until computed)
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * len(self.prompt_token_ids) if params.prompt_logprobs is not None else None)
        self.prompt_token_ranks: list[int | None] | None = (
            [None] * len(self.prompt_token_ids) if params.prompt_logprobs is not None else None)
        self.num_cached_tokens = 0  # the prefix-cache hit it started with (set at its first admission)
        # Structured outputs: this sequence's place in the grammar (the sampler masks by it). With
        # reasoning_end_token_ids the matcher waits in guide_pending (no mask, nothing accepted:
        # the grammar constrains the answer, not the thinking) until the output ends with them.
        matcher = params.guide.matcher() if params.guide is not None else None
        waits = matcher is not None and params.reasoning_end_token_ids is not None
        self.guide = None if waits else matcher
        self.guide_pending = matcher if waits else None
        self.text = ""
        # Incremental detokenisation (the tokenizer's decode_stream, made on the first check_stop);
        # it has seen _num_decoded outputs.
        self._decoder = None
        self._num_decoded = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.times = RequestMetrics(arrival_time=time.monotonic())  # the scheduler and append_token fill it in
        self.suspect = False  # was in a failed batch: runs alone until it succeeds (LLMEngine.recover)

    # ---- token bookkeeping -------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_range(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] (0 <= start <= stop) without building token_ids: a step's
        bookkeeping reads a few tokens of a long context."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    def token_at(self, i: int) -> int:
        """token_ids[i] (0 <= i < num_tokens) without building token_ids."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def last_token_id(self) -> int:
        """The newest token (without building token_ids)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens to feed the model before the next sample (the last token is always fed)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def append_token(self, token: int, logprobs: dict[int, float] | None) -> None:
        if self.guide is not None:
            # the sampler only draws allowed tokens, so a refusal is a server bug: check_stop ends
            # the request with the error (a server failure), the others go on
            try:
                accepted = self.guide.accept_token(token)
            except Exception as e:  # noqa: BLE001 - the matcher's failure is this request's alone
                accepted, self.error = False, f"the grammar matcher failed: {type(e).__name__}: {e}"
            if not accepted and self.error is None:
                self.error = f"token {token} is not allowed by the request's grammar"
        self.output_token_ids.append(token)
        now = time.monotonic()
        if self.times.first_token_time is None:
            self.times.first_token_time = now
        self.times.last_token_time = now
        if self.guide_pending is not None:
            end = self.params.reasoning_end_token_ids
            if self.output_token_ids[-len(end):] == end:  # the grammar applies from the next token
                self.guide, self.guide_pending = self.guide_pending, None
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)

    def guide_waits_for(self, drafts: list[int]) -> int | None:
        """While the grammar is pending (speculative decoding checks drafts against it): how many
        of `drafts`, tokens that may follow the output, come before it applies, i.e. up to and
        including the one that completes the reasoning end marker; None when they do not."""
        end = self.params.reasoning_end_token_ids
        seen = self.output_token_ids[-len(end):] + list(drafts)
        for j in range(1, len(drafts) + 1):
            k = len(seen) - len(drafts) + j  # the tokens up to draft j
            if k >= len(end) and seen[k - len(end):k] == end:
                return j
        return None

    # ---- stopping ----------------------------------------------------------------------------
    def check_stop(self, tokenizer) -> None:
        """After a token was appended: update the text and decide whether the request is done.
        Stop strings are matched on the decoded text and cut out; stop / EOS tokens are checked
        on ids. The text is held back while it ends in an incomplete UTF-8 sequence. The stop
        rule's host form (hyla.engine.spec.acceptance holds its device form beside it)."""
        token = self.output_token_ids[-1]
        p = self.params
        n_out = len(self.output_token_ids)
        before = len(self.text)  # everything past this was decoded now (one token, or held-back ones)
        if tokenizer is not None:
            self._detokenize(tokenizer)
        if self.error is not None:
            return self.finish("error")
        if self.guide is not None and self.guide.is_terminated():  # the grammar is complete (its stop token came)
            return self.finish("stop", token, drop_text_of_last=True, tokenizer=tokenizer)
        by_id = stopping_token(p, self.eos_token_ids, token, n_out)
        if by_id == "eos":
            return self.finish("stop", token, drop_text_of_last=True, tokenizer=tokenizer)
        if by_id == "stop":
            return self.finish("stop", token)
        if n_out >= p.min_tokens:
            for s in p.stop_strings:
                # Only the newly decoded text can complete a stop string: search from where a match
                # ending in it may start (a token can hold a stop string and more, e.g. "\n" + spaces).
                at = self.text.find(s, max(0, before - len(s) + 1))
                if at >= 0:
                    self.text = self.text[:at + len(s)] if p.include_stop_str_in_output else self.text[:at]
                    return self.finish("stop", s)
        if reaches_length(n_out, self.max_tokens):
            self.finish("length")

    def stop_ids(self) -> list[int]:
        """The token ids check_stop ends the request on (once past min_tokens): EOS unless
        ignore_eos, then stop_token_ids (hyla.engine.spec.acceptance.stop_ids; the overlapped
        MTP step applies the same rule on the device)."""
        return stop_ids(self.params, self.eos_token_ids)

    def _detokenize(self, tokenizer) -> None:
        """Append the text of the output tokens not yet decoded. The tokenizer's decode_stream
        decodes each new token together with the ones before it (a byte-level character split
        over two tokens, or spaces a decoder adds between tokens, depend on that left context)
        and returns nothing while the text ends in an incomplete UTF-8 sequence; the token that
        completes it returns all of it. tokenizer: hyla's (hyla.models.tokenizer.BaseTokenizer)."""
        ids = self.output_token_ids
        skip = self.params.skip_special_tokens
        if self._decoder is None:
            self._decoder = tokenizer.decode_stream(skip)
        for i in range(self._num_decoded, len(ids)):
            try:
                self.text += self._decoder.step(ids[i]) or ""
            except Exception:  # noqa: BLE001 - its InvalidPrefix must not fail the engine's step
                # A decoder whose clean-up rewrites text left of the new token (e.g. WordPiece's):
                # take the full decode as the text, and go on from a stream primed with every id.
                self.text = tokenizer.decode(ids[: i + 1], skip_special_tokens=skip).rstrip("\ufffd")
                self._decoder = tokenizer.decode_stream(skip, ids=ids[: i + 1])
        self._num_decoded = len(ids)

    def finish(self, reason: str, stop_reason=None, drop_text_of_last: bool = False, tokenizer=None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.status = Status.FINISHED
        if drop_text_of_last and tokenizer is not None and not self.params.skip_special_tokens:
            self.text = tokenizer.decode(self.output_token_ids[:-1], skip_special_tokens=False)

    def visible_text(self) -> str:
        """Text safe to stream now: a tail that could still grow into a stop string is held back."""
        if self.is_finished or not self.params.stop_strings:
            return self.text
        hold = 0
        for s in self.params.stop_strings:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return self.text[: len(self.text) - hold]

    def to_output(self) -> RequestOutput:
        """The request's output so far (cumulative). Its prompt_token_ids is the request's own list,
        not a copy (never changed after the request was made; a copy of a 1K-token prompt per
        request per step was the largest host cost of an output at batch 256)."""
        completion = CompletionOutput(
            index=0, text=self.visible_text(), token_ids=list(self.output_token_ids),
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
        )
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             finished=self.is_finished, error=self.error,
                             prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
                             prompt_token_ranks=(None if self.prompt_token_ranks is None
                                                 else list(self.prompt_token_ranks)),
                             num_cached_tokens=self.num_cached_tokens,
                             metrics=dataclasses.replace(self.times) if self.is_finished else None)
