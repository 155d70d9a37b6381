"""Reasoning parsers: a reasoning model's text -> (reasoning, content), by the rules of vLLM's
`--reasoning-parser` names.

    name         reasoning        also ends it (begins the content)  thinking off (chat_template_kwargs)
    qwen3        <think>..</think>  <tool_call> then <function...    enable_thinking: false
    deepseek_r1  <think>..</think>  -                                 -
    glm45        <think>..</think>  -                                 enable_thinking or thinking: false
    kimi_k2      <think>..</think>  <|tool_calls_section_begin|>      thinking: false

The rules all four share (vLLM's):
- The output starts inside the reasoning: the chat template may already have written <think>, so
  the model's own leading <think> is optional (dropped when there). The reasoning is the text up
  to the first </think> (or the first text that also ends it, which stays in the content: a tool
  call the tool-call parser then reads); the content is the rest, None when empty. An output that
  never ends its reasoning (cut short, or one that did not think) is all reasoning, content None.
- A request does not think at all (its output is all content) when chat_template_kwargs switch
  thinking off, or when the prompt's final turn already closed the reasoning: templates write an
  empty <think></think> for non-thinking mode. The prompt is read after the parser's `turn`
  marker (where the assistant's turn begins), so the closed think blocks of earlier turns do not
  count (vLLM reads the whole prompt, glm45's back to <|assistant|> only).
- Where vLLM's whole and streamed splits differ, hyla keeps one rule for both: the first end
  (</think> or a confirmed implicit end) wins, and thinking switched off means no split at all.

Streaming (`ReasoningStream`) sends reasoning as it comes, holding back a tail that may be the
beginning of </think>, of an implicit end, or of a leading <think>, so that what was sent is
always a prefix of the final split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hyla.server.tool_parsers import marker_hold


@dataclass(frozen=True)
class ImplicitEnd:
    """Text that ends the reasoning without </think> and begins the content: a tool call's
    opening marker. then: what must follow the marker (after optional whitespace, and itself
    followed by whitespace or "=") for it to count, "" for the marker alone; vLLM's qwen3 rule,
    since a model may mention <tool_call> while it thinks."""

    marker: str
    then: str = ""

    def confirmed(self, after: str) -> bool | None:
        """Whether the text after the marker makes it an end (True), rules it out (False), or
        cannot tell yet (None: the text so far is whitespace or the beginning of `then`)."""
        if not self.then:
            return True
        rest = after.lstrip()
        if len(rest) > len(self.then):
            follows = rest[len(self.then)]
            return rest.startswith(self.then) and (follows.isspace() or follows == "=")
        return None if self.then.startswith(rest) else False


@dataclass(frozen=True)
class ReasoningParser:
    """One --reasoning-parser: its markers and rules (see the module docstring)."""

    name: str
    turn: str  # where the assistant's turn begins in a prompt
    switches: tuple[str, ...] = ()  # chat_template_kwargs that switch thinking off when given and all false
    implicit_end: ImplicitEnd | None = None
    start: str = "<think>"
    end: str = "</think>"

    def thinks(self, prompt: str, template_variables: Mapping) -> bool:
        """Whether a request's output starts inside the reasoning, from the chat template's
        variables (its switches) and the prompt text (the final turn did not close a think block)."""
        given = [template_variables[k] for k in self.switches if k in template_variables]
        if given and not any(given):
            return False
        turn = prompt.rfind(self.turn) if self.turn else -1
        final_turn = prompt[turn + len(self.turn):] if turn >= 0 else prompt
        return final_turn.rfind(self.end) <= final_turn.rfind(self.start)  # (-1 each when absent)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output (starting in the reasoning) -> (reasoning, content or None)."""
        return self._parts(text, final=True)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def _parts(self, text: str, final: bool) -> tuple[str, str | None]:
        """(reasoning, content or None). Not final: the reasoning safe to send so far (a tail
        that may still begin a marker held back), content None until the reasoning ended."""
        if text.startswith(self.start):
            body = text[len(self.start):]
        elif not final and self.start.startswith(text):
            return "", None  # may still become a leading <think>
        else:
            body = text
        at, content_at, pending = self._end(body, final)
        if at is not None:
            return body[:at], body[content_at:] or None
        if final:
            return body, None
        if pending is not None:  # an implicit end's marker waits for what follows it
            return body[:pending], None
        hold = marker_hold(body, self.end)
        if self.implicit_end is not None:
            hold = max(hold, marker_hold(body, self.implicit_end.marker))
        return body[:len(body) - hold], None

    def _end(self, body: str, final: bool) -> tuple[int | None, int | None, int | None]:
        """Where the reasoning in `body` ends -> (end, where the content begins, None), or
        (None, None, position of an implicit end not yet confirmed or ruled out) or all None."""
        explicit = body.find(self.end)
        limit = explicit if explicit >= 0 else len(body)
        imp = self.implicit_end
        if imp is not None:
            at = body.find(imp.marker)
            while 0 <= at < limit:
                verdict = imp.confirmed(body[at + len(imp.marker):])
                if verdict:
                    return at, at, None  # the marker stays in the content, for the tool-call parser
                if verdict is None and not final:
                    return None, None, at
                at = body.find(imp.marker, at + 1)
        if explicit >= 0:
            return explicit, explicit + len(self.end), None
        return None, None, None


class ReasoningStream:
    """One streamed choice's split: each step takes the whole text so far and gives the
    reasoning not sent yet and the content so far ("" until the reasoning ends)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.sent = 0  # characters of reasoning sent

    def step(self, text: str, finished: bool) -> tuple[str, str]:
        reasoning, content = self.parser._parts(text, final=finished)
        new = reasoning[self.sent:]
        self.sent = max(self.sent, len(reasoning))
        return new, content or ""


@dataclass(frozen=True)
class RequestReasoning:
    """How one request's output is split. parser None: the request does not think (all of the
    output is content); include: include_reasoning (False: the reasoning is split off and dropped)."""

    parser: ReasoningParser | None
    include: bool = True

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output -> (reasoning or None, content or None)."""
        if self.parser is None:
            return None, text or None
        return self.parser.split(text)

    def stream(self) -> ReasoningStream | None:
        return self.parser.stream() if self.parser is not None else None


PARSERS = {
    "qwen3": ReasoningParser("qwen3", turn="<|im_start|>", switches=("enable_thinking",),
                             implicit_end=ImplicitEnd("<tool_call>", then="<function")),
    "deepseek_r1": ReasoningParser("deepseek_r1", turn="<｜Assistant｜>"),
    "glm45": ReasoningParser("glm45", turn="<|assistant|>", switches=("enable_thinking", "thinking")),
    "kimi_k2": ReasoningParser("kimi_k2", turn="<|im_assistant|>", switches=("thinking",),
                               implicit_end=ImplicitEnd("<|tool_calls_section_begin|>")),
}


def make_reasoning_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[name]
