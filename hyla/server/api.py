"""The OpenAI-compatible HTTP API (FastAPI) over one AsyncEngine.

Routes: GET /health, GET /metrics, GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions (`stream: true` -> server-sent events ending with `data: [DONE]`); vLLM's
/tokenize, /detokenize, /version and /ping in hyla.server.tokenize_api; OpenAI's /v1/responses and
Anthropic's /v1/messages in responses_api and messages_api, which run the chat route's preparation
(hyla.server.prepare.prepare_chat) and render its choices their way. Every client mistake gets an
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
import time
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyla.engine.llm_engine import LLMEngine
from hyla.server import messages_api, responses_api
from hyla.server.admission import ArrivalMiddleware, Arrivals, default_admission_wait
from hyla.server.async_engine import AsyncEngine
from hyla.server.chat_prompt import load_chat_template
from hyla.server.chat_protocol import ChatCompletionRequest
from hyla.server.choices import CompletionChoice, echoed
from hyla.server.errors import APIError, UnsupportedParameter, parse, read_json
from hyla.server.generate import respond
from hyla.server.metrics import ServerMetrics
from hyla.server.openapi import METRICS_RESPONSES, body_schema
from hyla.server.prepare import check_model as _check_model
from hyla.server.prepare import guided as _guided
from hyla.server.prepare import prepare_chat, request_ids
from hyla.server.prepare import validate as _validate
from hyla.server.protocol import CompletionRequest, Plan
from hyla.server.reasoning_parsers import ReasoningParser, make_reasoning_parser
from hyla.server.structured import Grammars
from hyla.server.token_names import token_namer
from hyla.server.tokenize_api import router as tokenize_router
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
               reasoning_parser: str | None = None, admission_wait: float | None = None) -> FastAPI:
    """chat_template: a template file's path or the template's text (vLLM's --chat-template);
    reasoning_parser: one of hyla.server.reasoning_parsers.PARSERS; admission_wait: seconds an idle
    engine waits for the rest of a burst of arrivals (hyla.server.admission; None: its default for
    the engine's device). Bad values fail here, at start-up, not on the first request."""
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
    metrics = ServerMetrics(engine, model_name)
    arrivals = Arrivals()
    if admission_wait is None:
        admission_wait = default_admission_wait(engine.model.device)
    async_engine = AsyncEngine(engine, on_output=metrics.observe, on_abort=metrics.forget, arrivals=arrivals,
                               admission_wait=admission_wait)
    state = ServerState(engine, async_engine, metrics, model_name, api_key,
                        max_body_bytes, tool_call_parser, enable_auto_tool_choice, Grammars(engine),
                        load_chat_template(chat_template) if chat_template is not None else None,
                        trust_request_chat_template, reasoning, end_ids)
    app = FastAPI(title="hyla", lifespan=_lifespan)
    app.state.server = state
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(_ApiKey)
    app.add_middleware(ArrivalMiddleware, arrivals=arrivals)
    app.include_router(router)
    app.include_router(tokenize_router)  # /tokenize, /detokenize, /version, /ping
    app.include_router(responses_api.router)
    app.include_router(messages_api.router)
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
    disconnect (Request.is_disconnected), which is how an abandoned request gets aborted. The key
    comes as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's);
    /v1/messages answers a missing key in Anthropic's error shape."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            api_key = scope["app"].state.server.api_key
            headers = dict(scope["headers"])
            got = headers.get(b"authorization", b"").decode("latin-1")
            got_x = headers.get(b"x-api-key", b"").decode("latin-1")
            if api_key is not None and got != f"Bearer {api_key}" and got_x != api_key:
                message = "missing or invalid API key (Authorization: Bearer ... or x-api-key: ...)"
                if scope["path"].startswith("/v1/messages"):
                    response = messages_api.error_response(401, message)
                else:
                    response = APIError(401, message, "authentication_error", code="invalid_api_key").response()
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


# ---- what both generation endpoints share -----------------------------------------------------

async def _prepare(state: ServerState, req: CompletionRequest, prompts: list,
                   batched: bool) -> tuple[list[list[int]], Plan]:
    """The plan (with its grammar) and every prompt's ids, each checked by the engine before any
    runs; a bad prompt of a batch is a 400 that gives its index."""
    try:
        plan = req.plan()
        spec, any_whitespace = req.guide_spec()
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    plan = await _guided(state, plan, spec, any_whitespace, req.guide_param())
    ids = []
    for i, prompt in enumerate(prompts):
        try:
            ids.append(await asyncio.to_thread(_validate, state, prompt, plan))  # off the loop: see prepare_chat
        except APIError as e:
            if not batched or e.param != "prompt":
                raise
            raise APIError(e.status, f"prompt[{i}]: {e.message}", e.type, param="prompt", code=e.code) from None
    return ids, plan


# ---- routes -----------------------------------------------------------------------------------

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse, responses=METRICS_RESPONSES)
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
        prompts, batched = req.prompts()
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    ids, plan = await _prepare(state, req, prompts, batched)
    rid, engine_id = request_ids(request, req, "cmpl")
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    tok = state.engine.tokenizer
    view = None
    if req.echo:  # the prompt's text (a token-id prompt's decoded, as vLLM does) in front of each choice
        if tok is None and not all(isinstance(p, str) for p in prompts):
            raise APIError(400, "echo of a token-id prompt needs a tokenizer", param="echo")
        whole = plan.truncate_prompt_tokens is None  # else the tokens it ran on, decoded
        texts = [p if isinstance(p, str) and whole else tok.decode(i, skip_special_tokens=False)
                 for p, i in zip(prompts, ids)]
        view = lambda p, out: echoed(out, texts[p])  # noqa: E731
    n_top = None if plan.strip_logprobs else plan.params[0].logprobs
    names = token_namer(tok, req.return_tokens_as_token_ids)  # what the logprobs name tokens with
    return await respond(request, state, req, ids, plan, head, lambda i: CompletionChoice(i, names, n_top),
                         chunk_object="text_completion", view=view, prompt_fields_in_choices=True, engine_id=engine_id)


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat(request: Request):
    state = _state(request)
    req = parse(ChatCompletionRequest, await read_json(request, state.max_body_bytes))
    req.apply_defaults(state.engine.generation_defaults.sampling)
    _check_model(state, req.model)
    run = await prepare_chat(state, req)
    rid, engine_id = request_ids(request, req, "chatcmpl")
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name}
    return await respond(request, state, req, run.ids, run.plan, head, run.make_choice,
                         chunk_object="chat.completion.chunk", engine_id=engine_id)
