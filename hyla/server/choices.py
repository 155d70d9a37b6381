"""How one sequence's output becomes a choice: legacy completions and chat (ChoiceBuilders).

A builder is made per choice index and remembers what it has streamed, so each chunk carries
only what is new since the last one.
"""

from __future__ import annotations

from hyla.engine.outputs import CompletionOutput
from hyla.server.logprobs import chat_logprobs, completion_logprobs
from hyla.server.tool_parsers import ToolParseError, extract, marker_hold


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


class ToolChatChoice(ChatChoice):
    """Chat with tool_choice "auto": the text goes through a tool-call parser. Streamed, the
    content flows until a parser marker appears (a tail that may begin one is held back); each
    tool call is sent whole in `delta.tool_calls` once it is complete; finish_reason is
    "tool_calls" when there were calls (vLLM's rule)."""

    def __init__(self, index: int, tokenizer, n_top: int | None, parser, tools: list[dict]):
        super().__init__(index, tokenizer, n_top)
        self.parser, self.tools = parser, tools
        self.sent_calls = 0

    def whole(self, c: CompletionOutput) -> dict:
        content, calls = extract(self.parser, c.text, self.tools)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_dict() for call in calls]
        return {"index": self.index, "message": message, "finish_reason": "tool_calls" if calls else c.finish_reason,
                "logprobs": self._logprobs(c, 0)}

    def delta(self, c: CompletionOutput) -> dict | None:
        text, start, finished = c.text, self.parser.start, c.finish_reason is not None
        at = text.find(start)
        calls = []
        if at < 0:
            content = text if finished else text[: len(text) - marker_hold(text, start)]
        else:
            content = text[:at]
            if finished:
                _, calls = extract(self.parser, text, self.tools)
                if not calls:  # the calls do not parse: what was held back is content after all
                    content = text
            else:
                try:
                    calls = self.parser.calls(text[at:], self.tools, final=False)
                except ToolParseError:
                    calls = []
        delta: dict = {}
        if len(content) > self.sent_text:
            delta["content"] = content[self.sent_text:]
            self.sent_text = len(content)
        new = calls[self.sent_calls:]
        if new:
            delta["tool_calls"] = [{"index": self.sent_calls + k, **call.to_dict()} for k, call in enumerate(new)]
            self.sent_calls += len(new)
        if not (delta or finished):
            return None
        reason = ("tool_calls" if self.sent_calls else c.finish_reason) if finished else None
        choice = {"index": self.index, "delta": delta, "finish_reason": reason,
                  "logprobs": self._logprobs(c, self.sent_tokens)}
        self.sent_tokens = len(c.token_ids)
        return choice
