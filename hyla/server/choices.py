"""How one sequence's output becomes a choice: legacy completions and chat (ChoiceBuilders).

A builder is made per choice index and remembers what it has streamed, so each chunk carries
only what is new since the last one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hyla.engine.outputs import CompletionOutput, RequestOutput
from hyla.server.logprobs import chat_logprobs, completion_logprobs
from hyla.server.reasoning_parsers import RequestReasoning

if TYPE_CHECKING:
    from hyla.server.generate import ChoiceBuilder


def echoed(out: RequestOutput, prompt_text: str) -> CompletionOutput:
    """What a /v1/completions choice with echo shows of a sequence's output (vLLM's rule): the
    prompt's text, token ids and logprobs (None for its first token) in front of the output's.
    Logprobs only when the sequence has them (then its prompt logprobs were computed too)."""
    c = out.outputs[0]
    ids = out.prompt_token_ids
    logprobs = None
    if c.logprobs is not None:
        logprobs = [*(out.prompt_logprobs or [None] * len(ids)), *c.logprobs]
    return dataclasses.replace(c, text=prompt_text + c.text, token_ids=[*ids, *c.token_ids], logprobs=logprobs)


class CompletionChoice:
    """/v1/completions. n_top: None unless logprobs were asked for. The output it is given is
    the choice's whole text and tokens (with echo, `echoed` puts the prompt in front)."""

    def __init__(self, index: int, tokenizer, n_top: int | None):
        self.index, self.tokenizer, self.n_top = index, tokenizer, n_top
        self.sent_text = self.sent_tokens = 0
        self.sent_offset = 0  # text_offset of the next token to stream: its tokens' texts so far

    def _logprobs(self, c: CompletionOutput, start: int, offset: int):
        if self.n_top is None:
            return None
        return completion_logprobs(self.tokenizer, c, start, self.n_top, offset)

    def whole(self, c: CompletionOutput) -> dict:
        return {"index": self.index, "text": c.text, "finish_reason": c.finish_reason,
                "logprobs": self._logprobs(c, 0, 0)}

    def delta(self, c: CompletionOutput) -> dict | None:
        logprobs = self._logprobs(c, self.sent_tokens, self.sent_offset)
        if logprobs is not None and logprobs["tokens"]:
            self.sent_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        choice = {"index": self.index, "text": c.text[self.sent_text:], "finish_reason": c.finish_reason,
                  "logprobs": logprobs}
        self.sent_text, self.sent_tokens = len(c.text), len(c.token_ids)
        return choice

    def opening(self) -> None:
        return None


class ChatChoice:
    """/v1/chat/completions without tool parsing: the text is the message's content.

    reasoning: with a --reasoning-parser, how the text splits into reasoning and content; the
    message then has `reasoning` and `reasoning_content` (the same text: vLLM's current and
    former names), streamed as delta.reasoning / delta.reasoning_content, and the subclasses'
    rules (tool calls) read the content only. The builders with tools override `_message` and
    `_delta`, which see the content alone."""

    def __init__(self, index: int, tokenizer, n_top: int | None, reasoning: RequestReasoning | None = None):
        self.index, self.tokenizer, self.n_top = index, tokenizer, n_top
        self.reasoning = reasoning
        self.stream = reasoning.stream() if reasoning is not None else None
        self.sent_text = self.sent_tokens = 0  # content characters and tokens streamed

    def _logprobs(self, c: CompletionOutput, start: int):
        return None if self.n_top is None else chat_logprobs(self.tokenizer, c, start, self.n_top)

    def whole(self, c: CompletionOutput) -> dict:
        if self.reasoning is None:
            reasoning, content = None, c.text
        else:
            reasoning, content = self.reasoning.split(c.text)
        message, finish_reason = self._message(content, c)
        if self.reasoning is not None:
            shown = reasoning if self.reasoning.include else None
            message["reasoning"] = message["reasoning_content"] = shown
        return {"index": self.index, "message": message, "finish_reason": finish_reason,
                "logprobs": self._logprobs(c, 0)}

    def delta(self, c: CompletionOutput) -> dict | None:
        finished = c.finish_reason is not None
        if self.stream is None:
            reasoning, content = "", c.text
        else:
            reasoning, content = self.stream.step(c.text, finished)
        fields, finish_reason = self._delta(content, c)
        if reasoning and self.reasoning.include:
            fields = {"reasoning": reasoning, "reasoning_content": reasoning, **fields}
        if not (fields or finished):
            return None
        choice = {"index": self.index, "delta": fields, "finish_reason": finish_reason,
                  "logprobs": self._logprobs(c, self.sent_tokens)}
        self.sent_tokens = len(c.token_ids)
        return choice

    def _message(self, content: str | None, c: CompletionOutput) -> tuple[dict, str | None]:
        """The whole message (role, content, tool calls) from the content, and the finish reason."""
        return {"role": "assistant", "content": content}, c.finish_reason

    def _delta(self, content: str, c: CompletionOutput) -> tuple[dict, str | None]:
        """What the content so far adds to the stream (delta fields, possibly none), and the
        chunk's finish reason."""
        delta = {"content": content[self.sent_text:]} if len(content) > self.sent_text else {}
        self.sent_text = max(self.sent_text, len(content))
        return delta, c.finish_reason

    def opening(self) -> dict:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}


class EchoedChat:
    """A chat choice with vLLM's echo: `text` (the final input message's, the assistant's) in
    front of the reply's content, streamed in the opening chunk."""

    def __init__(self, inner: ChoiceBuilder, text: str):
        self.inner, self.text = inner, text

    def whole(self, c: CompletionOutput) -> dict:
        choice = self.inner.whole(c)
        message = choice["message"]
        message["content"] = self.text + (message["content"] or "")
        return choice

    def delta(self, c: CompletionOutput) -> dict | None:
        return self.inner.delta(c)

    def opening(self) -> dict:
        opening = self.inner.opening()
        opening["delta"]["content"] = self.text + opening["delta"]["content"]
        return opening
