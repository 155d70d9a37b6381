"""The chat request body: messages (with tool calls and tool results), tools and tool_choice."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hyla.engine.sampling_params import SamplingParams
from hyla.server.errors import UnsupportedParameter
from hyla.server.protocol import Plan, SamplingRequest, fan_out


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class FunctionCallIn(_Strict):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result answers this call

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise UnsupportedParameter("messages", "only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it: arguments as an object (templates such as
        Qwen's and Hermes' write them with `tojson`), as vLLM hands them over."""
        m: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                args = call.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        raise UnsupportedParameter("messages", f"the arguments of the earlier call to "
                                                   f"{call.function.name!r} are not valid JSON") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
            m["tool_calls"] = calls
        return m


class FunctionDef(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _Name(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _Name


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def tool_mode(self) -> str | None:
        """None (no tools), "none", "auto", "required" or "named" (`forced_name`). With tools and
        no tool_choice the choice is "auto" (OpenAI's and vLLM's default)."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise UnsupportedParameter("tool_choice", "tool_choice needs tools")
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools}:
                raise UnsupportedParameter("tool_choice", f"tool_choice names {name!r}, which is not in tools")
            return "named"
        return self.tool_choice or "auto"

    @property
    def forced_name(self) -> str | None:
        """The function tool_choice names, if it names one."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template and the parsers see them."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def to_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)

    def plan(self, parse_tools: bool = False) -> Plan:
        """parse_tools: a tool-call parser reads the output. Its markers may be special tokens
        (Kimi's are), so they are kept in the text unless the client set skip_special_tokens."""
        params = self.to_params()
        if parse_tools and "skip_special_tokens" not in self.model_fields_set:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return Plan(fan_out(params, self.n))
