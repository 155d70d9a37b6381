"""/v1/messages through the real `anthropic` client against the in-process app: the system prompt,
messages and tool results as the chat template receives them, content blocks whole and streamed
(the client's message stream accumulates the events), tool_use round trips, stop reasons,
thinking with a reasoning parser, x-api-key auth, count_tokens, and errors in Anthropic's shape
that name the field. The model's text is scripted (tests.server.recording)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from hyla import LLM
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.server.recording import PromptLog, RecordingEngine, recording_app

anthropic = pytest.importorskip("anthropic")

TOOLS = [{"name": "get_weather", "description": "the weather",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOL_FLAGS = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}
USER = [{"role": "user", "content": "the sun"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_kimi_checkpoint(tmp_path_factory.mktemp("messages"), "dense", with_tokenizer=True)
    return LLM(str(path), dtype="float32", max_model_len=4096).engine  # room for a thinking budget


@dataclass
class Served:
    client: anthropic.Anthropic
    http: TestClient
    recorder: RecordingEngine
    prompts: PromptLog

    @property
    def params(self):
        return self.recorder.submitted[-1][1]

    def create(self, **body):
        return self.client.messages.create(**{"model": "m", "max_tokens": 20, "messages": USER, **body})

    def stream(self, **body):
        """Through the client's stream helper -> (events, final message)."""
        with self.client.messages.stream(**{"model": "m", "max_tokens": 20, "messages": USER, **body}) as stream:
            events = list(stream)
            return events, stream.get_final_message()


@pytest.fixture
def serve(engine, monkeypatch):
    """serve(**create_app flags) -> a context giving a Served app with the recording template."""

    @contextlib.contextmanager
    def start(**flags):
        with recording_app(engine, monkeypatch, **flags) as (http, recorder, prompts):
            # the client sends the server's key (if any) as x-api-key
            client = anthropic.Anthropic(base_url="http://testserver", api_key=flags.get("api_key") or "x",
                                         http_client=http, max_retries=0)
            yield Served(client, http, recorder, prompts)

    return start


def test_text_whole_and_streamed(serve):
    with serve() as s:
        s.recorder.pieces = ["the cat", " sat"]
        m = s.create(system=[{"type": "text", "text": "be"}, {"type": "text", "text": " brief",
                                                                "cache_control": {"type": "ephemeral"}}],
                     extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 11},
                     metadata={"user_id": "u1"})
        assert s.prompts.last == "<|system|>be brief\n<|user|>the sun\n<|assistant|>"
        p = s.params
        assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens, p.stop_strings) == (0.5, 0.9, 7, 11, 20, [])
        assert m.id.startswith("msg_") and (m.type, m.role, m.model) == ("message", "assistant", "m")
        assert [(b.type, b.text) for b in m.content] == [("text", "the cat sat")]
        assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
        prompt_tokens = len(s.recorder.submitted[-1][0])
        assert (m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.output_tokens) == (prompt_tokens, 0, 2)
        events, final = s.stream(system="be brief")
        assert s.prompts.last == "<|system|>be brief\n<|user|>the sun\n<|assistant|>"
        assert [e.type for e in events if e.type != "text"] == [  # (the helper adds "text" events)
            "message_start", "content_block_start", "content_block_delta", "content_block_delta",
            "content_block_stop", "message_delta", "message_stop"]
        assert [e.delta.text for e in events if e.type == "content_block_delta"] == ["the cat", " sat"]
        assert final.content[0].text == "the cat sat" and final.stop_reason == "end_turn"
        assert (final.usage.input_tokens, final.usage.output_tokens) == (m.usage.input_tokens, 2)
        # what the prefix cache served is counted apart, as Anthropic counts cache reads
        s.recorder.cached = 3
        cached = s.create(system="be brief").usage
        _, streamed = s.stream(system="be brief")
        assert (cached.input_tokens, cached.cache_read_input_tokens) == (prompt_tokens - 3, 3)
        assert (streamed.usage.input_tokens, streamed.usage.cache_read_input_tokens) == (prompt_tokens - 3, 3)
        # on the wire: an `event:` line names each data line's type
        body = {"model": "m", "max_tokens": 5, "messages": USER, "stream": True}
        with s.http.stream("POST", "/v1/messages", json=body) as raw:
            lines = [line for line in raw.iter_lines() if line]
        assert all(e.startswith("event: ") and json.loads(d[6:])["type"] == e[7:]
                   for e, d in zip(lines[::2], lines[1::2], strict=True))


def test_tool_use_round_trip(serve):
    with serve(**TOOL_FLAGS) as s:
        s.recorder.pieces = ["Sure. ", CALL]
        m = s.create(tools=TOOLS)
        assert s.prompts.last.startswith("[tools: get_weather]<|user|>the sun")
        text, call = m.content
        assert text.text == "Sure. " and m.stop_reason == "tool_use"
        assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
        # the result (with text after it), after the assistant turn as the client sends it back
        s.recorder.pieces = ["the sun is big"]
        messages = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                           {"role": "user", "content": [
                               {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text",
                                                                                             "text": "red"}]},
                               {"type": "text", "text": "and the moon"}]}]
        answer = s.create(tools=TOOLS, messages=messages)
        assert s.prompts.last == (f'[tools: get_weather]<|user|>the sun\n<|assistant|>Sure. [call {call.id} '
                                  f'get_weather {{"city": "Paris"}}]\n<|tool|>red[result of {call.id}]\n'
                                  "<|user|>and the moon\n<|assistant|>")
        assert answer.content[0].text == "the sun is big" and answer.stop_reason == "end_turn"
        # streamed: the input arrives as input_json_delta
        s.recorder.pieces = ["Sure. ", CALL]
        events, final = s.stream(tools=TOOLS)
        starts = [e.content_block.type for e in events if e.type == "content_block_start"]
        assert starts == ["text", "tool_use"]
        assert [e.delta.partial_json for e in events if e.type == "content_block_delta"
                and e.delta.type == "input_json_delta"] == ['{"city": "Paris"}']
        assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_tool_choice(serve):
    with serve(**TOOL_FLAGS) as s:
        s.recorder.pieces = [CALL, CALL.replace("Paris", "Oslo")]
        both = s.create(tools=TOOLS)
        one = s.create(tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        _, streamed = s.stream(tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        assert [b.input["city"] for b in both.content] == ["Paris", "Oslo"]
        assert [b.input["city"] for b in one.content] == [b.input["city"] for b in streamed.content] == ["Paris"]
        none = s.create(tools=TOOLS, tool_choice={"type": "none"})
        assert none.content[0].type == "text" and none.stop_reason == "end_turn"
        pytest.importorskip("xgrammar")
        s.recorder.pieces = ['{"city": "Oslo"}']
        named = s.create(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
        assert s.params.guide is not None and [b.input for b in named.content] == [{"city": "Oslo"}]
        s.recorder.pieces = ['[{"name": "get_weather", "parameters": {"city": "Rome"}}]']
        any_ = s.create(tools=TOOLS, tool_choice={"type": "any"})
        assert s.params.guide is not None and [b.input for b in any_.content] == [{"city": "Rome"}]
        assert any_.stop_reason == "tool_use"


def test_stop_reasons(serve):
    with serve() as s:
        s.recorder.finish, s.recorder.stop_reason = "stop", "mat"  # the engine matched a stop string
        m = s.create(stop_sequences=["mat", "dog"])
        assert s.params.stop_strings == ["mat", "dog"]
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "mat")
        _, final = s.stream(stop_sequences=["mat"])
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "mat")
        s.recorder.finish, s.recorder.stop_reason = "length", None
        assert s.create().stop_reason == "max_tokens"
        s.recorder.finish, s.recorder.stop_reason = "stop", 2  # EOS
        assert (s.create().stop_reason, s.create().stop_sequence) == ("end_turn", None)


def test_prefill_continues_the_final_assistant_message(serve):
    with serve() as s:
        m = s.create(messages=USER + [{"role": "assistant", "content": "the big"}])
        assert s.prompts.last.endswith("<|assistant|>the big")  # no new assistant turn is opened
        assert m.content[0].text == "the cat"


def test_thinking(serve):
    with serve(reasoning_parser="qwen3") as s:
        s.recorder.pieces = ["I think", " hard</think>", "the cat"]
        m = s.create(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 1024},
                     output_config={"effort": "low"})
        assert "[thinking True][effort low]" in s.prompts.last
        thinking, text = m.content
        assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", "I think hard", "")
        assert text.text == "the cat"
        events, final = s.stream(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 1024})
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "I think hard"
        assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "I think hard"
        # handed back, a thinking block is that turn's reasoning_content
        s.create(messages=USER + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                                  {"role": "user", "content": "a dog"}])
        assert "<|assistant|>[reasoning I think hard]the cat\n<|user|>a dog" in s.prompts.last
        # thinking off: the template is told, and the output is all text
        off = s.create(thinking={"type": "disabled"})
        assert "[thinking False]" in s.prompts.last
        assert [(b.type, b.text) for b in off.content] == [("text", "I think hard</think>the cat")]
        # absent: the template's default, and the parser still splits what the model thinks
        assert "[thinking" not in (s.create(), s.prompts.last)[1]


def test_count_tokens(serve):
    with serve(**TOOL_FLAGS) as s:
        counted = s.client.messages.count_tokens(model="m", messages=USER, system="be brief", tools=TOOLS)
        m = s.create(system="be brief", tools=TOOLS)
        assert counted.input_tokens == m.usage.input_tokens > 0


def test_api_key_as_x_api_key(serve):
    with serve(api_key="k") as s:
        assert s.create().content[0].text == "the cat"
        wrong = anthropic.Anthropic(base_url="http://testserver", api_key="nope", http_client=s.http, max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            wrong.messages.create(model="m", max_tokens=5, messages=USER)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        bearer = s.http.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": USER},
                             headers={"authorization": "Bearer k"})
        assert bearer.status_code == 200


@pytest.mark.parametrize("body,field", [
    ({"max_tokens": None}, "max_tokens"),  # required
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),  # the prompt and max_tokens pass max_model_len
    ({"model": "other"}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": USER + [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
     "messages.1.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "tools.0.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"temperature": -1.0}, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking"),  # no --reasoning-parser
    ({"mcp_servers": [{"name": "x"}]}, "mcp_servers"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"n": 2}, "n"),  # OpenAI's fields are refused, not ignored
    ({"stop": ["x"]}, "stop"),
])
def test_errors_are_anthropic_shaped_and_name_the_field(serve, body, field):
    request = {"model": "m", "max_tokens": 20, "messages": USER, **body}
    with serve(**TOOL_FLAGS) as s:
        r = s.http.post("/v1/messages", json={k: v for k, v in request.items() if v is not None})
    assert r.status_code == (404 if field == "model" else 400), r.text
    error = r.json()
    assert error["type"] == "error" and set(error) == {"type", "error"}
    assert error["error"]["type"] == ("not_found_error" if field == "model" else "invalid_request_error")
    assert field in error["error"]["message"], error


def test_thinking_budget_is_checked(serve):
    with serve(reasoning_parser="qwen3") as s:
        for thinking, max_tokens in (({"type": "enabled", "budget_tokens": 100}, 2000),
                                     ({"type": "enabled", "budget_tokens": 1024}, 1024)):
            with pytest.raises(anthropic.BadRequestError) as e:
                s.create(thinking=thinking, max_tokens=max_tokens)
            assert "thinking.budget_tokens" in e.value.body["error"]["message"]


def test_engine_failure(serve):
    with serve() as s:
        s.recorder.pieces, s.recorder.error = ["the cat", " sat"], "device fell over"
        with pytest.raises(anthropic.InternalServerError) as e:
            s.create()
        assert e.value.body["error"] == {"type": "api_error", "message": e.value.body["error"]["message"]}
        assert "device fell over" in e.value.body["error"]["message"]
        with pytest.raises(anthropic.APIStatusError) as e:  # the stream's error event
            s.stream()
        assert "device fell over" in str(e.value.body)
        s.recorder.error = None
        assert s.create().content[0].text == "the cat sat"
