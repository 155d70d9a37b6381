"""A chat request's prompt: its messages rendered with a chat template, then tokenized.

Which template (chosen by the route): the request's own `chat_template` when the server runs
with --trust-request-chat-template (vLLM's rule: a template is code the server runs), else the
one given with --chat-template, else the tokenizer's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hyla.models.chat_template import render_chat_template, special_tokens
from hyla.server.chat_protocol import ChatCompletionRequest
from hyla.server.errors import UnsupportedParameter

_TEMPLATE_CHARACTERS = "{}\n"  # text with none of these is taken for a file path, as vLLM does


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # what the template rendered
    ids: list[int]  # its tokens (no BOS added: the template writes the special tokens it wants)
    variables: dict  # the template's keyword variables it was rendered with (enable_thinking, ...)


def load_chat_template(value: str) -> str:
    """--chat-template: the path of a template file, or the template's text itself, in which
    backslash escapes (\\n) are decoded, as vLLM accepts it. A value with no template
    character that names no file is an error (a mistyped path)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if not any(c in value for c in _TEMPLATE_CHARACTERS):
        raise ValueError(f"--chat-template {value!r} looks like a file path, but there is no such file")
    # vLLM decodes the escapes with "unicode_escape", which also turns non-ASCII text into
    # mojibake: escape that text first so only the backslash sequences change
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def render_prompt(tokenizer, req: ChatCompletionRequest, tools: list[dict] | None, template: str) -> ChatPrompt:
    """The prompt of `req` rendered with `template`. Raises UnsupportedParameter (a 400) for
    template arguments the request cannot give and for a template that fails on these messages
    (raise_exception) or, given by the request, does not compile."""
    variables = req.template_arguments()
    messages = req.template_messages()
    try:
        text = render_chat_template(template, messages, tools=tools, **{**special_tokens(tokenizer.config),
                                                                        **variables})
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages is a client error
        from jinja2.exceptions import TemplateSyntaxError

        param = "chat_template" if isinstance(e, TemplateSyntaxError) and req.chat_template else "messages"
        raise UnsupportedParameter(param, f"could not render the chat template: {e}") from None
    return ChatPrompt(text, tokenizer.encode(text, add_special_tokens=False), variables)
