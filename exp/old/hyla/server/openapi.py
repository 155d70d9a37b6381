"""Request-body schemas for the OpenAPI document (`GET /openapi.json`, `/docs`).

The generation routes read their JSON body themselves (size cap, nesting bound, strict parse:
hyla.server.errors.read_json / parse), so FastAPI does not see a body parameter and would
publish none. `body_schema(Model)` gives each route the pydantic model's JSON schema as its
documented request body, with the model's `$defs` inlined (OpenAPI operations cannot point into a
body schema's own `$defs`), so clients and schema-driven fuzzers (schemathesis) see every field.
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


def body_schema(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose JSON body is `model`: a required application/json body."""
    schema = model.model_json_schema()
    inlined = _inline(schema, schema.get("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inlined}}}}
