"""Tool calling over HTTP: the template receives the tools, tool_choice rules, and the parsed
calls whole and streamed. The model's text is scripted (a stand-in for the engine loop), since
the tiny model cannot write a tool call by itself; the engine still encodes and validates."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from hyla import LLM
from hyla.server.api import create_app
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.server.recording import RecordingEngine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
MSGS = [{"role": "user", "content": "the sun"}]
HERMES = ['Sure', '. <tool', '_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}</tool_call>',
          '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>']


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = build_kimi_checkpoint(tmp_path_factory.mktemp("tools"), "dense", with_tokenizer=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    # a template that writes each tool's name into the prompt (as real templates do)
    config["chat_template"] = ("{% if tools %}<|system|> {% for t in tools %}{{ t['function']['name'] }} the "
                               "{% endfor %}{% endif %}" + config["chat_template"])
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def engine(model_path):
    return LLM(str(model_path), dtype="float32", max_model_len=128).engine


def _client(engine, scripted: RecordingEngine | None = None, **flags):
    app = create_app(engine, "m", **flags)
    if scripted is not None:
        app.state.server.async_engine = scripted
    return TestClient(app)


def test_the_template_receives_the_tools(engine):
    with _client(engine, tool_call_parser="hermes", enable_auto_tool_choice=True) as http:
        plain = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1}).json()
        tools = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "tools": TOOLS,
                                                        "tool_choice": "none"}).json()
    assert tools["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 3  # <|system|> name the


def test_auto_needs_the_server_flags_and_none_does_not(engine):
    scripted = RecordingEngine()
    scripted.pieces = HERMES
    with _client(engine, scripted) as http:
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "tool_choice": "none"})
        assert r.status_code == 200
        message = r.json()["choices"][0]["message"]
        assert message["content"] == "".join(HERMES) and "tool_calls" not in message


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_requests_are_named(engine, body, param):
    with _client(engine, tool_call_parser="hermes", enable_auto_tool_choice=True) as http:
        r = http.post("/v1/chat/completions", json={"messages": MSGS, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_earlier_calls_and_tool_results_render(engine):
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"}]
    with _client(engine, tool_call_parser="hermes", enable_auto_tool_choice=True) as http:
        r = http.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "max_tokens": 1})
        assert r.status_code == 200, r.text
        msgs[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
        r = http.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


QWEN3_CODER = ["Sure. <tool_call>\n<function=get_weather>\n<parameter=city>\nPar", "is\n</parameter>\n</function>\n",
               "</tool_call>\n<tool_call><function=get_weather><parameter=city>Oslo</parameter></function></tool_call>"]
KIMI_K2 = ["Sure. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>",
           '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1',
           '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>']


@pytest.mark.parametrize("parser,pieces", [("hermes", HERMES), ("qwen3_coder", QWEN3_CODER), ("kimi_k2", KIMI_K2)])
def test_auto_tool_calls_whole_and_streamed(engine, parser, pieces):
    scripted = RecordingEngine()
    scripted.pieces = pieces
    with _client(engine, scripted, tool_call_parser=parser, enable_auto_tool_choice=True) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        whole = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
        content, streamed, finish = "", {}, None
        for chunk in client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                assert "<" not in content  # no marker is ever streamed as content
                for tc in c.delta.tool_calls or []:
                    streamed.setdefault(tc.index, ["", ""])
                    streamed[tc.index][0] += tc.function.name or ""
                    streamed[tc.index][1] += tc.function.arguments or ""
                finish = c.finish_reason or finish
        assert content == "Sure. " and finish == "tool_calls"
        assert [(n, json.loads(a)) for n, a in (streamed[i] for i in sorted(streamed))] == calls


def test_kimi_k2_calls_keep_their_ids(engine):
    scripted = RecordingEngine()
    scripted.pieces = ["<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0",
                       '<|tool_call_argument_begin|>{"city": "Lima"}<|tool_call_end|><|tool_calls_section_end|>']
    with _client(engine, scripted, tool_call_parser="kimi_k2", enable_auto_tool_choice=True) as http:
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS}).json()
    call = r["choices"][0]["message"]["tool_calls"][0]
    assert call["id"] == "functions.get_weather:0" and json.loads(call["function"]["arguments"]) == {"city": "Lima"}
    assert r["choices"][0]["message"]["content"] is None
