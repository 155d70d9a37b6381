"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A request's system prompt and messages become chat messages (hyla.server.chat_protocol) and run
through `prepare_chat`, so the same chat template, tool-call parser, reasoning parser and
structured outputs apply as on /v1/chat/completions. The chat choice is rendered as content
blocks: `thinking` (with a --reasoning-parser, when the output had reasoning; its signature is
empty: hyla does not sign), `text`, and a `tool_use` block per tool call (its input the parsed
arguments); stop_reason is tool_use (tool calls), max_tokens (the limit cut the output), stop_sequence
(one of stop_sequences ended it, named in stop_sequence) or end_turn; usage: input_tokens (the
prompt's tokens the prefix cache did not serve), cache_read_input_tokens (those it did; their sum
is what count_tokens gives) and output_tokens.

Input: `system` (a string or text blocks) and messages with role user or assistant (or system,
rendered in place as chat does), their content a string or blocks: text, tool_use (assistant),
tool_result (user; content a string or text blocks; each becomes a tool message, in order with
the text around it) and thinking (assistant: that turn's reasoning_content; its signature is not
checked). A final assistant message is a prefill: the output continues it (chat's
continue_final_message). cache_control marks are accepted anywhere (the prefix cache needs none).

Sampling: max_tokens (required), temperature, top_p, top_k, stop_sequences; tool_choice auto /
any (chat's "required") / tool (a named function) / none, disable_parallel_tool_use (only the
first call is returned); output_config.effort (the template's reasoning_effort) and
output_config.format json_schema (structured outputs). thinking enabled / disabled switches the
template's thinking on / off (chat_template_kwargs enable_thinking and thinking, the names the
reasoning parsers' templates read); adaptive, like thinking absent, leaves the template's default;
enabled and adaptive need --reasoning-parser (which makes the thinking blocks).
thinking.budget_tokens is checked as Anthropic checks it (>= 1024 and < max_tokens), but hyla has
no separate thinking limit: max_tokens bounds the reasoning and the answer together. vLLM's extras
chat_template_kwargs, min_p, seed, repetition_penalty, presence_penalty and frequency_penalty are
taken as on /v1/chat/completions; OpenAI's fields (n, stop, response_format, ...) are 400s naming
the Messages field to use. A tool_result's is_error has no chat-template field: its content
carries the error.

Streamed (stream: true): Anthropic's server-sent events with `event:` lines: message_start,
content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta) /
content_block_stop per block, message_delta (stop_reason, stop_sequence, usage) and message_stop;
an engine failure mid-stream is an `error` event.

Errors are Anthropic's shape, {"type": "error", "error": {"type": "invalid_request_error",
"message": ...}}, the message naming the field; fields hyla cannot honour (server tools, images
and documents, container, mcp_servers, context_management, redacted_thinking blocks, ...) are 400s.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from hyla.server.chat_protocol import ChatCompletionRequest
from hyla.server.errors import APIError, UnsupportedParameter, parse, read_json
from hyla.server.openapi import body_schema
from hyla.server.output_items import ItemEvent, ItemsResult, OutputItem, stream_items, whole_items
from hyla.server.prepare import chat_prompt, check_model, prepare_chat

MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                529: "overloaded_error"}
# chat request fields -> the Messages field a client error names
_PARAM_NAMES = {"messages": "messages", "prompt": "messages", "max_tokens": "max_tokens",
                "max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                "response_format": "output_config.format", "reasoning_effort": "output_config.effort"}
# known Messages fields hyla cannot honour: refused when set
_REFUSED = ("container", "mcp_servers", "context_management", "diagnostics", "inference_geo")
# vLLM's sampling extras, passed to the chat request as they are
_CHAT_EXTRAS = ("min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty")
# OpenAI fields a client may send here by mistake: refused rather than ignored (the Messages
# field to use instead, where there is one)
_OPENAI_ONLY = {"n": None, "best_of": None, "logprobs": None, "top_logprobs": None, "stop": "stop_sequences",
                "max_completion_tokens": "max_tokens", "response_format": "output_config.format",
                "reasoning_effort": "output_config.effort", "tool_calls": None, "functions": "tools"}


def error_response(status: int, message: str) -> JSONResponse:
    """An error in Anthropic's shape (its type from the status)."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def _error_message(e: APIError) -> str:
    """The error's message naming the Messages field it is about (Anthropic's errors have no param)."""
    if e.param is None:
        return e.message
    head = e.param.split(".", 1)[0]
    if head in _PARAM_NAMES:
        param = _PARAM_NAMES[head] if head != "messages" else e.param
    elif head == "tools":  # a chat tool's function.name / function.parameters
        param = e.param.replace(".function.parameters", ".input_schema").replace(".function.", ".")
    else:
        param = e.param
    message = e.message.replace(f"`{e.param}`", f"`{param}`")  # parse()'s "invalid value for `field`"
    return message if param in message else f"{param}: {message}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: Literal["user", "assistant", "system"]
    content: str | list[dict]


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(..., alias="schema")


class OutputConfig(_Strict):
    effort: str | None = None
    format: OutputFormat | None = None


class MessagesBody(BaseModel):
    """What /v1/messages and /v1/messages/count_tokens share. Unknown fields are ignored (clients
    send many), as on the other routes; the known ones hyla cannot honour are refused."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str = Field(...)
    messages: list[MessageIn] = Field(..., min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = Field(None, max_length=128)
    tool_choice: dict | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in _REFUSED:
            if extra.get(name) is not None:
                raise UnsupportedParameter(name, f"{name} is not supported")
        for name, instead in _OPENAI_ONLY.items():
            if extra.get(name) is not None:
                hint = f": send {instead}" if instead else ""
                raise UnsupportedParameter(name, f"{name} is not a /v1/messages field{hint}")
        if extra.get("speed") not in (None, "standard"):
            raise UnsupportedParameter("speed", f"speed {extra['speed']!r} is not supported")
        if extra.get("service_tier") not in (None, "auto", "standard_only"):
            raise UnsupportedParameter("service_tier", f"service_tier {extra['service_tier']!r} is not supported")

    def chat_tools(self) -> list[dict] | None:
        if not self.tools:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") not in (None, "custom"):
                raise UnsupportedParameter(f"tools.{i}.type", f"tool type {tool.get('type')!r} is not supported: "
                                           "only client tools (name, description, input_schema)")
            if not isinstance(tool.get("input_schema"), dict):
                raise UnsupportedParameter(f"tools.{i}.input_schema", "a tool needs an input_schema object")
            for name in ("defer_loading", "input_examples"):
                if tool.get(name):
                    raise UnsupportedParameter(f"tools.{i}.{name}", f"{name} is not supported")
            if tool.get("allowed_callers") not in (None, ["direct"]):
                raise UnsupportedParameter(f"tools.{i}.allowed_callers", "only direct callers are supported")
            function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            for name in ("description", "strict"):
                if tool.get(name) is not None:
                    function[name] = tool[name]
            tools.append({"type": "function", "function": function})
        return tools

    def chat_tool_choice(self, has_tools: bool):
        """-> (chat tool_choice or None, whether at most one call is returned)."""
        choice = self.tool_choice
        if choice is None:
            return None, False
        kind = choice.get("type")
        single = bool(choice.get("disable_parallel_tool_use"))
        if kind == "auto":
            return ("auto" if has_tools else None), single  # may call tools, of which there may be none
        if kind == "any":
            return "required", single
        if kind == "none":
            return "none", False
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise UnsupportedParameter("tool_choice.name", "tool_choice of type tool needs a name")
            return {"type": "function", "function": {"name": choice["name"]}}, single
        raise UnsupportedParameter("tool_choice.type", f"tool_choice type {kind!r} is not supported: auto, any, "
                                   "tool or none")

    def thinking_kwargs(self, state, max_tokens: int | None) -> dict:
        """The chat template variables `thinking` sets (none when absent or adaptive)."""
        t = self.thinking
        if t is None:
            return {}
        if t.display is not None:
            raise UnsupportedParameter("thinking.display", "thinking.display is not supported")
        if t.type == "disabled":
            return {"enable_thinking": False, "thinking": False}
        if state.reasoning_parser is None:
            raise UnsupportedParameter("thinking", "thinking needs the server to run with --reasoning-parser "
                                       "(which splits the thinking from the answer)")
        if t.type == "adaptive":
            return {}
        budget = t.budget_tokens
        if not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
            raise UnsupportedParameter("thinking.budget_tokens", f"thinking.budget_tokens must be an integer >= "
                                       f"{MIN_THINKING_BUDGET}")
        if max_tokens is not None and budget >= max_tokens:
            raise UnsupportedParameter("thinking.budget_tokens", "thinking.budget_tokens must be less than max_tokens")
        return {"enable_thinking": True, "thinking": True}

    def chat_body(self, state, max_tokens: int | None = None) -> dict:
        """The ChatCompletionRequest body this request runs as, with only the fields it sets, so
        that generation_config.json's defaults apply to the others (disable_parallel_tool_use
        becomes parallel_tool_calls false)."""
        self.refuse_unsupported()
        messages = chat_messages(self.system, self.messages)
        body: dict[str, Any] = {"messages": messages}
        if self.messages[-1].role == "assistant":  # a prefill: the output continues it
            body["add_generation_prompt"], body["continue_final_message"] = False, True
        tools = self.chat_tools()
        if tools is not None:
            body["tools"] = tools
        choice, single_call = self.chat_tool_choice(tools is not None)
        if choice is not None:
            body["tool_choice"] = choice
        if single_call:  # the chat route's rule (hyla.server.tool_choices.SingleToolCall)
            body["parallel_tool_calls"] = False
        extra = self.model_extra or {}
        kwargs = {**(extra.get("chat_template_kwargs") or {}), **self.thinking_kwargs(state, max_tokens)}
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        config = self.output_config
        if config is not None and config.effort is not None:
            body["reasoning_effort"] = config.effort
        if config is not None and config.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"schema": config.format.schema_}}
        return body


class MessagesRequest(MessagesBody):
    """The /v1/messages body."""

    max_tokens: int = Field(...)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: dict | None = None

    def chat_body(self, state, max_tokens: int | None = None) -> dict:
        body = super().chat_body(state, self.max_tokens)
        body["max_tokens"] = self.max_tokens
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        user = (self.metadata or {}).get("user_id")
        if user is not None:
            body["user"] = user
        extra = self.model_extra or {}
        body.update({name: extra[name] for name in _CHAT_EXTRAS if extra.get(name) is not None})
        return body


# ---- messages -> chat messages ----------------------------------------------------------------

def _text(block: dict, param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise UnsupportedParameter(f"{param}.text", f"{param}.text must be a string")
    if block.get("citations"):
        raise UnsupportedParameter(f"{param}.citations", "citations are not supported")
    return block["text"]


def _text_blocks(content, param: str) -> str | list[dict]:
    """A system prompt's or a tool result's content: a string, or text blocks -> chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UnsupportedParameter(param, f"{param} must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise UnsupportedParameter(f"{param}.{j}.type", f"block type {kind!r} is not supported here: text only")
        parts.append({"type": "text", "text": _text(block, f"{param}.{j}")})
    return parts


def chat_messages(system, messages: list[MessageIn]) -> list[dict]:
    """The system prompt and messages -> chat messages: a user message's tool_result blocks are
    tool messages (the text before and after them user messages, in order); an assistant
    message's text, thinking and tool_use blocks are one assistant message (content, reasoning,
    tool_calls)."""
    out: list[dict] = []
    if system is not None and system != []:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    for i, message in enumerate(messages):
        param = f"messages.{i}.content"
        if isinstance(message.content, str) or message.role == "system":
            out.append({"role": message.role, "content": _text_blocks(message.content, param)})
        elif message.role == "user":
            out += _user_messages(message.content, param)
        else:
            out.append(_assistant_message(message.content, param))
    return out


def _user_messages(blocks: list[dict], param: str) -> list[dict]:
    out, text = [], []
    for j, block in enumerate(blocks):
        where = f"{param}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append({"type": "text", "text": _text(block, where)})
        elif kind == "tool_result":
            if text:
                out.append({"role": "user", "content": text})
                text = []
            if not isinstance(block.get("tool_use_id"), str):
                raise UnsupportedParameter(f"{where}.tool_use_id", "a tool_result needs its tool_use_id")
            # is_error has no chat-template field: the content says what went wrong
            content = _text_blocks(block.get("content", ""), f"{where}.content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
        else:
            raise UnsupportedParameter(f"{where}.type", f"block type {kind!r} is not supported in a user message: "
                                       "text or tool_result")
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _assistant_message(blocks: list[dict], param: str) -> dict:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        where = f"{param}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append({"type": "text", "text": _text(block, where)})
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise UnsupportedParameter(f"{where}.thinking", "a thinking block needs its thinking text")
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise UnsupportedParameter(where, "a tool_use block needs an id, a name and an input object")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        else:
            raise UnsupportedParameter(f"{where}.type", f"block type {kind!r} is not supported in an assistant "
                                       "message: text, thinking or tool_use")
    message: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


# ---- output -----------------------------------------------------------------------------------

def _block(item: OutputItem, opening: bool = False) -> dict:
    """An item as a content block (opening: as content_block_start sends it, still empty)."""
    if item.kind == "reasoning":
        return {"type": "thinking", "thinking": "" if opening else item.text, "signature": ""}
    if item.kind == "text":
        return {"type": "text", "text": "" if opening else item.text}
    try:
        arguments = {} if opening else json.loads(item.text)
    except json.JSONDecodeError:  # cut short by max_tokens (a forced call's arguments)
        arguments = {}
    return {"type": "tool_use", "id": item.call_id, "name": item.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def _stop(result: ItemsResult) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if result.finish_reason == "tool_calls":
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    if isinstance(result.stop_reason, str):  # a stop string (a stop token is an id)
        return "stop_sequence", result.stop_reason
    return "end_turn", None


def _input_usage(result: ItemsResult) -> dict:
    """The prompt's tokens as Anthropic counts them: input_tokens are those not read from the
    cache, cache_read_input_tokens those the prefix cache served (count_tokens gives their sum)."""
    return {"input_tokens": result.prompt_tokens - result.cached_tokens,
            "cache_read_input_tokens": result.cached_tokens}


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


# ---- routes -----------------------------------------------------------------------------------

router = APIRouter()


async def _chat_request(request: Request, model: type[MessagesBody]):
    """The body parsed and translated -> (state, body, chat request with defaults)."""
    state = request.app.state.server
    req = parse(model, await read_json(request, state.max_body_bytes))
    check_model(state, req.model)
    try:
        chat_body = req.chat_body(state)
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    chat_req = parse(ChatCompletionRequest, chat_body)
    chat_req.apply_defaults(state.engine.generation_defaults.sampling)
    return state, req, chat_req


@router.post("/v1/messages", openapi_extra=body_schema(MessagesRequest))
async def create_message(request: Request):
    try:
        state, req, chat_req = await _chat_request(request, MessagesRequest)
        run = await prepare_chat(state, chat_req)
        head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": state.model_name}
        if not req.stream:
            result = await whole_items(request, state, run, head["id"])
            stop_reason, stop_sequence = _stop(result)
            return {**head, "content": [_block(item) for item in result.items], "stop_reason": stop_reason,
                    "stop_sequence": stop_sequence, "usage": {**_input_usage(result),
                                                              "output_tokens": result.completion_tokens}}
    except APIError as e:
        return error_response(e.status, _error_message(e))
    return StreamingResponse(_events(request, state, run, head), media_type="text/event-stream")


async def _events(request: Request, state, run, head: dict):
    usage = {"input_tokens": len(run.ids), "output_tokens": 0}
    yield _sse("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                             "usage": usage}})
    result = None
    try:
        async for event in stream_items(request, state, run, head["id"]):
            if isinstance(event, ItemsResult):
                result = event
            else:
                yield _block_event(event)
    except APIError as e:  # the status line is sent: an error event ends the stream
        kind = _ERROR_TYPES.get(e.status, "api_error")
        yield _sse("error", {"error": {"type": kind, "message": e.message}})
        return
    if result is None:
        return  # the client is gone
    stop_reason, stop_sequence = _stop(result)
    yield _sse("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                 "usage": {**_input_usage(result), "output_tokens": result.completion_tokens}})
    yield _sse("message_stop", {})


def _block_event(event: ItemEvent) -> str:
    if event.type == "start":
        return _sse("content_block_start", {"index": event.index, "content_block": _block(event.item, opening=True)})
    if event.type == "stop":
        return _sse("content_block_stop", {"index": event.index})
    kind = event.item.kind
    delta = ({"type": "thinking_delta", "thinking": event.text} if kind == "reasoning"
             else {"type": "text_delta", "text": event.text} if kind == "text"
             else {"type": "input_json_delta", "partial_json": event.text})
    return _sse("content_block_delta", {"index": event.index, "delta": delta})


@router.post("/v1/messages/count_tokens", openapi_extra=body_schema(MessagesBody))
async def count_tokens(request: Request):
    """The prompt's token count: the system prompt, messages and tools rendered with the chat
    template, as /v1/messages would run them."""
    try:
        state, _, chat_req = await _chat_request(request, MessagesBody)
        try:
            chat_req.tool_mode()
        except UnsupportedParameter as e:
            raise APIError(400, str(e), param=e.param) from None
        prompt = chat_prompt(state, chat_req, chat_req.tool_dicts())
    except APIError as e:
        return error_response(e.status, _error_message(e))
    return {"input_tokens": len(prompt.ids)}
