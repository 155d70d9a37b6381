"""Chat choices with tools: parsed tool calls (tool_choice "auto"), and calls the grammar forced
(tool_choice "required" or a named function), whole and streamed as delta.tool_calls.

A forced call's output is JSON that the grammar built from the tools' schemas guarantees:
named: the function's arguments object; required: [{"name": ..., "parameters": {...}}, ...]
(vLLM's shapes), so it needs no parser.
"""

from __future__ import annotations

import json

from hyla.engine.outputs import CompletionOutput
from hyla.server.choices import ChatChoice
from hyla.server.structured import GuideSpec
from hyla.server.tool_parsers import ToolCall, ToolParseError, extract, marker_hold

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


class NamedToolChoice(ChatChoice):
    """tool_choice names a function: the output is its arguments; streamed as they come."""

    def __init__(self, index: int, tokenizer, n_top: int | None, name: str):
        super().__init__(index, tokenizer, n_top)
        self.call = ToolCall(name, "")

    def whole(self, c: CompletionOutput) -> dict:
        call = ToolCall(self.call.name, c.text, id=self.call.id).to_dict()
        return {"index": self.index, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                "finish_reason": c.finish_reason, "logprobs": self._logprobs(c, 0)}

    def delta(self, c: CompletionOutput) -> dict | None:
        new = c.text[self.sent_text:]
        if not (new or c.finish_reason):
            return None
        if self.sent_text == 0 and new:
            call = {"index": 0, **ToolCall(self.call.name, new, id=self.call.id).to_dict()}
        else:
            call = {"index": 0, "function": {"arguments": new}}
        delta = {"tool_calls": [call]} if new else {}
        choice = {"index": self.index, "delta": delta, "finish_reason": c.finish_reason,
                  "logprobs": self._logprobs(c, self.sent_tokens)}
        self.sent_text, self.sent_tokens = len(c.text), len(c.token_ids)
        return choice


class RequiredToolChoice(ChatChoice):
    """tool_choice "required": one or more calls; streamed whole at the end (the array is only
    known to be complete then)."""

    def whole(self, c: CompletionOutput) -> dict:
        calls = _required_calls(c.text) if c.finish_reason == "stop" else []
        message = {"role": "assistant", "content": None if calls else c.text}
        if calls:
            message["tool_calls"] = [call.to_dict() for call in calls]
        return {"index": self.index, "message": message, "finish_reason": "tool_calls" if calls else c.finish_reason,
                "logprobs": self._logprobs(c, 0)}

    def delta(self, c: CompletionOutput) -> dict | None:
        if c.finish_reason is None:
            return None
        whole = self.whole(c)
        message = whole["message"]
        delta = ({"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]}
                 if "tool_calls" in message else {"content": message["content"]})
        return {"index": self.index, "delta": delta, "finish_reason": whole["finish_reason"],
                "logprobs": self._logprobs(c, 0)}
