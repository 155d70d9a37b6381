"""A stand-in for the server's AsyncEngine that scripts the model's output, and a chat template
that writes every part of a conversation into the prompt: for the tests of /v1/responses and
/v1/messages, which check what reaches the template and the engine and how a forced output is
rendered (the tiny model cannot write a tool call or think by itself)."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi.testclient import TestClient

from hyla.engine.outputs import CompletionOutput, RequestOutput
from hyla.server import prepare
from hyla.server.api import create_app

# Writes the tools' names, the thinking / effort variables and each message's role, content,
# earlier reasoning (in brackets: a <think> block would look like this turn's reasoning to a
# reasoning parser), tool calls and the call a tool result answers.
TEMPLATE = (
    "{% if tools %}[tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}]{% endif %}"
    "{% if enable_thinking is defined %}[thinking {{ enable_thinking }}]{% endif %}"
    "{% if reasoning_effort is defined %}[effort {{ reasoning_effort }}]{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['reasoning_content'] %}[reasoning {{ m['reasoning_content'] }}]{% endif %}{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}[call {{ c['id'] }} {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}]{% endfor %}"
    "{% if m['tool_call_id'] %}[result of {{ m['tool_call_id'] }}]{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class RecordingEngine:
    """Answers every request with `pieces` (one output per piece; the last finishes with
    `finish` and the engine's `stop_reason`, or fails with `error`) and keeps what it was
    submitted: (ids, params)."""

    def __init__(self):
        self.pieces: list[str] = ["the cat"]
        self.finish, self.stop_reason = "stop", None
        self.error: str | None = None  # the last output's engine failure
        self.cached = 0  # prompt tokens the prefix cache served
        self.submitted: list[tuple[list[int], object]] = []

    def start(self):
        pass

    def shutdown(self):
        pass

    def abort(self, rid):
        pass

    def submit(self, rid, ids, params, out=None):
        self.submitted.append((list(ids), params))
        loop = asyncio.get_running_loop()
        text = ""
        for k, piece in enumerate(self.pieces):
            text += piece
            last = k == len(self.pieces) - 1
            c = CompletionOutput(0, text, list(range(k + 1)), None, self.finish if last else None,
                                 self.stop_reason if last else None)
            failed = self.error if last else None
            loop.call_soon(out.put_nowait, RequestOutput(rid, None, ids, [c], finished=last, error=failed,
                                                         num_cached_tokens=self.cached))
        return out


class PromptLog:
    """Wraps hyla.server.prepare.render_prompt (monkeypatched) to keep each rendered prompt's text."""

    def __init__(self, render):
        self.render, self.texts = render, []

    def __call__(self, *args, **kwargs):
        prompt = self.render(*args, **kwargs)
        self.texts.append(prompt.text)
        return prompt

    @property
    def last(self) -> str:
        return self.texts[-1]


@contextlib.contextmanager
def recording_app(engine, monkeypatch, **flags):
    """create_app(engine, "m", TEMPLATE, **flags) with a RecordingEngine in place of the server's
    engine and a PromptLog on render_prompt -> (TestClient, RecordingEngine, PromptLog)."""
    prompts = PromptLog(prepare.render_prompt)
    monkeypatch.setattr(prepare, "render_prompt", prompts)
    app = create_app(engine, "m", chat_template=TEMPLATE, **flags)
    recorder = app.state.server.async_engine = RecordingEngine()
    with TestClient(app) as http:
        yield http, recorder, prompts
