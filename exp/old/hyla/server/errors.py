"""Client mistakes as OpenAI error bodies, and the request body's reading and bounds.

Every client mistake is an APIError with a 4xx (a server failure a 500 "server_error"); the body
is read with a size cap, must be JSON of bounded nesting and valid Unicode, and is validated
strictly by a pydantic model, whose first complaint names the field.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

MAX_JSON_DEPTH = 32  # nesting of the request body (objects and arrays)


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


def check_json_tree(data) -> None:
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
        raise APIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels") from None
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
