"""Request bodies and responses for the OpenAPI document (`GET /openapi.json`, `/docs`).

The generation routes read their JSON body themselves (size cap, nesting bound, strict parse:
hyla.server.errors.read_json / parse), so FastAPI does not see a body parameter and would
publish none. `body_schema(Model)` gives each route the pydantic model's JSON schema as its
documented request body, with the model's `$defs` inlined (OpenAPI operations cannot point into a
body schema's own `$defs`), so clients and schema-driven fuzzers (schemathesis) see every field,
and the route's answers: the JSON response or, with `stream: true`, a `text/event-stream` of
`data: {chunk}` events ending with `data: [DONE]`, and the OpenAI error body of every 4xx / 5xx
it gives. `METRICS_RESPONSES` documents `/metrics`' Prometheus text.
"""

from __future__ import annotations

import copy

from pydantic import BaseModel

_MAX_INLINE_DEPTH = 16  # the request models are not recursive; a bound keeps a future one finite


def _inline(node, defs: dict, depth: int = 0):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            if depth >= _MAX_INLINE_DEPTH:
                return {}
            target = copy.deepcopy(defs[ref.split("/")[-1]])
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return _inline({**target, **rest}, defs, depth + 1)
        return {k: _inline(v, defs, depth) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs, depth) for v in node]
    return node


ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
# the answers every generation route may give besides its 200
_ERRORS = {
    "400": "A request field is invalid or not supported (`param` names it)",
    "401": "Missing or wrong API key (--api-key)",
    "404": "The model is not the one this server serves",
    "413": "The body is larger than --max-body-bytes",
    "415": "The body is not application/json",
    "500": "The engine failed on this request",
    "503": "The server is shutting down: the request did not finish within --shutdown-drain-s",
}
STREAM_SCHEMA = {"type": "string", "description": "server-sent events: `data: {chunk JSON}` lines, an error "
                 "event `data: {\"error\": ...}` if the request fails once streaming, then `data: [DONE]`"}
METRICS_RESPONSES = {200: {"description": "Prometheus text exposition (hyla_* and vllm:* names)",
                           "content": {"text/plain": {"schema": {"type": "string"}}}}}


def body_schema(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a generation route whose JSON body is `model`: a required
    application/json body, and its answers (JSON or, streamed, text/event-stream; the errors)."""
    schema = model.model_json_schema()
    inlined = _inline(schema, schema.get("$defs", {}))
    responses = {"200": {"description": "The response (`stream: false`) or its chunks as server-sent events "
                                        "(`stream: true`)",
                         "content": {"application/json": {"schema": {"type": "object"}},
                                     "text/event-stream": {"schema": STREAM_SCHEMA}}}}
    responses.update({status: {"description": why, "content": {"application/json": {"schema": ERROR_SCHEMA}}}
                      for status, why in _ERRORS.items()})
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inlined}}},
            "responses": responses}
