"""A chat choice's message as an ordered list of output items (reasoning, text, tool calls), whole
or streamed as item events: what /v1/responses (output items) and /v1/messages (content blocks)
each render in their own wire format. `whole_items` and `stream_items` run a prepared chat
request's one sequence (hyla.server.generate.outputs) and give its items, whole or as events,
and its ItemsResult (finish reason, stop string, token counts).

The chat choice builders (hyla.server.choices, tool_choices) already split the output into
reasoning, content and tool calls, whole (`message`) and streamed (`delta`: reasoning, content,
tool_calls with an index). An item is a run of one kind: a stream opens an item when a delta of
another kind arrives, which closes the one before, so the items come out in the order the
builders give them: the reasoning, then the text, then each tool call.

parallel_tool_calls false / disable_parallel_tool_use true reach the chat request, whose builders
then give the first tool call only (hyla.server.tool_choices.SingleToolCall).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Literal

from fastapi import Request

from hyla.engine.outputs import CompletionOutput, RequestOutput
from hyla.server.errors import APIError
from hyla.server.generate import outputs
from hyla.server.prepare import ChatRun

ItemKind = Literal["reasoning", "text", "tool_call"]


@dataclass
class OutputItem:
    kind: ItemKind
    text: str = ""  # the reasoning, the text, or a tool call's arguments (JSON text of an object)
    name: str | None = None  # a tool call's function
    call_id: str | None = None  # a tool call's id (the tool-call parser's, or generated)
    complete: bool = True  # False: the output's token limit cut it short (the last item only)


@dataclass(frozen=True)
class ItemEvent:
    """start: an item opens (`item` with its text empty); delta: `text` is added to it; stop: it
    is complete (`item` whole). index: the item's position in the output."""

    type: Literal["start", "delta", "stop"]
    index: int
    item: OutputItem
    text: str = ""


def message_items(message: dict) -> list[OutputItem]:
    """A whole chat message ({"reasoning", "content", "tool_calls"}) -> its items. Empty reasoning
    and empty content give no item (a stream would not open one either)."""
    items = []
    if message.get("reasoning"):
        items.append(OutputItem("reasoning", message["reasoning"]))
    if message.get("content"):
        items.append(OutputItem("text", message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(OutputItem("tool_call", function["arguments"], function["name"], call["id"]))
    return items


class ItemStream:
    """Chat stream deltas -> item events. `items` holds every item so far (the open one last)."""

    def __init__(self):
        self.items: list[OutputItem] = []
        self.open = False  # whether the last item is still being written
        self.calls: dict[int, OutputItem] = {}  # a tool call's index in the chat stream -> its item

    def feed(self, delta: dict) -> list[ItemEvent]:
        """The events one chat delta ({"reasoning"?, "content"?, "tool_calls"?}) gives."""
        events: list[ItemEvent] = []
        if delta.get("reasoning"):
            events += self._write("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._write("text", delta["content"])
        for call in delta.get("tool_calls") or []:
            k = call["index"]
            function = call.get("function") or {}
            if k not in self.calls:
                self.calls[k] = OutputItem("tool_call", "", function.get("name"), call.get("id"))
                events += self._start(self.calls[k])
            elif self.calls[k] is not self.items[-1] or not self.open:
                # the builders send a call's arguments without another item in between
                raise RuntimeError(f"arguments for tool call {k} after it was closed")
            if function.get("arguments"):
                events += self._add(function["arguments"])
        return events

    def close(self, complete: bool = True) -> list[ItemEvent]:
        """The stop event of the open item (none if none is open); complete False: the output
        ended inside it, cut short by its token limit."""
        if not self.open:
            return []
        self.open = False
        index = len(self.items) - 1
        self.items[index].complete = complete
        return [ItemEvent("stop", index, replace(self.items[index]))]

    def _write(self, kind: ItemKind, text: str) -> list[ItemEvent]:
        events: list[ItemEvent] = []
        if not (self.open and self.items[-1].kind == kind):
            events += self._start(OutputItem(kind))
        return events + self._add(text)

    def _start(self, item: OutputItem) -> list[ItemEvent]:
        events = self.close()
        self.items.append(item)
        self.open = True
        return events + [ItemEvent("start", len(self.items) - 1, replace(item))]

    def _add(self, text: str) -> list[ItemEvent]:
        item = self.items[-1]
        item.text += text
        return [ItemEvent("delta", len(self.items) - 1, item, text)]


# ---- running one chat sequence for an API that renders items ----------------------------------

@dataclass
class ItemsResult:
    """One finished chat sequence, as the item-rendering routes need it."""

    items: list[OutputItem]
    finish_reason: str  # the chat choice's: "stop", "length", "tool_calls", "abort" or "error"
    stop_reason: str | int | None  # the engine's: the stop string or token that ended it (None: length, EOS...)
    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, those the prefix cache served
    completion_tokens: int
    reasoning_tokens: int  # of completion_tokens, those before the reasoning's end


def _reasoning_tokens(state, run: ChatRun, c: CompletionOutput, items: list[OutputItem]) -> int:
    """The output tokens before the reasoning's end marker (all of them if it never ended); for
    a reasoning ended without the marker (a tool call's marker ends it), the reasoning's tokens."""
    if run.reasoning is None or run.reasoning.parser is None:
        return 0
    end, ids = state.reasoning_end_ids or [], c.token_ids
    for at in range(len(ids) - len(end) + 1):
        if end and ids[at:at + len(end)] == end:
            return at
    if all(item.kind == "reasoning" for item in items):
        return len(ids)
    reasoning = "".join(item.text for item in items if item.kind == "reasoning")
    return len(state.engine.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


def _result(state, run: ChatRun, final: RequestOutput, items: list[OutputItem], finish_reason: str) -> ItemsResult:
    c = final.outputs[0]
    return ItemsResult(items, finish_reason, c.stop_reason, len(run.ids), final.num_cached_tokens, len(c.token_ids),
                       _reasoning_tokens(state, run, c, items))


async def whole_items(request: Request, state, run: ChatRun, rid: str) -> ItemsResult:
    """Run the request's one sequence to its end -> its items. A client gone before the end is a 499."""
    final = None
    async for _, out in outputs(request, state, rid, run.ids, run.plan.params):
        final = out
    if final is None or not final.finished:
        raise APIError(499, "client closed the request")
    choice = run.make_choice(0).whole(final.outputs[0])
    items = message_items(choice["message"])
    if items and choice["finish_reason"] == "length":
        items[-1].complete = False
    return _result(state, run, final, items, choice["finish_reason"])


async def stream_items(request: Request, state, run: ChatRun, rid: str) -> AsyncIterator[ItemEvent | ItemsResult]:
    """Run the request's one sequence: its item events as the output grows, then its ItemsResult.
    An engine failure raises APIError (the route turns it into its stream's error event)."""
    builder = run.make_choice(0)
    stream = ItemStream()
    final, finish_reason = None, None
    async for _, out in outputs(request, state, rid, run.ids, run.plan.params):
        final = out
        chunk = builder.delta(out.outputs[0])
        if chunk is None:
            continue
        for event in stream.feed(chunk["delta"]):
            yield event
        finish_reason = chunk["finish_reason"] or finish_reason
    if final is None or not final.finished:
        return  # the client is gone: nobody reads further
    finish_reason = finish_reason or final.outputs[0].finish_reason
    for event in stream.close(complete=finish_reason != "length"):
        yield event
    yield _result(state, run, final, stream.items, finish_reason)
