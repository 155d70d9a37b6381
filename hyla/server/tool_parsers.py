"""Tool-call parsers: the model's text -> (content, tool calls), in the formats vLLM's
`--tool-call-parser` names.

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call> (one block per call)
    qwen3_coder  <tool_call><function=f><parameter=p>value</parameter>...</function></tool_call>
                 (values typed by the tool's JSON schema: strings stay raw text)
    kimi_k2      <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0
                 <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>
    glm45        <tool_call>f\n<arg_key>p</arg_key>\n<arg_value>value</arg_value>...</tool_call>
    glm47        the same, the name followed directly by the first <arg_key> (GLM-4.7 on)
                 (a value is text when the tool's schema types it "string", else JSON or a
                 Python literal when it parses as one, else text)

The content is the text before the first marker. A parser only reports calls that are complete
(`final` also takes an unclosed last call, the model having stopped at EOS); text whose calls do
not parse is returned as content, as vLLM does.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field


class ToolParseError(ValueError):
    pass


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _arguments(value) -> str:
    if isinstance(value, str):  # some models write the arguments as a JSON string
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ToolParseError(f"tool call arguments must be an object, got {type(value).__name__}")
    return json.dumps(value, ensure_ascii=False)


class HermesParser:
    start = "<tool_call>"
    _closed = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _open = re.compile(r"<tool_call>((?:(?!</tool_call>).)*)\Z", re.DOTALL)

    def calls(self, section: str, tools: list[dict], final: bool) -> list[ToolCall]:
        bodies = self._closed.findall(section)
        tail = self._open.search(section) if final else None
        if tail and tail.group(1).strip():
            bodies.append(tail.group(1))
        return [self._one(b) for b in bodies]

    def _one(self, body: str) -> ToolCall:
        try:
            obj = json.loads(body.strip())
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ToolParseError("a tool call must be an object with a string `name`")
            return ToolCall(obj["name"], _arguments(obj.get("arguments", obj.get("parameters", {}))))
        except (json.JSONDecodeError, TypeError) as e:
            raise ToolParseError(f"a tool call is not valid JSON: {e}") from None


_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


def _typed(value: str, schema: dict):
    """A qwen3_coder parameter's text as the type its JSON schema gives (strings stay text)."""
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    kinds = set(kind) if isinstance(kind, list) else {kind}
    text = value.strip()
    if text.lower() == "null":  # vLLM's rule, for every type
        return None
    if kinds & _STRING_TYPES:
        return value
    return _literal(text, fallback=value)


class Qwen3CoderParser:
    start = "<tool_call>"
    _closed = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _open = re.compile(r"<tool_call>((?:(?!</tool_call>).)*)\Z", re.DOTALL)
    _function = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)",
                            re.DOTALL)

    def calls(self, section: str, tools: list[dict], final: bool) -> list[ToolCall]:
        bodies = self._closed.findall(section)
        tail = self._open.search(section) if final else None
        if tail and "<function=" in tail.group(1):
            bodies.append(tail.group(1))
        return [self._one(b, tools) for b in bodies]

    def _one(self, body: str, tools: list[dict]) -> ToolCall:
        m = self._function.search(body)
        if m is None:
            raise ToolParseError("a qwen3_coder tool call needs <function=NAME>")
        name = m.group(1).strip()
        props = next((((t.get("function") or {}).get("parameters") or {}).get("properties") or {}
                      for t in tools if (t.get("function") or {}).get("name") == name), {})
        args = {}
        for pname, raw in self._parameter.findall(m.group(2)):
            raw = raw[1:] if raw.startswith("\n") else raw  # the format puts the value on its own lines
            raw = raw[:-1] if raw.endswith("\n") else raw
            args[pname.strip()] = _typed(raw, props.get(pname.strip(), {}))
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


class KimiK2Parser:
    start = "<|tool_calls_section_begin|>"
    _call = re.compile(r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>\s*(.*?)\s*"
                       r"(?:<\|tool_call_end\|>|(?P<open>\Z))", re.DOTALL)

    def calls(self, section: str, tools: list[dict], final: bool) -> list[ToolCall]:
        out = []
        for m in self._call.finditer(section):
            if m.group("open") is not None and (not final or not m.group(2)):
                continue  # still being written
            call_id, raw = m.group(1), m.group(2).replace("<|tool_calls_section_end|>", "").strip()
            name = call_id.split(":", 1)[0].split(".")[-1]  # "functions.get_weather:0" -> get_weather
            try:
                out.append(ToolCall(name, _arguments(json.loads(raw)), id=call_id))
            except (json.JSONDecodeError, TypeError) as e:
                raise ToolParseError(f"kimi_k2 tool call arguments are not valid JSON: {e}") from None
        return out


class Glm45Parser:
    """GLM's XML-like calls. One parser for both spellings: the name runs to the first newline
    or `<arg_key>`, so GLM-4.5's `f\n<arg_key>` and GLM-4.7's `f<arg_key>` read alike."""

    start = "<tool_call>"
    _closed = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _open = re.compile(r"<tool_call>((?:(?!</tool_call>).)*)\Z", re.DOTALL)
    _head = re.compile(r"\s*([^\n<]+?)\s*(?:\n|(?=<arg_key>)|\Z)(.*)", re.DOTALL)
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def calls(self, section: str, tools: list[dict], final: bool) -> list[ToolCall]:
        bodies = self._closed.findall(section)
        tail = self._open.search(section) if final else None
        if tail and tail.group(1).strip():
            bodies.append(tail.group(1))
        return [self._one(b, tools) for b in bodies]

    def _one(self, body: str, tools: list[dict]) -> ToolCall:
        m = self._head.match(body)
        if m is None or not m.group(1):
            raise ToolParseError("a glm45 tool call needs the function's name after <tool_call>")
        name = m.group(1)
        props = next((((t.get("function") or {}).get("parameters") or {}).get("properties") or {}
                      for t in tools if (t.get("function") or {}).get("name") == name), {})
        args = {}
        for key, raw in self._pair.findall(m.group(2)):
            key, value = key.strip(), raw.strip()
            args[key] = value if (props.get(key) or {}).get("type") == "string" else _literal(value)
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _literal(text: str, fallback=None):
    """`text` as JSON, else as a Python literal, else `fallback` (default: the text itself).
    Models write `true`, `3`, `[1, 2]` or `{'a': 1}` for parameters that are not strings."""
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return text if fallback is None else fallback


PARSERS = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser, "kimi_k2": KimiK2Parser,
           "glm45": Glm45Parser, "glm47": Glm45Parser}


def make_parser(name: str):
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[name]()


def extract(parser, text: str, tools: list[dict]) -> tuple[str | None, list[ToolCall]]:
    """A whole output -> (content, calls): the text before the first marker and the calls after
    it; all of the text as content when there are no calls or they do not parse."""
    at = text.find(parser.start)
    if at < 0:
        return text, []
    try:
        calls = parser.calls(text[at:], tools, final=True)
    except ToolParseError:
        return text, []
    if not calls:
        return text, []
    return text[:at] or None, calls


def marker_hold(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (held back from
    a stream until the next token tells)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
