"""How one sequence's output becomes a choice: legacy completions and chat (ChoiceBuilders).

A builder is made per choice index and remembers what it has streamed, so each chunk carries
only what is new since the last one.
"""

from __future__ import annotations

from hyla.engine.outputs import CompletionOutput
from hyla.server.logprobs import chat_logprobs, completion_logprobs


class CompletionChoice:
    """/v1/completions. echo: the prompt's text goes in front of the completion (the first chunk
    of a stream carries it); n_top: None unless logprobs were asked for."""

    def __init__(self, index: int, tokenizer, n_top: int | None, echo: str | None = None):
        self.index, self.tokenizer, self.n_top, self.echo = index, tokenizer, n_top, echo
        self.sent_text = self.sent_tokens = 0
        self.echoed = False

    def _logprobs(self, c: CompletionOutput, start: int):
        if self.n_top is None:
            return None
        return completion_logprobs(self.tokenizer, c, start, self.n_top, offset=len(self.echo or ""))

    def whole(self, c: CompletionOutput) -> dict:
        return {"index": self.index, "text": (self.echo or "") + c.text, "finish_reason": c.finish_reason,
                "logprobs": self._logprobs(c, 0)}

    def delta(self, c: CompletionOutput) -> dict | None:
        prefix = "" if self.echoed else (self.echo or "")
        self.echoed = True
        choice = {"index": self.index, "text": prefix + c.text[self.sent_text:], "finish_reason": c.finish_reason,
                  "logprobs": self._logprobs(c, self.sent_tokens)}
        self.sent_text, self.sent_tokens = len(c.text), len(c.token_ids)
        return choice

    def opening(self) -> None:
        return None


class ChatChoice:
    """/v1/chat/completions without tool parsing: the text is the message's content."""

    def __init__(self, index: int, tokenizer, n_top: int | None):
        self.index, self.tokenizer, self.n_top = index, tokenizer, n_top
        self.sent_text = self.sent_tokens = 0

    def _logprobs(self, c: CompletionOutput, start: int):
        return None if self.n_top is None else chat_logprobs(self.tokenizer, c, start, self.n_top)

    def whole(self, c: CompletionOutput) -> dict:
        return {"index": self.index, "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason, "logprobs": self._logprobs(c, 0)}

    def delta(self, c: CompletionOutput) -> dict | None:
        delta = {"content": c.text[self.sent_text:]} if len(c.text) > self.sent_text else {}
        if not (delta or c.finish_reason):
            return None
        choice = {"index": self.index, "delta": delta, "finish_reason": c.finish_reason,
                  "logprobs": self._logprobs(c, self.sent_tokens)}
        self.sent_text, self.sent_tokens = len(c.text), len(c.token_ids)
        return choice

    def opening(self) -> dict:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}

