"""Reasoning parsers and the chat template fields.

The splits are checked on scripted outputs (the tiny model cannot think), whole and streamed with
the text cut at every offset, through the choice builders the server uses: the reasoning and the
content streamed add up to the whole response, and tool calls are read from the content only.
The chat template fields are checked by the prompt the engine receives (a recording stand-in for
the engine loop decodes it), and the grammar's wait for </think> by the params it receives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hyla import LLM
from hyla.cli import main as cli_main
from hyla.engine.outputs import CompletionOutput
from hyla.server.api import create_app
from hyla.server.chat_prompt import load_chat_template
from hyla.server.choices import ChatChoice
from hyla.server.reasoning_parsers import PARSERS, RequestReasoning, make_reasoning_parser
from hyla.server.tool_choices import NamedToolChoice, ToolChatChoice
from hyla.server.tool_parsers import make_parser
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.server.recording import RecordingEngine

MSGS = [{"role": "user", "content": "the sun"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
QWEN_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
KIMI_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')

# (parser, output, reasoning, content): the whole split of a forced output
SPLITS = [
    *[(name, text, r, c) for name in PARSERS for text, r, c in [
        ("<think>I think.</think>The answer.", "I think.", "The answer."),  # the model opened <think>
        ("I think.</think>The answer.", "I think.", "The answer."),  # the template opened it
        ("I think, and think", "I think, and think", None),  # never ends: all reasoning
        ("<think>I think.</think>", "I think.", None),
        ("</think>The answer.", "", "The answer."),
        ("a<think>b</think>c</think>d", "a<think>b", "c</think>d"),  # only a leading <think> is dropped
        ("<think", "<think", None),
    ]],
    ("qwen3", "I call it." + QWEN_CALL, "I call it.", QWEN_CALL),  # a tool call ends the reasoning
    ("qwen3", "Maybe <tool_call> here.</think>No.", "Maybe <tool_call> here.", "No."),  # a mention does not
    ("qwen3", "Maybe <tool_call>", "Maybe <tool_call>", None),
    ("deepseek_r1", "I call it." + QWEN_CALL, "I call it." + QWEN_CALL, None),
    ("kimi_k2", "I call it." + KIMI_CALL, "I call it.", KIMI_CALL),
    ("glm45", "I call it." + KIMI_CALL, "I call it." + KIMI_CALL, None),
]


@pytest.mark.parametrize("name,text,reasoning,content", SPLITS)
def test_whole_split(name, text, reasoning, content):
    assert make_reasoning_parser(name).split(text) == (reasoning, content)


def _chunkings(text: str):
    """Every cut of `text` into two pieces, and one character at a time."""
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]
    yield list(text)


def _stream(builder, pieces: list[str]) -> tuple[str, str, list, str | None]:
    """Feed cumulative outputs to a choice builder -> (reasoning, content, tool calls, finish reason)."""
    reasoning = content = ""
    calls, finish, text = [], None, ""
    for k, piece in enumerate(pieces):
        text += piece
        last = k == len(pieces) - 1
        chunk = builder.delta(CompletionOutput(0, text, list(range(k + 1)), None, "stop" if last else None))
        if chunk is None:
            continue
        delta = chunk["delta"]
        assert delta.get("reasoning") == delta.get("reasoning_content")
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        calls += delta.get("tool_calls", [])
        finish = chunk["finish_reason"] or finish
    return reasoning, content, calls, finish


@pytest.mark.parametrize("name,text,reasoning,content", SPLITS)
def test_streamed_split_at_every_offset(name, text, reasoning, content):
    split = RequestReasoning(make_reasoning_parser(name))
    whole = ChatChoice(0, None, None, split).whole(CompletionOutput(0, text, [0], None, "stop"))["message"]
    assert (whole["reasoning"], whole["reasoning_content"], whole["content"]) == (reasoning, reasoning, content)
    for pieces in _chunkings(text):
        assert _stream(ChatChoice(0, None, None, split), pieces)[:2] == (reasoning or "", content or ""), pieces


@pytest.mark.parametrize("name,text,call", [("qwen3", "Let me check.</think>Sure. " + QWEN_CALL, "qwen3_coder"),
                                            ("qwen3", "Let me check." + QWEN_CALL, "qwen3_coder"),
                                            ("kimi_k2", "Let me check.</think>Sure. " + KIMI_CALL, "kimi_k2"),
                                            ("kimi_k2", "Let me check." + KIMI_CALL, "kimi_k2")])
def test_tool_calls_are_read_from_the_content_only(name, text, call):
    split = RequestReasoning(make_reasoning_parser(name))
    parser = make_parser(call)
    whole = ToolChatChoice(0, None, None, parser, TOOLS, split).whole(CompletionOutput(0, text, [0], None, "stop"))
    message = whole["message"]
    assert message["reasoning"] == "Let me check." and whole["finish_reason"] == "tool_calls"
    assert message["content"] == ("Sure. " if "</think>" in text else None)
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}]
    for pieces in _chunkings(text):
        reasoning, content, calls, finish = _stream(ToolChatChoice(0, None, None, parser, TOOLS, split), pieces)
        assert (reasoning, content, finish) == ("Let me check.", message["content"] or "", "tool_calls")
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]


def test_a_tool_call_mentioned_in_the_reasoning_is_not_parsed():
    split = RequestReasoning(make_reasoning_parser("deepseek_r1"))
    text = "Could call " + QWEN_CALL + "</think>No need."
    whole = ToolChatChoice(0, None, None, make_parser("qwen3_coder"), TOOLS, split).whole(
        CompletionOutput(0, text, [0], None, "stop"))
    assert whole["message"]["content"] == "No need." and "tool_calls" not in whole["message"]
    assert whole["finish_reason"] == "stop"


def test_forced_tool_arguments_follow_the_reasoning():
    split = RequestReasoning(make_reasoning_parser("qwen3"))
    text = 'Paris, then.</think>{"city": "Paris"}'
    message = NamedToolChoice(0, None, None, "get_weather", split).whole(
        CompletionOutput(0, text, [0], None, "stop"))["message"]
    assert message["reasoning"] == "Paris, then." and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("name,prompt,variables,thinks", [
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", {}, True),
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", {}, True),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", {}, False),  # non-thinking mode's empty block
    ("qwen3", "<|im_start|>assistant\n", {"enable_thinking": False}, False),
    # an earlier turn's closed reasoning does not close this one
    ("qwen3", "<|im_start|>assistant\n<think>\nr\n</think>\n\nok<|im_end|>\n<|im_start|>assistant\n", {}, True),
    # continue_final_message: the final turn closed its reasoning already
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is", {}, False),
    ("glm45", "<|assistant|><think></think>", {}, False),
    ("glm45", "<|assistant|>", {"enable_thinking": False}, False),
    ("glm45", "<|assistant|>", {"enable_thinking": False, "thinking": True}, True),
    ("kimi_k2", "<|im_assistant|>assistant<|im_middle|>", {"thinking": False}, False),
    ("kimi_k2", "<|im_assistant|>assistant<|im_middle|>", {"enable_thinking": False}, True),
    ("deepseek_r1", "<｜User｜>hi<｜Assistant｜><think>\n", {"enable_thinking": False}, True),
])
def test_whether_a_request_thinks(name, prompt, variables, thinks):
    assert make_reasoning_parser(name).thinks(prompt, variables) is thinks


def test_load_chat_template(tmp_path, capsys):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] + '\\n' }}é\n", encoding="utf-8")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] + '\\n' }}é\n"  # a file: as it is
    assert load_chat_template("{{ bos_token }}\\nsun é") == "{{ bos_token }}\nsun é"  # text: escapes decoded
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(SystemExit):  # before the model loads
        cli_main(["serve", "--chat-template", str(tmp_path / "missing.jinja")])
    assert "no such file" in capsys.readouterr().err


def test_unknown_reasoning_parser_fails_at_start_up(engine, capsys):
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        create_app(engine, "m", reasoning_parser="nope")
    with pytest.raises(SystemExit):
        cli_main(["serve", "--reasoning-parser", "nope"])
    assert "invalid choice" in capsys.readouterr().err


# ---- over HTTP ------------------------------------------------------------------------------

TEMPLATE = ("{{ bos_token }}{% if enable_thinking is defined %}{% if enable_thinking %}sun{% else %}moon{% endif %} "
            "{% endif %}{% if reasoning_effort is defined %}{{ reasoning_effort }} {% endif %}"
            "{% if big %}big {% endif %}"
            "{% for m in messages %}{% if m['role'] == 'user' and m['content'] == 'raise' %}"
            "{{ raise_exception('no raising') }}{% endif %}<|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }} "
            "{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return build_kimi_checkpoint(tmp_path_factory.mktemp("reasoning"), "dense", with_tokenizer=True)


@pytest.fixture(scope="module")
def engine(model_path):
    return LLM(str(model_path), dtype="float32", max_model_len=128).engine


def _http(engine, recorder: RecordingEngine | None = None, **flags) -> TestClient:
    app = create_app(engine, "m", **flags)
    if recorder is not None:
        app.state.server.async_engine = recorder
    return TestClient(app)


def _prompt(engine, recorder: RecordingEngine) -> str:
    return engine.tokenizer.decode(recorder.submitted[-1][0], skip_special_tokens=False)


def _events(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_reasoning_whole_and_streamed_with_usage(engine):
    recorder = RecordingEngine()
    recorder.pieces = ["<think>", "the cat", " sat</thi", "nk>", "a dog", " ran"]
    with _http(engine, recorder, reasoning_parser="deepseek_r1") as http:
        body = {"messages": MSGS, "stream_options": None}
        r = http.post("/v1/chat/completions", json=body).json()
        message = r["choices"][0]["message"]
        assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("the cat sat",) * 2 + (
            "a dog ran",)
        assert r["usage"]["completion_tokens"] == len(recorder.pieces)  # the reasoning's tokens too
        events = _events(http, {"messages": MSGS, "stream_options": {"include_usage": True}})
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "the cat sat"
        assert "".join(d.get("reasoning") or "" for d in deltas) == "the cat sat"
        assert "".join(d.get("content") or "" for d in deltas) == "a dog ran"
        assert events[-1]["usage"]["completion_tokens"] == len(recorder.pieces)
        assert recorder.submitted[-1][1].skip_special_tokens is False  # markers may be special tokens
        # include_reasoning false: split off and dropped
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "include_reasoning": False}).json()
        assert r["choices"][0]["message"]["reasoning"] is None and r["choices"][0]["message"]["content"] == "a dog ran"
        deltas = [e["choices"][0]["delta"] for e in _events(http, {"messages": MSGS, "include_reasoning": False})]
        assert not any("reasoning" in d or "reasoning_content" in d for d in deltas)
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "include_reasoning": False, "logprobs": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "include_reasoning"


def test_without_a_reasoning_parser_the_text_is_content(engine):
    recorder = RecordingEngine()
    recorder.pieces = ["the cat</think>", "a dog"]
    with _http(engine, recorder) as http:
        message = http.post("/v1/chat/completions", json={"messages": MSGS}).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "the cat</think>a dog"}


def test_reasoning_then_tool_calls_over_http(engine):
    recorder = RecordingEngine()
    recorder.pieces = ["I should", " look.", "</think>", "Sure. <tool_call>\n<function=get_weather>\n",
                       "<parameter=city>",
                       "\nParis\n</parameter>\n</function>\n</tool_call>"]
    with _http(engine, recorder, reasoning_parser="qwen3", tool_call_parser="qwen3_coder",
               enable_auto_tool_choice=True) as http:
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS}).json()
        choice = r["choices"][0]
        assert choice["message"]["reasoning"] == "I should look." and choice["message"]["content"] == "Sure. "
        assert choice["finish_reason"] == "tool_calls"
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
        deltas = [e["choices"][0] for e in _events(http, {"messages": MSGS, "tools": TOOLS})]
        assert "".join(d["delta"].get("reasoning") or "" for d in deltas) == "I should look."
        assert "".join(d["delta"].get("content") or "" for d in deltas) == "Sure. "
        assert [c["function"]["name"] for d in deltas for c in d["delta"].get("tool_calls", [])] == ["get_weather"]
        assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("template,body,waits,reasoning,content", [
    # the tiny template leaves the reasoning open: the grammar waits for </think>
    (None, {}, True, "the cat", '{"a": 1}'),
    # the reasoning not returned: the grammar still waits for it to end (vLLM's rule), it is dropped
    (None, {"include_reasoning": False}, True, None, '{"a": 1}'),
    # the prompt closed the reasoning, or thinking is switched off: all of the output is content
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}<|assistant|></think>", {}, False, None,
     'the cat</think>{"a": 1}'),
    (None, {"chat_template_kwargs": {"enable_thinking": False}}, False, None, 'the cat</think>{"a": 1}'),
])
def test_the_grammar_waits_for_the_reasoning_end(engine, template, body, waits, reasoning, content):
    pytest.importorskip("xgrammar")
    recorder = RecordingEngine()
    recorder.pieces = ["the cat</think>", '{"a": 1}']
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    with _http(engine, recorder, reasoning_parser="qwen3", chat_template=template) as http:
        r = http.post("/v1/chat/completions", json={
            "messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}, **body})
        assert r.status_code == 200, r.text
    params = recorder.submitted[-1][1]
    assert params.guide is not None
    end = engine.tokenizer.encode("</think>", add_special_tokens=False)
    assert params.reasoning_end_token_ids == (end if waits else None)
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (reasoning, content)


def test_template_kwargs_and_fields_reach_the_template(engine, tmp_path):
    recorder = RecordingEngine()
    with _http(engine, recorder, chat_template=TEMPLATE) as http:
        def prompt(**body) -> str:
            r = http.post("/v1/chat/completions", json={"messages": MSGS, **body})
            assert r.status_code == 200, r.text
            return _prompt(engine, recorder)

        assert prompt() == "<s> <|user|> the sun </s> <|assistant|>"  # --chat-template is used
        assert prompt(chat_template_kwargs={"enable_thinking": True, "big": True}).startswith("<s> sun big <|user|>")
        assert prompt(chat_template_kwargs={"enable_thinking": False}).startswith("<s> moon <|user|>")
        # reasoning_effort is a template variable, and "none" switches thinking off
        assert "<unk> <|user|>" in prompt(reasoning_effort="low")
        assert prompt(reasoning_effort="low").startswith("<s> sun")
        assert prompt(reasoning_effort="none").startswith("<s> moon")
        assert prompt(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}).startswith("<s> sun")
        assert not prompt(add_generation_prompt=False).endswith("<|assistant|>")
        assert not prompt(chat_template_kwargs={"add_generation_prompt": False}).endswith("<|assistant|>")
        final = MSGS + [{"role": "assistant", "content": "the big"}]
        assert prompt(messages=final, add_generation_prompt=False, continue_final_message=True).endswith(
            "<|assistant|> the big")
        assert prompt(messages=final, add_generation_prompt=False).endswith("the big </s>")


def test_a_request_template_needs_the_trust_flag(engine):
    recorder = RecordingEngine()
    mine = "{% for m in messages %}{{ m['content'] }} tree{% endfor %}"
    with _http(engine, recorder) as http:
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "chat_template": mine})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    with _http(engine, recorder, trust_request_chat_template=True) as http:
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "chat_template": mine})
        assert r.status_code == 200 and _prompt(engine, recorder) == "the sun tree"
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "chat_template": "{% for %}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


@pytest.mark.parametrize("body,param", [
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}, "add_generation_prompt": True}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": "no"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"thinking_token_budget": 10}, "thinking_token_budget"),
    ({"messages": [{"role": "user", "content": "raise"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": False, "chat_template_kwargs": {"big": True}}, None),  # fine: a control
])
def test_bad_template_requests_are_400s(engine, body, param):
    recorder = RecordingEngine()
    with _http(engine, recorder, chat_template=TEMPLATE) as http:
        r = http.post("/v1/chat/completions", json={"messages": MSGS, **body})
    if param is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
