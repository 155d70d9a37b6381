"""A parsed request made ready to run, shared by the generation routes: the model check, the
grammar a plan follows, the prompt's validation by the engine, and for the chat-shaped routes
(/v1/chat/completions, /v1/responses, /v1/messages) the whole of it in `prepare_chat`: the prompt
rendered with the chat template, how the output splits into reasoning and content, the tool
choice, the grammar, and the builder that turns each sequence's output into a chat choice.

/v1/responses and /v1/messages translate their bodies into a ChatCompletionRequest and run it
through `prepare_chat`, so the three routes share one engine path, template, tool-call parser
and reasoning parser; each renders the chat choices in its own wire format.

`state` is the server's ServerState (hyla.server.api), passed in by the routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request

from hyla.server.chat_prompt import ChatPrompt, render_prompt
from hyla.server.chat_protocol import ChatCompletionRequest
from hyla.server.choices import ChatChoice, EchoedChat
from hyla.server.errors import APIError, UnsupportedParameter, engine_error
from hyla.server.generate import ChoiceBuilder
from hyla.server.protocol import MAX_REQUEST_ID, REQUEST_ID, Plan, SamplingRequest
from hyla.server.reasoning_parsers import RequestReasoning
from hyla.server.structured import GuideError, GuideSpec
from hyla.server.token_names import token_namer
from hyla.server.tool_choices import (NamedToolChoice, RequiredToolChoice, SingleToolCall, ToolChatChoice,
                                      forced_spec)
from hyla.server.tool_parsers import make_parser


def request_ids(request: Request, req: SamplingRequest, prefix: str) -> tuple[str, str]:
    """(the response's id, the engine's id of its sequences): prefix, "-" and the client's id
    (the X-Request-Id header, else the body's request_id: vLLM's rule), or a fresh uuid. A
    client's id need not be unique among the requests running, so the engine's id adds a fresh
    suffix after "@" to it (the engine refuses an id in use)."""
    header = request.headers.get("x-request-id")
    if header is not None and (len(header) > MAX_REQUEST_ID or not REQUEST_ID.fullmatch(header)):
        raise APIError(400, f"the X-Request-Id header must be 1 to {MAX_REQUEST_ID} printable ASCII characters "
                       "without spaces", param="X-Request-Id")
    client = header or req.request_id
    if client is None:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        return rid, rid
    rid = f"{prefix}-{client}"
    return rid, f"{rid}@{uuid.uuid4().hex[:12]}"


def check_model(state, name: str | None) -> None:
    """A 404 unless `name` is None or the served model's name."""
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model `{name}` does not exist; this server serves `{state.model_name}`",
                       param="model", code="model_not_found")


async def guided(state, plan: Plan, spec: GuideSpec | None, any_whitespace: bool, param: str,
                 after: list[int] | None = None) -> Plan:
    """The plan with every sequence following `spec` (compiled once, in a worker thread: a large
    schema must not stall the event loop); after: the grammar applies only once the output has
    these tokens (the reasoning's end marker), as vLLM's structured outputs with a reasoning parser."""
    if spec is None:
        return plan
    try:
        guide = await asyncio.to_thread(state.grammars.compile, spec, any_whitespace)
        params = [dataclasses.replace(p, guide=guide, reasoning_end_token_ids=after) for p in plan.params]
    except (GuideError, ValueError) as e:
        raise APIError(400, str(e), param=param) from None
    return dataclasses.replace(plan, params=params)


def validate(state, prompt, plan: Plan) -> list[int]:
    """The prompt's ids (truncated as the plan asks), checked with the plan's params by the
    engine (before any work)."""
    try:
        _, ids = state.engine.encode(prompt)
        ids = plan.prompt_ids(ids, state.engine.max_model_len)
        state.engine.validate(ids, plan.params[0])  # the sequences differ only in their seeds
    except ValueError as e:
        raise engine_error(e) from None
    return ids


def chat_prompt(state, req: ChatCompletionRequest, tools: list[dict] | None) -> ChatPrompt:
    """The request's messages rendered with its chat template (the request's own, behind
    --trust-request-chat-template, else --chat-template's, else the tokenizer's) and tokenized."""
    tokenizer = state.engine.tokenizer
    if req.chat_template is not None and not state.trust_request_chat_template:
        raise APIError(400, "this server does not take a chat template with the request (start it with "
                       "--trust-request-chat-template)", param="chat_template")
    template = req.chat_template or state.chat_template or (tokenizer.chat_template if tokenizer else None)
    if tokenizer is None or not template:
        raise APIError(400, "this model has no chat template; use /v1/completions")
    try:
        return render_prompt(tokenizer, req, tools, template)
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None


def chat_reasoning(state, req: ChatCompletionRequest, prompt: ChatPrompt) -> RequestReasoning | None:
    """How this request's output splits into reasoning and content (None: no --reasoning-parser)."""
    parser = state.reasoning_parser
    if parser is None:
        return None
    if req.logprobs and not req.include_reasoning:
        raise APIError(400, "include_reasoning false cannot be combined with logprobs, which would show the "
                       "reasoning's tokens", param="include_reasoning")
    return RequestReasoning(parser if parser.thinks(prompt.text, prompt.variables) else None, req.include_reasoning)


@dataclass(frozen=True)
class ChatRun:
    """A chat request ready to run: submit `ids` with each of `plan.params`, and read sequence i's
    output with `make_choice(i)` (its whole chat choice, or its stream deltas)."""

    prompt: ChatPrompt
    ids: list[int]
    plan: Plan
    tool_mode: str | None  # None (no tools), "none", "auto", "required" or "named"
    tools: list[dict] | None  # as the template and the tool-call parser see them
    reasoning: RequestReasoning | None  # None: no --reasoning-parser
    make_choice: Callable[[int], ChoiceBuilder]


async def prepare_chat(state, req: ChatCompletionRequest) -> ChatRun:
    """Everything before the engine runs `req` (its defaults applied, its model checked): the
    tool choice against the server's flags, the prompt, the reasoning split, the sampling plan,
    the grammar (the request's structured output, or the forced tool call's), and the engine's
    checks. Every client mistake is an APIError (4xx) naming the chat request's field."""
    try:
        mode = req.tool_mode()
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    if mode == "auto" and not state.enable_auto_tool_choice:
        raise APIError(400, '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                       "--tool-call-parser (or send tool_choice \"none\")", param="tool_choice")
    tools = req.tool_dicts()
    # off the event loop (as every prompt's tokenisation, hyla.server.api): rendering and encoding
    # a long conversation takes milliseconds, during which the loop would serve no other request
    # and stream no token (the tokenizers release the GIL while they encode)
    prompt = await asyncio.to_thread(chat_prompt, state, req, tools)
    reasoning = chat_reasoning(state, req, prompt)
    thinks = reasoning is not None and reasoning.parser is not None
    forced = mode in ("required", "named")  # the grammar writes the call
    try:
        plan = req.plan(keep_special_tokens=mode == "auto" or thinks)
        spec, any_whitespace = req.guide_spec()
        param = req.guide_param()
        if forced:
            if spec is not None:
                forcing = "required" if mode == "required" else f"naming {req.forced_name!r}"
                raise UnsupportedParameter(param, f"{param} cannot be combined with tool_choice {forcing}, which "
                                           "constrains the output to the tools' schemas")
            spec, param = forced_spec(tools, req.forced_name), "tools"
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    # the grammar constrains the content, not the thinking (whether or not the reasoning is returned)
    after = state.reasoning_end_ids if thinks else None
    plan = await guided(state, plan, spec, any_whitespace, param, after)
    ids = validate(state, prompt.ids, plan)
    n_top = (req.top_logprobs or 0) if req.logprobs else None
    tok = token_namer(state.engine.tokenizer, req.return_tokens_as_token_ids)  # names the logprobs' tokens
    parser = make_parser(state.tool_call_parser) if mode == "auto" else None

    echo = req.echoed_text()
    single_call = req.parallel_tool_calls is False

    def make_choice(i: int) -> ChoiceBuilder:
        if mode == "auto":
            builder = ToolChatChoice(i, tok, n_top, parser, tools, reasoning)
        elif mode == "required":
            builder = RequiredToolChoice(i, tok, n_top, reasoning)
        elif mode == "named":
            builder = NamedToolChoice(i, tok, n_top, req.forced_name, reasoning)
        else:
            builder = ChatChoice(i, tok, n_top, reasoning)
        if single_call:
            builder = SingleToolCall(builder)
        return EchoedChat(builder, echo) if echo is not None else builder

    return ChatRun(prompt, ids, plan, mode, tools, reasoning, make_choice)
