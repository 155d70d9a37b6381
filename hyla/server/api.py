"""The OpenAI-compatible HTTP API (FastAPI) over one AsyncEngine.

Routes: GET /health, GET /metrics, GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions (`stream: true` -> server-sent events ending with `data: [DONE]`). Every client mistake gets an
OpenAI-style error body with a 4xx; a client that disconnects has its request aborted, which frees
its state slots and KV pages.

The handlers are module-level functions on one APIRouter; what they share (the engine, the
AsyncEngine that drives it, the metrics, the settings) is one ServerState at `app.state.server`.
Both generation endpoints answer through `_respond`: one path for a whole response, one
streaming loop for server-sent events; an endpoint only says how an output becomes a choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyla.engine.llm_engine import LLMEngine
from hyla.engine.outputs import RequestOutput
from hyla.engine.sampling_params import SamplingParams
from hyla.server.async_engine import AsyncEngine
from hyla.server.metrics import ServerMetrics
from hyla.server.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedParameter


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


MAX_JSON_DEPTH = 32  # nesting of the request body (objects and arrays)
DISCONNECT_CHECK_S = 0.25  # how often a running request asks whether its client is still there


def _check_json_tree(data) -> None:
    """Bound the nesting and refuse strings that are not valid Unicode (a lone surrogate such as
    "\\ud800" parses as JSON but cannot be encoded or tokenised). Iterative: no recursion."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "a string in the body is not valid Unicode (a lone surrogate)") from None
            continue
        if isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise APIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
            items = list(node.keys()) + list(node.values()) if isinstance(node, dict) else node
            stack.extend((item, depth + 1) for item in items if isinstance(item, (str, dict, list)))


async def _read_json(request: Request, limit: int) -> dict:
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        # a keyless local server must not take cross-site form posts (which cannot send this type)
        raise APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object")
    _check_json_tree(data)
    return data


def _parse(model_cls, data: dict):
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"invalid value for `{param}`: {err['msg']}", param=param) from None


@dataclass
class ServerState:
    """What every handler reads (`app.state.server`)."""

    engine: LLMEngine
    async_engine: AsyncEngine  # the loop thread that alone steps `engine`
    metrics: ServerMetrics
    model_name: str
    api_key: str | None
    max_body_bytes: int


def create_app(engine, model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> FastAPI:
    metrics = ServerMetrics(engine)
    state = ServerState(engine, AsyncEngine(engine, on_output=metrics.observe), metrics, model_name, api_key,
                        max_body_bytes)
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


def _prepare(state: ServerState, req, prompt) -> tuple[list[int], SamplingParams]:
    try:
        params = req.to_params()
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    try:
        _, ids = state.engine.encode(prompt)
        state.engine.validate(ids, params)
    except ValueError as e:
        raise APIError(400, str(e), param="prompt" if "prompt" in str(e) or "token" in str(e) else None) from None
    return ids, params


async def _results(request: Request, state: ServerState, rid: str, ids, params) -> AsyncIterator[RequestOutput]:
    """Yield the engine's outputs for one request; abort it if the client goes away."""
    state.metrics.arrived(rid)
    queue = state.async_engine.submit(rid, ids, params)
    finished = False
    checked = time.monotonic()
    try:
        while True:
            try:
                out = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_CHECK_S)
            except asyncio.TimeoutError:
                out = None
            # asked also while outputs keep coming: a non-streamed request produces one per step
            if time.monotonic() - checked >= DISCONNECT_CHECK_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            if out is None:
                continue
            if out.error:  # the request was validated before it was submitted: a server failure
                finished = True
                raise APIError(500, f"the engine failed on this request: {out.error}", "server_error")
            finished = out.finished
            yield out
            if finished:
                return
    finally:
        if not finished:
            state.async_engine.abort(rid)


def _usage(ids, out: RequestOutput) -> dict:
    n = len(out.outputs[0].token_ids) if out.outputs else 0
    return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}


def _sse(data) -> str:
    return f"data: {json.dumps(data)}\n\n"


# choice(output, text chars already sent, tokens already sent, streaming) -> the choice of this
# response / chunk, or None when a streamed output brings nothing to send.
Choice = Callable[[RequestOutput, int, int, bool], dict | None]


async def _respond(request: Request, state: ServerState, req, ids, params, head: dict, choice: Choice,
                   chunk_object: str, opening: tuple[dict, ...] = ()):
    """Run one request and answer it: the whole response, or (req.stream) server-sent events:
    `opening` choices, one chunk per engine output (choice's delta since the last chunk), the
    usage when stream_options.include_usage, then `data: [DONE]`."""
    rid = head["id"]
    if not req.stream:
        last = None
        async for last in _results(request, state, rid, ids, params):
            pass
        if last is None:
            raise APIError(499, "client closed the request")
        return {**head, "choices": [choice(last, 0, 0, False)], "usage": _usage(ids, last)}
    chunk_head = {**head, "object": chunk_object}

    async def events():
        for c in opening:
            yield _sse({**chunk_head, "choices": [c]})
        sent_text, sent_tokens, last = 0, 0, None
        try:
            async for out in _results(request, state, rid, ids, params):
                last, c = out, choice(out, sent_text, sent_tokens, True)
                sent_text, sent_tokens = len(out.outputs[0].text), len(out.outputs[0].token_ids)
                if c is not None:
                    yield _sse({**chunk_head, "choices": [c]})
        except APIError as e:  # the status line is sent: an error event, then the end of the stream
            yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
            yield "data: [DONE]\n\n"
            return
        if last is not None and req.stream_options and req.stream_options.include_usage:
            yield _sse({**chunk_head, "choices": [], "usage": _usage(ids, last)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _logprob_tokens(engine, out: RequestOutput, start: int):
    lps = out.outputs[0].logprobs or []
    toks = out.outputs[0].token_ids
    decode = engine.tokenizer.decode if engine.tokenizer is not None else (lambda ids: str(ids[0]))
    return [(decode([t]), lp[t], [(decode([k]), v) for k, v in lp.items()]) for t, lp in
            zip(toks[start:], lps[start:])]  # alternatives as pairs: two ids may decode alike


def _completion_logprobs(engine, out: RequestOutput, start: int, n_top: int):
    """The legacy completions logprobs of tokens start.. : per token its text, logprob, the
    chosen token plus the top n_top, and its character offset in the completion's text."""
    if out.outputs[0].logprobs is None:
        return None
    rows = _logprob_tokens(engine, out, 0)
    offsets, at = [], 0
    for text, _, _ in rows:
        offsets.append(at)
        at += len(text)
    rows = rows[start:]
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [dict(r[2][: n_top + 1]) for r in rows], "text_offset": offsets[start:]}


def _chat_logprobs(engine, out: RequestOutput, start: int, n_top: int):
    """Chat logprobs of tokens start.. : each token's logprob and exactly its n_top most likely
    alternatives (OpenAI: none when top_logprobs is not set)."""
    if out.outputs[0].logprobs is None:
        return None
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": k, "logprob": v, "bytes": list(k.encode())}
                                          for k, v in sorted(top, key=lambda kv: -kv[1])[:n_top]]}
                        for t, lp, top in _logprob_tokens(engine, out, start)]}


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


@router.post("/v1/completions")
async def completions(request: Request):
    state = _state(request)
    req = _parse(CompletionRequest, await _read_json(request, state.max_body_bytes))
    _check_model(state, req.model)
    try:
        prompt = req.prompt_value()
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    ids, params = _prepare(state, req, prompt)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}
    n_top = params.logprobs or 0

    def choice(out: RequestOutput, sent_text: int, sent_tokens: int, _stream: bool) -> dict:
        c = out.outputs[0]
        return {"index": 0, "text": c.text[sent_text:], "finish_reason": c.finish_reason,
                "logprobs": _completion_logprobs(state.engine, out, sent_tokens, n_top)}

    return await _respond(request, state, req, ids, params, head, choice, chunk_object="text_completion")


@router.post("/v1/chat/completions")
async def chat(request: Request):
    state = _state(request)
    engine = state.engine
    req = _parse(ChatCompletionRequest, await _read_json(request, state.max_body_bytes))
    _check_model(state, req.model)
    if engine.tokenizer is None or not engine.tokenizer.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions")
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages is a client error
        raise APIError(400, f"could not render the chat template: {e}", param="messages") from None
    ids, params = _prepare(state, req, prompt_ids)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name}
    n_top = req.top_logprobs or 0

    def choice(out: RequestOutput, sent_text: int, sent_tokens: int, stream: bool) -> dict | None:
        c = out.outputs[0]
        if not stream:
            return {"index": 0, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason, "logprobs": _chat_logprobs(engine, out, 0, n_top)}
        delta = {"content": c.text[sent_text:]} if len(c.text) > sent_text else {}
        if not (delta or c.finish_reason):
            return None
        return {"index": 0, "delta": delta, "finish_reason": c.finish_reason,
                "logprobs": _chat_logprobs(engine, out, sent_tokens, n_top)}

    opening = ({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},)
    return await _respond(request, state, req, ids, params, head, choice, chunk_object="chat.completion.chunk",
                          opening=opening)
