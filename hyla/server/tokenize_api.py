"""vLLM's tokenizer and liveness routes (outside /v1, as vLLM serves them):

    POST /tokenize     {"prompt": text, "add_special_tokens": true, "return_token_strs": false}
                       or {"messages": [...], "add_generation_prompt": true, "continue_final_message",
                       "add_special_tokens": false, "chat_template", "chat_template_kwargs", "tools",
                       "return_token_strs"} (the prompt a chat request would run)
                       -> {"count", "max_model_len", "tokens", "token_strs"} (token_strs null unless asked)
    POST /detokenize   {"tokens": [ids]} -> {"prompt": text} (special tokens kept, as vLLM decodes)
    GET  /version      -> {"version": hyla's version}
    GET|POST /ping     -> 200, /health's answer (vLLM's alias of it)

Clients such as lm-evaluation-harness count and split prompts with /tokenize and /detokenize
instead of loading the model's tokenizer themselves.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

import hyla
from hyla.server.chat_protocol import ChatCompletionRequest, ChatMessage
from hyla.server.errors import APIError, parse, read_json
from hyla.server.openapi import body_schema
from hyla.server.prepare import chat_prompt, check_model


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the BOS / EOS the tokenizer adds around a text
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of what the template writes
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None
    return_token_strs: bool | None = False


# the chat request fields that shape its prompt, handed to the chat renderer as the client set them
_CHAT_TEMPLATE_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                         "chat_template_kwargs", "tools")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _tokenize_schema() -> dict:
    """/tokenize's documented body: either form."""
    forms = [body_schema(m)["requestBody"]["content"]["application/json"]["schema"]
             for m in (TokenizeCompletionRequest, TokenizeChatRequest)]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": forms}}}}}


router = APIRouter()


def _tokenizer(state):
    if state.engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer (tokenizer.json or tiktoken.model next to the checkpoint)")
    return state.engine.tokenizer


def _chat_ids(state, body: dict, req: TokenizeChatRequest) -> list[int]:
    """The token ids of the prompt a chat request with these messages would run (its template,
    rendered as /v1/chat/completions renders it)."""
    if req.model_extra and req.model_extra.get("mm_processor_kwargs"):
        raise APIError(400, "mm_processor_kwargs is not supported: hyla serves text-only models",
                       param="mm_processor_kwargs")
    chat = parse(ChatCompletionRequest, {k: body[k] for k in _CHAT_TEMPLATE_FIELDS if k in body})
    prompt = chat_prompt(state, chat, chat.tool_dicts())
    if req.add_special_tokens:
        return _tokenizer(state).encode(prompt.text, add_special_tokens=True)
    return prompt.ids


@router.post("/tokenize", openapi_extra=_tokenize_schema())
async def tokenize(request: Request):
    state = request.app.state.server
    body = await read_json(request, state.max_body_bytes)
    req = parse(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)
    check_model(state, req.model)
    tok = _tokenizer(state)
    if isinstance(req, TokenizeChatRequest):
        ids = _chat_ids(state, body, req)
    else:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}


@router.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
async def detokenize(request: Request):
    state = request.app.state.server
    req = parse(DetokenizeRequest, await read_json(request, state.max_body_bytes))
    check_model(state, req.model)
    tok = _tokenizer(state)
    bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{tok.vocab_size - 1})", param="tokens")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}


@router.get("/version")
async def version():
    return {"version": hyla.__version__}


@router.get("/ping")
@router.post("/ping")  # one route per method: each gets its own OpenAPI operation id
async def ping():
    return {"status": "ok"}  # /health's answer: the server is up
