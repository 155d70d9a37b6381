"""Client mistakes as OpenAI error bodies, and the request body's reading and bounds.

Every client mistake is an APIError with a 4xx (a server failure a 500 "server_error"); the body
is read with a size cap, must be JSON of bounded nesting and valid Unicode, and is validated
strictly by a pydantic model, whose first complaint names the field.

The nesting bound is for the junk a client may send; the JSON schemas a request carries (a
response format's, guided_json, a tool's parameters, a structural tag) are documents whose depth
is theirs to choose, so they are bounded by the body's size and by MAX_SCHEMA_DEPTH, the depth
the grammar compiler still handles in well under a second, instead.
"""

from __future__ import annotations

import dataclasses
import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from hyla.engine.sampling_params import SamplingParams

MAX_JSON_DEPTH = 32  # nesting of the request body (objects and arrays) outside its schemas
MAX_SCHEMA_DEPTH = 128  # nesting of a schema the body carries, counted from the schema's root
# Where a body carries a schema (or a structural tag, which holds schemas): "*" is any list index.
SCHEMA_PATHS = (
    ("response_format", "json_schema", "schema"), ("response_format", "format"),
    ("response_format", "structures", "*", "schema"), ("structured_outputs", "json"),
    ("structured_outputs", "structural_tag"), ("guided_json",), ("tools", "*", "function", "parameters"),
)
_REQUEST_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class UnsupportedParameter(ValueError):
    """A request field whose value hyla cannot honour (answered with a 400 naming `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _schema_path(path: tuple) -> bool:
    return any(len(p) == len(path) and all(a == "*" and isinstance(b, int) or a == b for a, b in zip(p, path))
               for p in SCHEMA_PATHS)


def check_json_tree(data) -> None:
    """Bound the nesting (MAX_JSON_DEPTH; inside a schema at one of SCHEMA_PATHS,
    MAX_SCHEMA_DEPTH from the schema's root) and refuse strings that are not valid Unicode (a
    lone surrogate such as "\\ud800" parses as JSON but cannot be encoded or tokenised).
    Iterative: no recursion."""
    # (node, its path from the body's root while outside a schema else None, depth, the bound)
    stack: list[tuple] = [(data, (), 1, MAX_JSON_DEPTH)]
    while stack:
        node, path, depth, bound = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "a string in the body is not valid Unicode (a lone surrogate)") from None
            continue
        if path and _schema_path(path):  # (None inside a schema, () at the root)
            path, depth, bound = None, 1, MAX_SCHEMA_DEPTH  # a schema: its own depth from here
        if isinstance(node, (dict, list)):
            if depth > bound:
                where = "a schema in the JSON body" if path is None else "the JSON body"
                raise APIError(400, f"{where} nests deeper than {bound} levels")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, None, depth + 1, bound))
                if isinstance(item, (str, dict, list)):
                    stack.append((item, None if path is None else path + (key,), depth + 1, bound))


def engine_error(e: ValueError) -> APIError:
    """The 400 for a request the engine refused (LLMEngine.validate's ValueError) or a field's
    own check (UnsupportedParameter). param: the field the message begins with (the engine's
    messages begin with the SamplingParams field they are about), else "prompt" for the prompt's
    own problems (its length, its token ids)."""
    message = str(e)
    if isinstance(e, UnsupportedParameter):
        return APIError(400, message, param=e.param)
    first = message.split(" ", 1)[0]
    if first in _REQUEST_FIELDS:
        param = first
    elif "prompt" in message or message.startswith("token id"):
        param = "prompt"
    else:
        param = None
    return APIError(400, message, param=param)


async def read_json(request: Request, limit: int) -> dict:
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
        raise APIError(400, f"the JSON body nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object")
    check_json_tree(data)
    return data


def parse(model_cls, data: dict):
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"invalid value for `{param}`: {err['msg']}", param=param) from None
