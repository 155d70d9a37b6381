"""Chat templates rendered exactly as transformers' `apply_chat_template(..., tokenize=False)`.

The jinja environment is transformers' (5.x, `_compile_jinja_template`): a sandbox
(ImmutableSandboxedEnvironment, jinja2 >= 3.1.6: older versions have known sandbox escapes) with
trim_blocks and lstrip_blocks, the `loopcontrols` extension ({% break %}, {% continue %}) and the
`{% generation %}` block (rendered as its body: it only marks assistant tokens for training
masks), a `tojson` filter that does not escape HTML and takes json.dumps' ensure_ascii, indent,
separators and sort_keys, and the globals `raise_exception(message)` (a TemplateError with the
template's message), `strftime_now(format)` (the local time), `dict(...)` and a `namespace(...)`
that refuses underscore names.

What a template sees, as transformers passes it:
    messages               the conversation; keys whose value is None are dropped (templates
                           test for a missing key), and a message's reasoning (reasoning_content,
                           thinking or reasoning) is also under reasoning_content and thinking
    tools, documents       as given (None when absent)
    add_generation_prompt
    bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token
                           those the tokenizer config sets (`special_tokens`)
    any other variable     (chat_template_kwargs: enable_thinking, ...), over a special token of
                           the same name
Every value is rebuilt from plain JSON types first (str, int, float, bool, None, dicts, lists):
an object's methods could otherwise be reached from the template.

jinja2 (the `serve` extra) is imported on the first render.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime

# The named special tokens transformers passes to every template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The names a message's reasoning may come under; templates read the first.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message for continue_final_message, to find where it ends in the text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_MIN_JINJA = (3, 1, 6)


def special_tokens(config: Mapping) -> dict[str, str]:
    """The named special tokens of a tokenizer_config.json (a string, or {"content": ...})."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if value is not None:
            out[name] = str(value)
    return out


def render_chat_template(template: str, messages: Sequence[Mapping], /, *, add_generation_prompt: bool = False,
                         continue_final_message: bool | str = False, tools: Sequence[Mapping] | None = None,
                         documents: Sequence[Mapping] | None = None, **variables) -> str:
    """The prompt text `template` renders for `messages` ([{"role": ..., "content": ...}, ...]).

    variables: the template's other variables: the tokenizer's special tokens
    (`special_tokens(config)`) and, over them, the caller's keywords, as transformers merges
    them. continue_final_message: leave the final message open for the model to continue (the
    text is cut right after that message's content, no end-of-turn tokens); a string names the
    field to continue instead of "content" (e.g. "reasoning_content"). Not with
    add_generation_prompt. Raises as transformers does: ValueError for an empty conversation, a
    continue_final_message the template does not allow or a tool that is not a dict, TypeError
    for a message or document that is not a dict (or a variable named `messages`), and jinja2's
    TemplateError when the template fails (raise_exception included)."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible: "
                         "continue_final_message continues the final message, add_generation_prompt "
                         "starts a new assistant message")
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"Chat messages should be dicts, got {message!r}.")
    chat = [_plain({k: v for k, v in message.items() if v is not None}) for message in messages]
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise ValueError("Tools should be JSON schemas (dicts).")
    if documents is not None and not all(isinstance(doc, Mapping) for doc in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    variables = _plain(variables)
    chat = [_alias_reasoning(message) for message in chat]
    final = None
    if continue_final_message:
        final = _tag_final_message(template, chat, continue_final_message)
    text = _compile(template).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                     add_generation_prompt=add_generation_prompt, **variables)
    if final is None:
        return text
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template (the template deletes part of it)")
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space: so is the tag's


def _tag_final_message(template: str, chat: list[dict], continue_final_message: bool | str) -> str:
    """Append the tag to the final message's field to continue (in place); -> that field's text."""
    field = continue_final_message if isinstance(continue_final_message, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in REASONING_FIELDS:  # reasoning is copied under several names: tag each copy
        fields = [name for name in REASONING_FIELDS if chat[-1].get(name) == final]
    if not any(name in template for name in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                         "chat_template")
    if isinstance(final, (list, tuple)):  # content parts: continue the last text part
        for part in reversed(final):
            if "text" in part:
                final = part["text"]
                part["text"] = part["text"] + _CONTINUE_TAG
                return final
        raise ValueError("continue_final_message is set but we could not find any text to continue in the final "
                         "message!")
    for name in fields:
        chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
    return final


def _alias_reasoning(message: dict) -> dict:
    """A message's reasoning also under reasoning_content (what templates read) and thinking
    (gpt-oss' templates), from whichever of the names it came under first."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value):
    """`value` rebuilt from plain JSON types; any other object becomes "<TypeName>" (templates
    only test media keys for presence, and an object's methods must not be reachable)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) carry methods: back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and hasattr(value, "item"):
        return _plain(value.item())  # a numpy scalar (np.bool_(False) must stay falsy)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=32)
def _compile(template: str):
    return _environment().from_string(template)


@functools.lru_cache(maxsize=1)
def _environment():
    try:
        import jinja2
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("rendering chat templates needs jinja2: pip install 'hyla[serve]'") from err
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < _MIN_JINJA:
        raise ImportError(f"chat templates need jinja2 >= 3.1.6 (older versions have sandbox escapes), "
                          f"found {jinja2.__version__}")

    class GenerationBlock(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        """`dict` for templates: builds dicts, no attribute access to the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja's namespace without underscore-prefixed attributes (no path to CPython internals)."""

        def __init__(*args, **kwargs):  # jinja's signature trick: `namespace(self=...)` still works
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes <, >, & and ' for HTML, which a prompt must not get
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):  # noqa: A002 - the name templates call it with
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env
