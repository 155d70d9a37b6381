"""Chat choices with tools: parsed tool calls (tool_choice "auto"), and calls the grammar forced
(tool_choice "required" or a named function), whole and streamed as delta.tool_calls.

A forced call's output is JSON that the grammar built from the tools' schemas guarantees:
named: the function's arguments object; required: [{"name": ..., "parameters": {...}}, ...]
(vLLM's shapes), so it needs no parser.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from hyla.engine.outputs import CompletionOutput
from hyla.server.choices import ChatChoice
from hyla.server.reasoning_parsers import RequestReasoning
from hyla.server.structured import GuideSpec
from hyla.server.tool_parsers import ToolCall, ToolParseError, marker_hold

if TYPE_CHECKING:
    from hyla.server.generate import ChoiceBuilder

_ANY_OBJECT = {"type": "object"}


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or _ANY_OBJECT


def forced_spec(tools: list[dict], name: str | None) -> GuideSpec:
    """The grammar of a named function (its arguments), or with name None of tool_choice
    "required" (a non-empty array of calls to any of the tools)."""
    if name is not None:
        tool = next(t for t in tools if t["function"]["name"] == name)
        return GuideSpec("json", _parameters(tool))
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return GuideSpec("json", {"type": "array", "minItems": 1, "items": {"anyOf": calls}})


def _required_calls(text: str) -> list[ToolCall]:
    try:
        items = json.loads(text)
        return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    except (json.JSONDecodeError, TypeError, KeyError):
        return []  # cut short (finish_reason "length"): the text is returned as content


def complete_calls(parser, section: str, tools: list[dict]) -> list[ToolCall]:
    """The closed calls at the start of `section` (the text from the parser's first marker) up
    to the first that does not parse: what a stream may already have sent, whatever its chunks
    (a parse error only grows with the text, so the longest prefix of the section whose closed
    calls parse is found by bisection)."""
    try:
        return parser.calls(section, tools, final=False)
    except ToolParseError:
        pass
    lo, hi = 0, len(section)  # calls(section[:lo]) parse, calls(section[:hi]) do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            parser.calls(section[:mid], tools, final=False)
            lo = mid
        except ToolParseError:
            hi = mid
    return parser.calls(section[:lo], tools, final=False)


def auto_tool_calls(parser, text: str, tools: list[dict], finish_reason: str | None
                    ) -> tuple[str | None, list[ToolCall]]:
    """A finished output under tool_choice "auto" -> (content, calls): the one rule a whole
    response and the end of a stream share.

    No marker: the text is the content. Otherwise the content is the text before the first
    marker, and the calls are every call when they all parse (a last unclosed one included when
    the model stopped by itself); else the closed calls before the first that does not parse,
    the rest (a call cut by max_tokens, or a malformed one after good ones) being dropped: no
    marker is ever content. When no call parses at all, a model that stopped by itself wrote
    text that only looks like a call: all of it is the content (vLLM's rule); a cut one gets
    the text before the marker."""
    at = text.find(parser.start)
    if at < 0:
        return text, []
    section = text[at:]
    if finish_reason != "length":  # a cut last call is incomplete, however it parses
        try:
            calls = parser.calls(section, tools, final=True)
        except ToolParseError:
            calls = []
        if calls:
            return text[:at] or None, calls
    calls = complete_calls(parser, section, tools)
    if calls or finish_reason == "length":
        return text[:at] or None, calls
    return text, []


class ToolChatChoice(ChatChoice):
    """Chat with tool_choice "auto": the content goes through a tool-call parser. Streamed, the
    content flows until a parser marker appears (a tail that may begin one is held back); each
    tool call is sent whole in `delta.tool_calls` once it is complete; at the end the stream
    sends what `auto_tool_calls` adds, so that streamed and whole agree. finish_reason is
    "tool_calls" when there were calls (vLLM's rule), also when max_tokens cut a later call.
    With a reasoning parser, only the content after the reasoning is parsed."""

    def __init__(self, index: int, tokenizer, n_top: int | None, parser, tools: list[dict],
                 reasoning: RequestReasoning | None = None):
        super().__init__(index, tokenizer, n_top, reasoning)
        self.parser, self.tools = parser, tools
        self.sent_calls = 0

    def _message(self, content: str | None, c: CompletionOutput) -> tuple[dict, str | None]:
        text, calls = (auto_tool_calls(self.parser, content, self.tools, c.finish_reason) if content is not None
                       else (None, []))
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [call.to_dict() for call in calls]
        return message, "tool_calls" if calls else c.finish_reason

    def _delta(self, content: str, c: CompletionOutput) -> tuple[dict, str | None]:
        text, start, finished = content, self.parser.start, c.finish_reason is not None
        at = text.find(start)
        if finished:
            content, calls = auto_tool_calls(self.parser, text, self.tools, c.finish_reason)
            content = content or ""
        elif at < 0:
            content, calls = text[: len(text) - marker_hold(text, start)], []
        else:
            content, calls = text[:at], complete_calls(self.parser, text[at:], self.tools)
        delta: dict = {}
        if len(content) > self.sent_text:
            delta["content"] = content[self.sent_text:]
            self.sent_text = len(content)
        new = calls[self.sent_calls:]
        if new:
            delta["tool_calls"] = [{"index": self.sent_calls + k, **call.to_dict()} for k, call in enumerate(new)]
            self.sent_calls += len(new)
        reason = ("tool_calls" if self.sent_calls else c.finish_reason) if finished else None
        return delta, reason


class NamedToolChoice(ChatChoice):
    """tool_choice names a function: the content is its arguments (the grammar wrote them);
    streamed as they come."""

    def __init__(self, index: int, tokenizer, n_top: int | None, name: str,
                 reasoning: RequestReasoning | None = None):
        super().__init__(index, tokenizer, n_top, reasoning)
        self.call = ToolCall(name, "")

    def _message(self, content: str | None, c: CompletionOutput) -> tuple[dict, str | None]:
        call = ToolCall(self.call.name, content or "", id=self.call.id).to_dict()
        return {"role": "assistant", "content": None, "tool_calls": [call]}, c.finish_reason

    def _delta(self, content: str, c: CompletionOutput) -> tuple[dict, str | None]:
        new = content[self.sent_text:]
        if self.sent_text == 0 and new:
            call = {"index": 0, **ToolCall(self.call.name, new, id=self.call.id).to_dict()}
        else:
            call = {"index": 0, "function": {"arguments": new}}
        self.sent_text = len(content)
        return ({"tool_calls": [call]} if new else {}), c.finish_reason


class RequiredToolChoice(ChatChoice):
    """tool_choice "required": one or more calls; streamed whole at the end (the array is only
    known to be complete then)."""

    def _message(self, content: str | None, c: CompletionOutput) -> tuple[dict, str | None]:
        calls = _required_calls(content) if c.finish_reason == "stop" and content is not None else []
        message = {"role": "assistant", "content": None if calls else content}
        if calls:
            message["tool_calls"] = [call.to_dict() for call in calls]
        return message, "tool_calls" if calls else c.finish_reason

    def _delta(self, content: str, c: CompletionOutput) -> tuple[dict, str | None]:
        if c.finish_reason is None:
            return {}, None
        message, reason = self._message(content, c)
        if "tool_calls" in message:
            return {"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]}, reason
        return {"content": message["content"]}, reason


class SingleToolCall:
    """parallel_tool_calls false on chat: a choice returns its first tool call only (the rule
    /v1/responses and /v1/messages follow, hyla.server.output_items), whole or streamed."""

    def __init__(self, inner: ChoiceBuilder):
        self.inner = inner

    def whole(self, c: CompletionOutput) -> dict:
        choice = self.inner.whole(c)
        calls = choice["message"].get("tool_calls")
        if calls:
            choice["message"]["tool_calls"] = calls[:1]
        return choice

    def delta(self, c: CompletionOutput) -> dict | None:
        choice = self.inner.delta(c)
        if choice is None or "tool_calls" not in choice["delta"]:
            return choice
        first = [call for call in choice["delta"]["tool_calls"] if call["index"] == 0]
        if first:
            choice["delta"]["tool_calls"] = first
        else:
            del choice["delta"]["tool_calls"]
            if not choice["delta"] and choice["finish_reason"] is None:
                return None
        return choice

    def opening(self) -> dict:
        return self.inner.opening()
