"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat path.

A request's input items become chat messages (hyla.server.chat_protocol) and run through
`prepare_chat`, so the same chat template, tool-call parser, reasoning parser and structured
outputs apply as on /v1/chat/completions; the chat choice is rendered as output items:

    reasoning       {"type": "reasoning", "content": [{"type": "reasoning_text", ...}], "summary": []}
                    (with a --reasoning-parser, when the output had reasoning)
    message         {"type": "message", "role": "assistant", "content": [{"type": "output_text", ...}]}
    function_call   {"type": "function_call", "call_id", "name", "arguments"} per tool call

Input: a string (one user message) or a list of items: messages (role user, system, developer or
assistant; content a string or input_text / output_text parts), function_call items, their
function_call_output items, and reasoning items (an earlier turn's reasoning, handed to the
template as that turn's reasoning_content). Consecutive reasoning, assistant message and
function_call items are one assistant turn. `instructions` is a system message put first (not
carried over by previous_response_id, as OpenAI does).

Stored responses (store, default true) are kept in memory, the least recently used dropped beyond
MAX_STORED_RESPONSES: GET /v1/responses/{id} returns one, and previous_response_id puts its input
and output items in front of the new input (an unknown id is a 400, as OpenAI answers).

Streamed (stream: true), the events are OpenAI's, each with its sequence_number and an `event:`
line: response.created, response.in_progress, then per item response.output_item.added, for a
message or reasoning response.content_part.added, its deltas (response.output_text.delta,
response.reasoning_text.delta, response.function_call_arguments.delta), their .done events,
response.content_part.done and response.output_item.done; last response.completed, or
response.incomplete when max_output_tokens cut the output short (status "incomplete",
incomplete_details.reason "max_output_tokens"). An engine failure mid-stream is an `error`
event followed by response.failed.

Fields hyla cannot honour are a 400 that names them: built-in tools (web_search, file_search,
...), background, conversation, prompt, include, top_logprobs > 0, truncation "auto", reasoning
summaries, text.verbosity, and the others in ResponsesRequest.refuse_unsupported. Besides OpenAI's
fields, vLLM's sampling extras top_k, min_p, seed, stop, repetition_penalty, presence_penalty,
frequency_penalty and chat_template_kwargs are taken as on /v1/chat/completions.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from hyla.server.chat_protocol import ChatCompletionRequest
from hyla.server.errors import APIError, UnsupportedParameter, parse, read_json
from hyla.server.openapi import body_schema
from hyla.server.output_items import ItemEvent, ItemsResult, OutputItem, stream_items, whole_items
from hyla.server.prepare import check_model, prepare_chat
from hyla.server.protocol import refuse_stream_obfuscation

MAX_STORED_RESPONSES = 512  # responses kept for GET and previous_response_id (least recently used dropped)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds

# chat request fields -> the Responses field a client error names
_PARAM_NAMES = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
                "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                "reasoning_effort": "reasoning.effort"}
# vLLM's sampling extras on /v1/responses, passed to the chat request as they are
_CHAT_EXTRAS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "min_tokens", "ignore_eos", "logit_bias", "skip_special_tokens",
                "include_stop_str_in_output", "chat_template_kwargs")
# chat / completions fields a client may send here by mistake: refused rather than ignored
# (the Responses field to use instead, where there is one; n and best_of: a response has one output)
_CHAT_ONLY = {"n": None, "best_of": None, "logprobs": None, "echo": None, "prompt_logprobs": None,
              "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
              "response_format": "text.format", "messages": "input", "reasoning_effort": "reasoning.effort",
              "structured_outputs": "text.format", "guided_json": "text.format", "guided_regex": None,
              "guided_choice": None, "guided_grammar": None, "functions": "tools", "function_call": "tool_choice",
              "chat_template": None}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # summary's former name
    context: str | None = None
    mode: str | None = None


class ResponsesRequest(BaseModel):
    """The /v1/responses body. Unknown fields are ignored (clients send many), as on the other
    routes; the known ones hyla cannot honour are refused by `refuse_unsupported`."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict] = Field(...)
    instructions: str | None = None
    tools: list[dict] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: dict | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = None  # bounds built-in tool calls, of which hyla makes none
    prompt_cache_key: str | None = None  # caching hints: hyla's prefix cache needs none
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None

    def refuse_unsupported(self) -> None:
        """A 400 (UnsupportedParameter) for the first field set to something hyla does not do."""
        extra = self.model_extra or {}
        for name in ("conversation", "prompt", "context_management", "moderation", "access_programs",
                     "background_options", "image", "prompt_cache_options"):
            if extra.get(name) is not None:
                raise UnsupportedParameter(name, f"{name} is not supported")
        for name, instead in _CHAT_ONLY.items():
            if extra.get(name) is not None:
                hint = f": send {instead}" if instead else ""
                raise UnsupportedParameter(name, f"{name} is not a /v1/responses field{hint}")
        if self.background:
            raise UnsupportedParameter("background", "background responses are not supported")
        if self.include:
            raise UnsupportedParameter("include", f"include {self.include[0]!r} is not supported")
        if self.top_logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs is not supported")
        if self.truncation == "auto":
            raise UnsupportedParameter("truncation", 'truncation "auto" is not supported: an input longer than '
                                       "the model's context is a 400")
        if self.service_tier not in (None, "auto", "default"):
            raise UnsupportedParameter("service_tier", f"service_tier {self.service_tier!r} is not supported")
        if self.stream_options is not None:
            if not self.stream:
                raise UnsupportedParameter("stream_options", "stream_options is only allowed when stream is true")
            refuse_stream_obfuscation(self.stream_options)
        if self.text is not None and self.text.verbosity is not None:
            raise UnsupportedParameter("text.verbosity", "text.verbosity is not supported")
        r = self.reasoning
        if r is not None:
            for name in ("summary", "generate_summary", "context", "mode"):
                if getattr(r, name) is not None:
                    raise UnsupportedParameter(f"reasoning.{name}", f"reasoning.{name} is not supported (the "
                                               "reasoning itself is returned as reasoning_text content)")
        if self.metadata is not None:
            if len(self.metadata) > MAX_METADATA_PAIRS:
                raise UnsupportedParameter("metadata", f"metadata has at most {MAX_METADATA_PAIRS} pairs")
            for key, value in self.metadata.items():
                if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                    raise UnsupportedParameter("metadata", f"metadata keys have at most {MAX_METADATA_KEY} "
                                               f"characters and values at most {MAX_METADATA_VALUE}")

    def input_items(self) -> list[dict]:
        return [{"type": "message", "role": "user", "content": self.input}] if isinstance(self.input, str) \
            else list(self.input)

    def chat_tools(self) -> list[dict] | None:
        """The function tools as the chat request takes them; any other tool type is a 400."""
        if not self.tools:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise UnsupportedParameter(f"tools.{i}.type", f"tool type {kind!r} is not supported: only "
                                           "function tools (built-in tools such as web_search are OpenAI's)")
            for name in ("defer_loading", "output_schema"):
                if tool.get(name):
                    raise UnsupportedParameter(f"tools.{i}.{name}", f"{name} is not supported")
            if tool.get("allowed_callers") not in (None, ["direct"]):
                raise UnsupportedParameter(f"tools.{i}.allowed_callers", "only direct callers are supported")
            function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                        if tool.get(key) is not None}
            tools.append({"type": "function", "function": function})
        return tools

    def chat_tool_choice(self, has_tools: bool):
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise UnsupportedParameter("tool_choice", "tool_choice must be none, auto, required or "
                                           '{"type": "function", "name": ...}')
            return {"type": "function", "function": {"name": choice["name"]}}
        if choice == "auto" and not has_tools:
            return None  # the model may call tools, of which there are none
        return choice

    def chat_body(self, messages: list[dict]) -> dict:
        """The ChatCompletionRequest body this request runs as (only the fields it sets, so that
        generation_config.json's defaults still apply to the others)."""
        if self.instructions is not None:
            messages = [{"role": "system", "content": self.instructions}, *messages]
        body: dict[str, Any] = {"messages": messages}
        tools = self.chat_tools()
        if tools is not None:
            body["tools"] = tools
        choice = self.chat_tool_choice(tools is not None)
        if choice is not None:
            body["tool_choice"] = choice
        if self.parallel_tool_calls is False:  # the chat route's rule (hyla.server.tool_choices.SingleToolCall)
            body["parallel_tool_calls"] = False
        for name, value in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("user", self.user)):
            if value is not None:
                body[name] = value
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise UnsupportedParameter("text.format.schema", "text.format json_schema needs a schema")
            schema = {k: v for k, v in (("name", fmt.name), ("schema", fmt.schema_), ("description", fmt.description),
                                        ("strict", fmt.strict)) if v is not None}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        extra = self.model_extra or {}
        body.update({name: extra[name] for name in _CHAT_EXTRAS if extra.get(name) is not None})
        return body

    def echo(self) -> dict:
        """The request fields a Response repeats."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        tools = [{"type": "function", "name": t["function"]["name"],
                  "description": t["function"].get("description"), "parameters": t["function"].get("parameters"),
                  "strict": t["function"].get("strict")} for t in self.chat_tools() or []]
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id,
                "reasoning": {"effort": self.reasoning.effort if self.reasoning else None, "summary": None},
                "store": self.store is not False,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "tool_choice": self.tool_choice if self.tool_choice is not None else "auto", "tools": tools,
                "truncation": "disabled", "user": self.user, "metadata": self.metadata or {}, "background": False,
                "service_tier": "default"}


# ---- input items -> chat messages -------------------------------------------------------------

def _text_parts(content, param: str) -> list[dict] | str:
    """A message's (or a tool output's) content -> the chat content: a string, or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UnsupportedParameter(param, f"{param} must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise UnsupportedParameter(f"{param}.{j}", f"content part type {kind!r} is not supported: only "
                                       "input_text and output_text parts with a text")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise UnsupportedParameter(f"{param}.{key}", f"{param}.{key} must be a string")
    return value


def conversation_messages(items: list[dict]) -> list[dict]:
    """Responses input items -> chat messages. Reasoning, assistant message and function_call
    items in a row are one assistant message (content, reasoning, tool_calls), as a chat
    template expects an assistant turn; each function_call_output is a tool message."""
    messages: list[dict] = []

    def assistant_turn(fits) -> dict:
        """The assistant message the next part of the turn goes into: the last one when `fits`."""
        if not (messages and messages[-1]["role"] == "assistant" and fits(messages[-1])):
            messages.append({"role": "assistant", "content": None})
        return messages[-1]

    for i, item in enumerate(items):
        param = f"input.{i}"
        if not isinstance(item, dict):
            raise UnsupportedParameter(param, f"{param} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise UnsupportedParameter(f"{param}.role", f"role {role!r} is not supported: user, system, "
                                           "developer or assistant")
            content = _text_parts(item.get("content"), f"{param}.content")
            if role == "assistant":
                turn = assistant_turn(lambda m: m["content"] is None and "tool_calls" not in m)
                turn["content"] = content
            else:
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": _string(item, "name", param),
                                 "arguments": _string(item, "arguments", param)}}
            assistant_turn(lambda m: True).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = _text_parts(item.get("output"), f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": output})
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:
                raise UnsupportedParameter(f"{param}.encrypted_content", "encrypted reasoning is not supported")
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(
                    isinstance(p, dict) and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str)
                    for p in parts):
                raise UnsupportedParameter(f"{param}.content", "reasoning content must be reasoning_text parts")
            turn = assistant_turn(lambda m: m["content"] is None and "tool_calls" not in m and "reasoning" not in m)
            turn["reasoning"] = "".join(p["text"] for p in parts)
        else:
            raise UnsupportedParameter(f"{param}.type", f"input item type {kind!r} is not supported: message, "
                                       "function_call, function_call_output or reasoning")
    return messages


# ---- stored responses -------------------------------------------------------------------------

@dataclass(frozen=True)
class StoredResponse:
    """A stored response and its conversation: the previous response's (held, not copied, so
    that a chain of responses shares its items), then its own input and output items."""

    response: dict  # the Response object as it was returned
    previous: StoredResponse | None
    items: list[dict]  # its own input items, then its output items

    def conversation(self) -> list[dict]:
        chain, entry = [], self
        while entry is not None:
            chain.append(entry.items)
            entry = entry.previous
        return [item for items in reversed(chain) for item in items]


class ResponseStore:
    """Stored responses by id, in memory; beyond `capacity` the least recently used is dropped."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


def _store(app: FastAPI) -> ResponseStore:
    """The app's store, made on first use (one per app: each test app has its own)."""
    store = getattr(app.state, "responses", None)
    if store is None:
        store = app.state.responses = ResponseStore()
    return store


# ---- output items -----------------------------------------------------------------------------

def _item_id(kind: str) -> str:
    prefix = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}[kind]
    return f"{prefix}_{uuid.uuid4().hex}"


def _part(item: OutputItem) -> dict:
    if item.kind == "reasoning":
        return {"type": "reasoning_text", "text": item.text}
    return {"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}


def render_item(item: OutputItem, item_id: str, status: str) -> dict:
    """An output item as the Response lists it (status: in_progress, completed or incomplete);
    in_progress: as response.output_item.added sends it, its content still empty."""
    opening = status == "in_progress"
    if item.kind == "tool_call":
        return {"id": item_id, "type": "function_call", "call_id": item.call_id, "name": item.name,
                "arguments": "" if opening else item.text, "status": status}
    content = [] if opening else [_part(item)]
    if item.kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
    return {"id": item_id, "type": "message", "role": "assistant", "content": content, "status": status}


def _usage(result: ItemsResult) -> dict:
    details = {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0}  # (hyla does not count writes)
    return {"input_tokens": result.prompt_tokens, "input_tokens_details": details,
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


class _Turn:
    """One request's Response object as it is built: its head fields, then the output and status."""

    def __init__(self, state, req: ResponsesRequest, chat_req: ChatCompletionRequest):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.head = {"id": self.id, "object": "response", "created_at": int(time.time()), "model": state.model_name,
                     **req.echo(), "temperature": chat_req.temperature, "top_p": chat_req.top_p}

    def response(self, status: str, output: list[dict], result: ItemsResult | None = None,
                  error: dict | None = None) -> dict:
        incomplete = status == "incomplete"
        return {**self.head, "status": status, "output": output, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "completed_at": int(time.time()) if status == "completed" else None,
                "usage": _usage(result) if result is not None else None}


def _status(result: ItemsResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def _item_status(item: OutputItem) -> str:
    return "completed" if item.complete else "incomplete"


def _renamed(e: APIError) -> APIError:
    """A chat-path error with the Responses field it is about (a chat field's path inside
    messages does not carry over: the input items are numbered differently)."""
    if e.param is None:
        return e
    head = e.param.split(".", 1)[0]
    if head in _PARAM_NAMES:
        param = _PARAM_NAMES[head]
    else:  # tools.0.function.name -> tools.0.name (a Responses tool has no `function` level)
        param = e.param.replace(".function.", ".") if head == "tools" else e.param
    message = e.message.replace(f"`{e.param}`", f"`{param}`")  # parse()'s "invalid value for `field`"
    return APIError(e.status, message, e.type, param, e.code)


# ---- routes -----------------------------------------------------------------------------------

router = APIRouter()


@router.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
async def create_response(request: Request):
    state = request.app.state.server
    req = parse(ResponsesRequest, await read_json(request, state.max_body_bytes))
    check_model(state, req.model)
    store = _store(request.app)
    try:
        req.refuse_unsupported()
        previous = None
        if req.previous_response_id is not None:
            previous = store.get(req.previous_response_id)
            if previous is None:
                raise APIError(400, f"Previous response with id '{req.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
        items = req.input_items()
        earlier = previous.conversation() if previous is not None else []
        chat_body = req.chat_body(conversation_messages(earlier + items))
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    try:
        chat_req = parse(ChatCompletionRequest, chat_body)
        chat_req.apply_defaults(state.engine.generation_defaults.sampling)
        run = await prepare_chat(state, chat_req)
    except APIError as e:
        raise _renamed(e) from None
    turn = _Turn(state, req, chat_req)
    keep = req.store is not False

    def finish(response: dict) -> dict:
        if keep:
            store.put(turn.id, StoredResponse(response, previous, items + response["output"]))
        return response

    if not req.stream:
        result = await whole_items(request, state, run, turn.id)
        output = [render_item(item, _item_id(item.kind), _item_status(item)) for item in result.items]
        return finish(turn.response(_status(result), output, result))
    return StreamingResponse(_events(request, state, run, turn, finish),
                             media_type="text/event-stream")


async def _events(request: Request, state, run, turn: _Turn, finish):
    numbers = itertools.count()

    def sse(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields, 'sequence_number': next(numbers)})}\n\n"

    yield sse("response.created", response=turn.response("in_progress", []))
    yield sse("response.in_progress", response=turn.response("in_progress", []))
    output: list[dict] = []  # the items done so far, as the Response lists them
    ids: list[str] = []
    result: ItemsResult | None = None
    try:
        async for event in stream_items(request, state, run, turn.id):
            if isinstance(event, ItemsResult):
                result = event
                continue
            for kind, fields in _item_events(event, ids, output):
                yield sse(kind, **fields)
    except APIError as e:  # the status line is sent: an error event, then the response failed
        yield sse("error", code=e.code or e.type, message=e.message, param=e.param)
        error = {"code": "server_error", "message": e.message}
        yield sse("response.failed", response=turn.response("failed", output, error=error))
        return
    if result is None:
        return  # the client is gone
    status = _status(result)
    response = finish(turn.response(status, output, result))
    yield sse("response.completed" if status == "completed" else "response.incomplete", response=response)


def _item_events(event: ItemEvent, ids: list[str], output: list[dict]) -> list[tuple[str, dict]]:
    """One item event -> the Responses stream events (kind, fields); a stopped item joins `output`."""
    item, index = event.item, event.index
    if event.type == "start":
        ids.append(_item_id(item.kind))
        events = [("response.output_item.added",
                   {"output_index": index, "item": render_item(item, ids[index], "in_progress")})]
        if item.kind != "tool_call":
            events.append(("response.content_part.added", {"item_id": ids[index], "output_index": index,
                                                           "content_index": 0, "part": _part(item)}))
        return events
    where = {"item_id": ids[index], "output_index": index}
    if event.type == "delta":
        if item.kind == "tool_call":
            return [("response.function_call_arguments.delta", {**where, "delta": event.text})]
        if item.kind == "reasoning":
            return [("response.reasoning_text.delta", {**where, "content_index": 0, "delta": event.text})]
        return [("response.output_text.delta", {**where, "content_index": 0, "delta": event.text, "logprobs": []})]
    whole = render_item(item, ids[index], _item_status(item))
    output.append(whole)
    if item.kind == "tool_call":
        events = [("response.function_call_arguments.done", {**where, "arguments": item.text})]
    else:
        part = {**where, "content_index": 0}
        if item.kind == "reasoning":
            events = [("response.reasoning_text.done", {**part, "text": item.text})]
        else:
            events = [("response.output_text.done", {**part, "text": item.text, "logprobs": []})]
        events.append(("response.content_part.done", {**part, "part": _part(item)}))
    return events + [("response.output_item.done", {"output_index": index, "item": whole})]


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str):
    entry = _store(request.app).get(response_id)
    if entry is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    return entry.response
