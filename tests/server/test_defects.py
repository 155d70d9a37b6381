"""Server defects, each with the test that failed before its fix (in-process, the bundled model):

- extreme top_p / repetition_penalty (1e-300, 5e-324, 2.2e-313) answered 500 "logits are not
  finite": now 200 with their limits' answer;
- the 32-level nesting cap counted the whole body, so a legal 30-deep json_schema was a 400:
  schemas are bounded on their own (MAX_SCHEMA_DEPTH), the junk still by MAX_JSON_DEPTH;
- tool_choice "auto" cut by max_tokens inside a call streamed the first call, then the raw
  markup as content with finish_reason "tool_calls", while unstreamed said "length" with no
  calls: both now give the complete calls and never a marker as content;
- an out-of-vocabulary logit_bias key reported param "prompt";
- `stream_options: {}` with `stream: false` was a 400 (vLLM accepts it);
- the OpenAPI document lacked the 4xx / 5xx answers, the text/event-stream of a stream and
  /metrics' text/plain;
- prompts were rendered and encoded on the event loop, which served nothing else meanwhile.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hyla.engine.outputs import CompletionOutput
from hyla.server.api import create_app
from hyla.server.errors import (
    MAX_JSON_DEPTH,
    MAX_SCHEMA_DEPTH,
    APIError,
    check_json_tree,
)
from hyla.server.tool_choices import ToolChatChoice
from hyla.server.tool_parsers import make_parser
from tests.server.recording import RecordingEngine
from tests.server.test_structured import engine, http  # noqa: F401 (fixtures)

PROMPT = "The cat"
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def text(http, **body) -> dict:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


# ---- extreme sampling values ------------------------------------------------------------------
def test_extreme_top_p_and_repetition_penalty_answer_their_limits(http):
    greedy = text(http, temperature=0)["text"]
    for top_p in (1e-300, 5e-324, 2.2e-313):  # the nucleus is the top token alone: greedy
        assert text(http, temperature=1.0, top_p=top_p, seed=1)["text"] == greedy
    # a penalty past 1e-30 acts as its limit (the seen tokens' logits scaled out of reach)
    limit = text(http, temperature=0, repetition_penalty=1e-30)
    for penalty in (1e-300, 5e-324, 2.2e-313):
        got = text(http, temperature=0, repetition_penalty=penalty)
        assert got["text"] == limit["text"] and got["finish_reason"] == "length"
    assert text(http, temperature=0, repetition_penalty=1e300)["finish_reason"] == "length"


# ---- nesting: junk capped, schemas bounded on their own ---------------------------------------
def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    return schema


def test_a_legal_30_deep_schema_is_served(http):
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": _deep_schema(30)}}
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "response_format": fmt})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "tool_choice": "none", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": _deep_schema(30)}}]})
    assert r.status_code == 200, r.text


def test_junk_and_monster_schemas_are_still_refused(http):
    junk: list = []
    for _ in range(MAX_JSON_DEPTH + 5):
        junk = [junk]
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "x": junk})
    assert r.status_code == 400 and "the JSON body nests deeper" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "guided_json": _deep_schema(70)})
    assert r.status_code == 400 and "a schema in the JSON body nests deeper" in r.json()["error"]["message"]


def test_check_json_tree_bounds_schemas_from_their_root():
    def nest(levels: int) -> dict:
        node: dict = {}
        for _ in range(levels):
            node = {"k": node}
        return node

    check_json_tree({"response_format": {"json_schema": {"schema": nest(MAX_SCHEMA_DEPTH - 1)}}})
    check_json_tree({"tools": [{"function": {"parameters": nest(MAX_SCHEMA_DEPTH - 1)}}]})
    check_json_tree({"guided_json": nest(MAX_SCHEMA_DEPTH - 1)})
    for body in ({"guided_json": nest(MAX_SCHEMA_DEPTH + 1)}, {"response_format": {"other": nest(MAX_JSON_DEPTH)}},
                 {"tools": [{"function": {"description": nest(MAX_JSON_DEPTH)}}]}):
        with pytest.raises(APIError, match="nests deeper"):
            check_json_tree(body)


# ---- tool_choice "auto" cut by max_tokens -------------------------------------------------------
def _stream(choice: ToolChatChoice, pieces: list[str], finish: str):
    content, calls, reason, out = "", [], None, ""
    for k, piece in enumerate(pieces):
        out += piece
        last = k == len(pieces) - 1
        delta = choice.delta(CompletionOutput(0, out, list(range(k + 1)), None, finish if last else None))
        if delta is None:
            continue
        content += delta["delta"].get("content") or ""
        calls += delta["delta"].get("tool_calls", [])
        reason = delta["finish_reason"] or reason
    return content, [json.loads(c["function"]["arguments"]) for c in calls], reason


CUT = [("Sure. " + CALL + '<tool_call>{"name": "get_weather", "argu', "length", "Sure. ", [{"city": "Paris"}],
        "tool_calls"),  # cut inside the second call: the first is a call, the rest dropped
       ('Sure. <tool_call>{"name": "get_wea', "length", "Sure. ", [], "length"),  # inside the first
       ("Sure. " + CALL + '<tool_call>{"name": oops}</tool_call>', "stop", "Sure. ", [{"city": "Paris"}],
        "tool_calls"),  # a malformed call after a good one
       ('<tool_call>{"name": oops}</tool_call>', "stop", '<tool_call>{"name": oops}</tool_call>', [], "stop")]


@pytest.mark.parametrize("output,finish,content,calls,reason", CUT)
def test_streamed_and_whole_auto_tool_calls_agree_at_every_chunking(output, finish, content, calls, reason):
    parser = make_parser("hermes")
    whole = ToolChatChoice(0, None, None, parser, TOOLS).whole(CompletionOutput(0, output, [0], None, finish))
    message = whole["message"]
    assert (message["content"] or "", whole["finish_reason"]) == (content, reason)
    assert [json.loads(c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    for cut in range(1, len(output)):
        assert _stream(ToolChatChoice(0, None, None, parser, TOOLS), [output[:cut], output[cut:]], finish) == \
            (content, calls, reason), cut


def test_a_call_cut_by_max_tokens_over_http(engine):
    app = create_app(engine, "m", tool_call_parser="hermes", enable_auto_tool_choice=True)
    recorder = RecordingEngine()
    recorder.pieces = ["Sure. ", CALL, '<tool_call>{"name": "get_we', 'ather", "argu']
    recorder.finish = "length"
    app.state.server.async_engine = recorder
    body = {"messages": MSGS, "tools": TOOLS, "max_tokens": 40}
    with TestClient(app) as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert whole["message"]["content"] == "Sure. " and whole["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == [{"city": "Paris"}]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
    assert [json.loads(c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])] == \
        [{"city": "Paris"}]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["tool_calls"]


# ---- params the 400 names, and what vLLM accepts ------------------------------------------------
def test_an_out_of_vocabulary_logit_bias_key_names_logit_bias(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logit_bias": {"99999": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    r = http.post("/v1/completions", json={"prompt": [5, 99999], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_empty_stream_options_without_stream_is_accepted(http):
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MSGS})):
        r = http.post(path, json={**body, "max_tokens": 2, "stream": False, "stream_options": {}})
        assert r.status_code == 200, r.text
        r = http.post(path, json={**body, "max_tokens": 2, "stream_options": {"include_usage": False}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


# ---- the OpenAPI document ------------------------------------------------------------------------
def test_openapi_documents_the_answers(http):
    doc = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "413", "415", "500", "503"} <= set(responses), path
        assert "error" in responses["400"]["content"]["application/json"]["schema"]["properties"]
        assert set(responses["200"]["content"]) >= {"application/json", "text/event-stream"}
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "text/plain" in metrics and "application/json" not in metrics


def test_prompts_are_tokenized_off_the_event_loop(engine, http, monkeypatch):  # noqa: F811
    """Rendering and encoding a prompt (milliseconds for a long conversation) runs in a worker
    thread, not on the event loop, which meanwhile serves other requests and streams their tokens:
    chat, completions and the Messages API's chat path alike."""
    import asyncio

    on_loop = []
    real = engine.tokenizer.encode

    def encode(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop running in this thread
            on_loop.append(False)
        return real(*args, **kwargs)
    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    body = {"model": "m", "max_tokens": 2, "temperature": 0}
    assert http.post("/v1/chat/completions", json={**body, "messages": MSGS}).status_code == 200
    assert http.post("/v1/completions", json={**body, "prompt": PROMPT}).status_code == 200
    assert http.post("/v1/messages", json={**body, "messages": MSGS}).status_code == 200
    assert len(on_loop) >= 3 and not any(on_loop)
