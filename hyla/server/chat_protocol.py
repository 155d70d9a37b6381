"""The chat request body: messages (with tool calls, tool results and earlier reasoning), tools
and tool_choice, and what the chat template is rendered with (add_generation_prompt,
continue_final_message, chat_template, chat_template_kwargs, documents, reasoning_effort)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hyla.engine.sampling_params import SamplingParams
from hyla.server.errors import UnsupportedParameter
from hyla.server.protocol import Plan, SamplingRequest


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
    reasoning: str | None = None  # an assistant's earlier reasoning (vLLM's name)
    reasoning_content: str | None = None  # the same, under its former name

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
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:  # where templates read it (the renderer also copies it to `thinking`)
            m["reasoning_content"] = reasoning
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


# chat_template_kwargs keys that are not template variables: what to send instead
_NOT_TEMPLATE_KWARGS = {"chat_template": "send the template in the chat_template field",
                        "tokenize": "the prompt is always tokenized", "messages": "send them in the messages field",
                        "tools": "send them in the tools field"}
# request fields that chat_template_kwargs may also set (the field wins where the client set it)
_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "documents", "reasoning_effort")
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # the chat template (vLLM's fields)
    add_generation_prompt: bool = True  # end the prompt with the header of an assistant turn
    continue_final_message: bool = False  # leave the final (assistant) message open: the output continues it
    chat_template: str | None = None  # a template's text, used instead of the model's (--trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the template (enable_thinking, ...)
    documents: list[dict] | None = None  # for templates that render retrieved documents
    reasoning_effort: ReasoningEffort | None = None  # a template variable; "none" also sets enable_thinking false
    include_reasoning: bool = True  # with a --reasoning-parser: False drops the reasoning from the response
    parallel_tool_calls: bool | None = None  # False: a choice returns only its first tool call

    def echoed_text(self) -> str | None:
        """What echo puts in front of the reply (vLLM's rule): the final message's text when it is
        the assistant's, whose turn the reply continues; None otherwise or without echo."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else None

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

    def template_arguments(self) -> dict:
        """What the chat template is rendered with besides messages and tools: chat_template_kwargs
        with add_generation_prompt, continue_final_message, documents and reasoning_effort
        (as vLLM merges them, the request field wins where the client set it; a kwarg that
        contradicts a field the client set is a 400; reasoning_effort also sets enable_thinking,
        false for "none", unless chat_template_kwargs does). Keys that are not template variables
        (chat_template, tokenize, messages, tools) and add_generation_prompt together with
        continue_final_message are a 400, as in vLLM."""
        args = dict(self.chat_template_kwargs or {})
        for key, instead in _NOT_TEMPLATE_KWARGS.items():
            if key in args:
                raise UnsupportedParameter("chat_template_kwargs",
                                           f"chat_template_kwargs cannot set {key!r}: {instead}")
        thinking_given = "enable_thinking" in args
        for name in _TEMPLATE_FIELDS:
            field = getattr(self, name)
            if name not in args or name in self.model_fields_set:
                if name in args and args[name] != field:
                    raise UnsupportedParameter("chat_template_kwargs", f"chat_template_kwargs sets {name} to "
                                               f"{args[name]!r} but the request field is {field!r}")
                args[name] = field
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(args[name], bool):
                raise UnsupportedParameter("chat_template_kwargs", f"{name} must be a boolean")
        if args["add_generation_prompt"] and args["continue_final_message"]:
            raise UnsupportedParameter("continue_final_message", "Cannot set both `continue_final_message` and "
                                       "`add_generation_prompt` to True.")
        if args["reasoning_effort"] is None:
            del args["reasoning_effort"]  # unset: not a template variable (vLLM drops None)
        elif not thinking_given:
            args["enable_thinking"] = args["reasoning_effort"] != "none"
        return args

    def to_params(self) -> SamplingParams:
        if (self.model_extra or {}).get("thinking_token_budget") is not None:  # vLLM's; not implemented
            raise UnsupportedParameter("thinking_token_budget", "thinking_token_budget is not supported")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)

    def plan(self, keep_special_tokens: bool = False) -> Plan:
        """keep_special_tokens: a tool-call or reasoning parser reads the output. Their markers may
        be special tokens (Kimi's are), so they are kept in the text unless the client set
        skip_special_tokens."""
        params = self.to_params()
        if keep_special_tokens and "skip_special_tokens" not in self.model_fields_set:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return self.choose(params)
