"""The OpenAI-compatible HTTP API (FastAPI) over one AsyncEngine.

Routes: GET /health, GET /metrics, GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(`stream: true` -> server-sent events ending with `data: [DONE]`). Every client mistake gets an
OpenAI-style error body with a 4xx; a client that disconnects has its request aborted, which frees
its state slot and KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

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


async def _read_json(request: Request, limit: int) -> dict:
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
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object")
    return data


def _parse(model_cls, data: dict):
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"invalid value for `{param}`: {err['msg']}", param=param) from None


def create_app(engine, model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> FastAPI:
    metrics = ServerMetrics(engine)
    runner = AsyncEngine(engine, on_output=metrics.observe)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        runner.start()
        yield
        runner.shutdown()

    app = FastAPI(title="hyla", lifespan=lifespan)
    app.state.engine, app.state.runner, app.state.metrics = engine, runner, metrics

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def _internal_error(_request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return APIError(401, "missing or invalid API key (Authorization: Bearer ...)",
                                "authentication_error", code="invalid_api_key").response()
        return await call_next(request)

    def check_model(name):
        if name is not None and name != model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")

    def prepare(req, prompt):
        try:
            params = req.to_params()
        except UnsupportedParameter as e:
            raise APIError(400, str(e), param=e.param) from None
        try:
            _, ids = engine.encode(prompt)
            engine.validate(ids, params)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt" if "prompt" in str(e) or "token" in str(e) else None) from None
        return ids, params

    async def results(request: Request, rid: str, ids, params):
        """Yield the engine's outputs for one request; abort it if the client goes away."""
        metrics.arrived(rid)
        queue = runner.submit(rid, ids, params)
        finished = False
        try:
            while True:
                try:
                    out = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if out.error:
                    finished = True
                    raise APIError(400, out.error)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                runner.abort(rid)

    async def final_output(request: Request, rid: str, ids, params):
        """Wait for a non-streamed request's last output (499 if the client left first)."""
        last = None
        async for last in results(request, rid, ids, params):
            pass
        if last is None:
            raise APIError(499, "client closed the request")
        return last

    def usage(ids, out):
        n = len(out.outputs[0].token_ids) if out.outputs else 0
        return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

    def logprob_tokens(out, start):
        lps = out.outputs[0].logprobs or []
        toks = out.outputs[0].token_ids
        decode = engine.tokenizer.decode if engine.tokenizer is not None else (lambda ids: str(ids[0]))
        return [(decode([t]), lp[t], {decode([k]): v for k, v in lp.items()}) for t, lp in
                zip(toks[start:], lps[start:])]

    def completion_logprobs(out, start, n_top):
        if out.outputs[0].logprobs is None:
            return None
        rows = logprob_tokens(out, start)
        return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
                "top_logprobs": [dict(list(r[2].items())[: n_top + 1]) for r in rows], "text_offset": []}

    def chat_logprobs(out, start):
        if out.outputs[0].logprobs is None:
            return None
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": k, "logprob": v, "bytes": list(k.encode())}
                                              for k, v in top.items()]}
                            for t, lp, top in logprob_tokens(out, start)]}

    def sse(data) -> str:
        return f"data: {json.dumps(data)}\n\n"

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "hyla",
                                            "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(CompletionRequest, await _read_json(request, max_body_bytes))
        check_model(req.model)
        try:
            prompt = req.prompt_value()
        except UnsupportedParameter as e:
            raise APIError(400, str(e), param=e.param) from None
        ids, params = prepare(req, prompt)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        n_top = params.logprobs or 0

        if req.stream:
            async def events():
                sent_text, sent_tokens, last = 0, 0, None
                async for out in results(request, rid, ids, params):
                    last, c = out, out.outputs[0]
                    choice = {"index": 0, "text": c.text[sent_text:], "finish_reason": c.finish_reason,
                              "logprobs": completion_logprobs(out, sent_tokens, n_top)}
                    sent_text, sent_tokens = len(c.text), len(c.token_ids)
                    yield sse({**head, "choices": [choice]})
                if last is not None and req.stream_options and req.stream_options.include_usage:
                    yield sse({**head, "choices": [], "usage": usage(ids, last)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        last = await final_output(request, rid, ids, params)
        c = last.outputs[0]
        choice = {"index": 0, "text": c.text, "finish_reason": c.finish_reason,
                  "logprobs": completion_logprobs(last, 0, n_top)}
        return {**head, "choices": [choice], "usage": usage(ids, last)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = _parse(ChatCompletionRequest, await _read_json(request, max_body_bytes))
        check_model(req.model)
        if engine.tokenizer is None or not engine.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            prompt_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except UnsupportedParameter as e:
            raise APIError(400, str(e), param=e.param) from None
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages is a client error
            raise APIError(400, f"could not render the chat template: {e}", param="messages") from None
        ids, params = prepare(req, prompt_ids)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model_name}

        if req.stream:
            chunk_head = {**head, "object": "chat.completion.chunk"}

            async def events():
                yield sse({**chunk_head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}]})
                sent_text, sent_tokens, last = 0, 0, None
                async for out in results(request, rid, ids, params):
                    last, c = out, out.outputs[0]
                    delta = {"content": c.text[sent_text:]} if len(c.text) > sent_text else {}
                    choice = {"index": 0, "delta": delta, "finish_reason": c.finish_reason,
                              "logprobs": chat_logprobs(out, sent_tokens)}
                    sent_text, sent_tokens = len(c.text), len(c.token_ids)
                    if delta or c.finish_reason:
                        yield sse({**chunk_head, "choices": [choice]})
                if last is not None and req.stream_options and req.stream_options.include_usage:
                    yield sse({**chunk_head, "choices": [], "usage": usage(ids, last)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        last = await final_output(request, rid, ids, params)
        c = last.outputs[0]
        choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                  "logprobs": chat_logprobs(last, 0)}
        return {**head, "choices": [choice], "usage": usage(ids, last)}

    return app
