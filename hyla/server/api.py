"""The OpenAI-compatible HTTP API (FastAPI) over one AsyncEngine.

Routes: GET /health, GET /metrics, GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions (`stream: true` -> server-sent events ending with `data: [DONE]`). Every client mistake gets an
OpenAI-style error body with a 4xx; a client that disconnects has its request aborted, which frees
its state slots and KV pages.

The handlers are module-level functions on one APIRouter; what they share (the engine, the
AsyncEngine that drives it, the metrics, the settings) is one ServerState at `app.state.server`.
Both generation endpoints answer through `generate.respond` (the sequences of a request, whole or
as server-sent events); an endpoint only says how an output becomes a choice (`choices`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyla.engine.llm_engine import LLMEngine
from hyla.server.async_engine import AsyncEngine
from hyla.server.chat_prompt import ChatPrompt, load_chat_template, render_prompt
from hyla.server.chat_protocol import ChatCompletionRequest
from hyla.server.choices import ChatChoice, CompletionChoice
from hyla.server.errors import APIError, UnsupportedParameter, parse, read_json
from hyla.server.generate import respond
from hyla.server.metrics import ServerMetrics
from hyla.server.openapi import body_schema
from hyla.server.protocol import CompletionRequest, Plan
from hyla.server.reasoning_parsers import ReasoningParser, RequestReasoning, make_reasoning_parser
from hyla.server.structured import Grammars, GuideError, GuideSpec
from hyla.server.tool_choices import NamedToolChoice, RequiredToolChoice, ToolChatChoice, forced_spec
from hyla.server.tool_parsers import make_parser


@dataclass
class ServerState:
    """What every handler reads (`app.state.server`)."""

    engine: LLMEngine
    async_engine: AsyncEngine  # the loop thread that alone steps `engine`
    metrics: ServerMetrics
    model_name: str
    api_key: str | None
    max_body_bytes: int
    tool_call_parser: str | None = None  # --tool-call-parser: how tool calls are read from the text
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" allowed
    grammars: Grammars | None = None  # compiles structured-output constraints for this engine
    chat_template: str | None = None  # --chat-template: used instead of the tokenizer's
    trust_request_chat_template: bool = False  # --trust-request-chat-template: a request may send its own
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser: the output's reasoning is split off
    reasoning_end_ids: list[int] | None = None  # its end marker's tokens: a grammar applies after them


def create_app(engine, model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20,
               tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
               chat_template: str | None = None, trust_request_chat_template: bool = False,
               reasoning_parser: str | None = None) -> FastAPI:
    """chat_template: a template file's path or the template's text (vLLM's --chat-template);
    reasoning_parser: one of hyla.server.reasoning_parsers.PARSERS. Bad values fail here, at
    start-up, not on the first request."""
    if tool_call_parser is not None:
        make_parser(tool_call_parser)
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    reasoning, end_ids = None, None
    if reasoning_parser is not None:
        reasoning = make_reasoning_parser(reasoning_parser)
        if engine.tokenizer is None:
            raise ValueError("--reasoning-parser needs the model's tokenizer")
        end_ids = engine.tokenizer.encode(reasoning.end, add_special_tokens=False)
    metrics = ServerMetrics(engine)
    state = ServerState(engine, AsyncEngine(engine, on_output=metrics.observe), metrics, model_name, api_key,
                        max_body_bytes, tool_call_parser, enable_auto_tool_choice, Grammars(engine),
                        load_chat_template(chat_template) if chat_template is not None else None,
                        trust_request_chat_template, reasoning, end_ids)
    app = FastAPI(title="hyla", lifespan=_lifespan)
    app.state.server = state
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(_ApiKey)
    app.include_router(router)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    async_engine = app.state.server.async_engine
    async_engine.start()
    yield
    async_engine.shutdown()


def _state(request: Request) -> ServerState:
    return request.app.state.server


# ---- errors and auth --------------------------------------------------------------------------

async def _api_error(_request, exc: APIError):
    return exc.response()


async def _http_error(_request, exc: StarletteHTTPException):
    return APIError(exc.status_code, str(exc.detail), "invalid_request_error").response()


async def _internal_error(_request, exc: Exception):
    return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()


class _ApiKey:
    """The API key check on every /v1 route, as a plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would wrap `receive`, and a handler could then no longer see its client
    disconnect (Request.is_disconnected), which is how an abandoned request gets aborted."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            api_key = scope["app"].state.server.api_key
            got = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if api_key is not None and got != f"Bearer {api_key}":
                response = APIError(401, "missing or invalid API key (Authorization: Bearer ...)",
                                    "authentication_error", code="invalid_api_key").response()
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


# ---- what both generation endpoints share -----------------------------------------------------

def _check_model(state: ServerState, name) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model `{name}` does not exist; this server serves `{state.model_name}`",
                       param="model", code="model_not_found")


async def _prepare(state: ServerState, req, prompt) -> tuple[list[int], Plan]:
    try:
        plan = req.plan()
        spec, any_whitespace = req.guide_spec()
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    plan = await _guided(state, plan, spec, any_whitespace, req.guide_param())
    return _validate(state, prompt, plan), plan


async def _guided(state: ServerState, plan: Plan, spec: GuideSpec | None, any_whitespace: bool, param: str,
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


def _validate(state: ServerState, prompt, plan: Plan) -> list[int]:
    """The prompt's ids, checked with the plan's params by the engine (before any work)."""
    try:
        _, ids = state.engine.encode(prompt)
        state.engine.validate(ids, plan.params[0])  # the sequences differ only in their seeds
    except ValueError as e:
        raise APIError(400, str(e), param="prompt" if "prompt" in str(e) or "token" in str(e) else None) from None
    return ids


# ---- routes -----------------------------------------------------------------------------------

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus(request: Request):
    return PlainTextResponse(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "hyla",
            "max_model_len": state.engine.max_model_len}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [_model_card(_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    state = _state(request)
    _check_model(state, model_id)
    return _model_card(state)


@router.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
async def completions(request: Request):
    state = _state(request)
    req = parse(CompletionRequest, await read_json(request, state.max_body_bytes))
    req.apply_defaults(state.engine.generation_defaults.sampling)
    _check_model(state, req.model)
    try:
        prompt = req.prompt_value()
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    ids, plan = await _prepare(state, req, prompt)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}
    tok = state.engine.tokenizer
    echo = None
    if req.echo:
        echo = prompt if isinstance(prompt, str) else (tok.decode(ids, skip_special_tokens=False) if tok else None)
        if echo is None:
            raise APIError(400, "echo of a token-id prompt needs a tokenizer", param="echo")
    n_top = None if plan.strip_logprobs else plan.params[0].logprobs
    return await respond(request, state, req, ids, plan, head, lambda i: CompletionChoice(i, tok, n_top, echo),
                         chunk_object="text_completion")


def _chat_prompt(state: ServerState, req: ChatCompletionRequest, tools: list[dict] | None) -> ChatPrompt:
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


def _reasoning(state: ServerState, req: ChatCompletionRequest, prompt: ChatPrompt) -> RequestReasoning | None:
    """How this request's output splits into reasoning and content (None: no --reasoning-parser)."""
    parser = state.reasoning_parser
    if parser is None:
        return None
    if req.logprobs and not req.include_reasoning:
        raise APIError(400, "include_reasoning false cannot be combined with logprobs, which would show the "
                       "reasoning's tokens", param="include_reasoning")
    return RequestReasoning(parser if parser.thinks(prompt.text, prompt.variables) else None, req.include_reasoning)


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat(request: Request):
    state = _state(request)
    engine = state.engine
    req = parse(ChatCompletionRequest, await read_json(request, state.max_body_bytes))
    req.apply_defaults(state.engine.generation_defaults.sampling)
    _check_model(state, req.model)
    try:
        mode = req.tool_mode()
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    if mode == "auto" and not state.enable_auto_tool_choice:
        raise APIError(400, '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                       "--tool-call-parser (or send tool_choice \"none\")", param="tool_choice")
    tools = req.tool_dicts()
    prompt = _chat_prompt(state, req, tools)
    reasoning = _reasoning(state, req, prompt)
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
    plan = await _guided(state, plan, spec, any_whitespace, param, after)
    ids = _validate(state, prompt.ids, plan)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name}
    n_top = (req.top_logprobs or 0) if req.logprobs else None
    tok = engine.tokenizer
    parser = make_parser(state.tool_call_parser) if mode == "auto" else None

    def make_choice(i: int):
        if mode == "auto":
            return ToolChatChoice(i, tok, n_top, parser, tools, reasoning)
        if mode == "required":
            return RequiredToolChoice(i, tok, n_top, reasoning)
        if mode == "named":
            return NamedToolChoice(i, tok, n_top, req.forced_name, reasoning)
        return ChatChoice(i, tok, n_top, reasoning)

    return await respond(request, state, req, ids, plan, head, make_choice, chunk_object="chat.completion.chunk")
