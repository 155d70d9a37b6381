"""Structured outputs and forced tool calls on the bundled model (byte-level BPE, 4096 tokens):
the grammar mask makes its output parse, whatever the model would have written."""

from __future__ import annotations

import json
import re

import openai
import pytest
import torch
from fastapi.testclient import TestClient

pytest.importorskip("xgrammar")

from hyla import LLM  # noqa: E402
from hyla.engine.sampling_params import SamplingParams  # noqa: E402
from hyla.models import default_model_path  # noqa: E402
from hyla.server.api import create_app  # noqa: E402
from hyla.server.structured import Grammars, GuideSpec  # noqa: E402

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "count"], "additionalProperties": False}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
MSGS = [{"role": "user", "content": "Is the sky blue?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}]


def _check(obj: dict) -> None:
    assert set(obj) == {"answer", "count"} and obj["answer"] in ("yes", "no") and 0 <= obj["count"] <= 9, obj


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the test machine's cores are shared: one thread is several times faster
    yield LLM(default_model_path(), dtype="float32", max_model_len=512).engine
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def http(engine):
    with TestClient(create_app(engine, "m", tool_call_parser="hermes", enable_auto_tool_choice=True)) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


def test_chat_json_schema_with_the_openai_client(client):
    out = client.chat.completions.create(
        model="m", messages=MSGS, max_tokens=40, temperature=0, extra_body=COMPACT,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    assert out.choices[0].finish_reason == "stop"
    _check(json.loads(out.choices[0].message.content))


def test_completions_json_schema_n3_seeded_sampling(client):
    kw = dict(model="m", prompt="The answer is", max_tokens=40, temperature=1.0, n=3, seed=5,
              extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}, **COMPACT})
    out = client.completions.create(**kw)
    assert len(out.choices) == 3
    for c in out.choices:
        assert c.finish_reason == "stop"
        _check(json.loads(c.text))
    assert [c.text for c in out.choices] == [c.text for c in client.completions.create(**kw).choices]


def test_json_object_streamed_equals_whole(client):
    kw = dict(model="m", prompt="Data:", max_tokens=60, temperature=0, extra_body={
        "response_format": {"type": "json_object"}, **COMPACT})
    whole = client.completions.create(**kw).choices[0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == whole.text
    if whole.finish_reason == "stop":  # a long string value may run out of tokens: then it is a prefix
        assert isinstance(json.loads(whole.text), dict)
    assert whole.text.startswith("{")


@pytest.mark.parametrize("extra,pattern", [
    ({"guided_regex": r"[a-z]{3}-[0-9]{2}"}, r"[a-z]{3}-[0-9]{2}"),
    ({"structured_outputs": {"regex": r"(red|green) [0-9]"}}, r"(red|green) [0-9]"),
    ({"guided_choice": ["alpha", "beta \"quoted\""]}, r'alpha|beta "quoted"'),
    ({"structured_outputs": {"choice": ["x", "y"]}}, r"x|y"),
    ({"guided_grammar": 'root ::= "ab" [0-9] [0-9]?'}, r"ab[0-9][0-9]?"),
    ({"guided_json": json.dumps(SCHEMA), **COMPACT}, None),
])
def test_guided_extras(http, extra, pattern):
    r = http.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 30, "temperature": 1.0, "seed": 1,
                                           **extra})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop"
    if pattern is None:
        _check(json.loads(c["text"]))
    else:
        assert re.fullmatch(pattern, c["text"]), c["text"]


@pytest.mark.parametrize("extra,param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": 7}}}}, "guided_json"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_regex": "a", "min_tokens": 2}, "guided_regex"),
])
def test_bad_constraints_are_400_naming_the_field(http, extra, param):
    r = http.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_one_requests_grammar_never_touches_another(engine):
    # not the server's engine: its loop thread steps that one
    engine = LLM(default_model_path(), dtype="float32", max_model_len=512).engine
    grammars = Grammars(engine)
    guide = grammars.compile(GuideSpec("regex", "[0-9]+"))
    alone = engine_generate(engine, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)])[0]
    both = engine_generate(engine, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0, max_tokens=12, guide=guide)])
    assert both[0] == alone
    assert re.fullmatch("[0-9]+", both[1])


def engine_generate(engine, params: list[SamplingParams]) -> list[str]:
    for i, p in enumerate(params):
        engine.add_request(f"iso-{i}", "The answer is", p)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = o.outputs[0].text
    return [out[f"iso-{i}"] for i in range(len(params))]


def test_named_tool_choice_writes_valid_arguments_whole_and_streamed(client):
    kw = dict(model="m", messages=MSGS, tools=TOOLS, max_tokens=30, temperature=0, extra_body=COMPACT,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**kw).choices[0]
    call = whole.message.tool_calls[0]
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    name, args = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
    assert (name, args) == ("get_time", call.function.arguments)


def test_required_tool_choice_gives_tool_calls(client):
    out = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, tool_choice="required",
                                         max_tokens=60, temperature=0, extra_body=COMPACT).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.tool_calls
    for call in out.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert (call.function.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"zone"}))


def test_auto_tool_call_parsed_from_forced_model_text(http):
    """End to end: the grammar makes the model write a hermes tool call, the parser reads it."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    regex = re.sub(r"([{}\[\]().*+?^$|\\])", r"\\\1", text)
    body = {"messages": MSGS, "tools": TOOLS, "max_tokens": 120, "temperature": 0, "guided_regex": regex}
    r = http.post("/v1/chat/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    events = [json.loads(line[6:]) for line in http.post("/v1/chat/completions", json={**body, "stream": True})
              .text.splitlines() if line.startswith("data: {")]
    calls = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls", [])]
    assert [json.loads(tc["function"]["arguments"]) for tc in calls] == [{"city": "Paris"}]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_guided_and_unguided_requests_speculate_in_one_batch():
    """The guided request's drafts are checked against its grammar (tests/engine/test_spec_grammar.py)."""
    llm = LLM(default_model_path(), dtype="float32", max_model_len=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    guide = Grammars(llm.engine).compile(GuideSpec("regex", "(ab ){2,8}c"))
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(["ab ab ab ab ab ab", "ab ab ab ab ab ab"], [plain, SamplingParams(
        temperature=0, max_tokens=40, guide=guide)])
    assert re.fullmatch("(ab ){2,8}c", outs[1].outputs[0].text), outs[1].outputs[0].text
    assert outs[1].outputs[0].finish_reason == "stop"
    assert llm.get_metrics()["spec_num_verify_steps"] > 0
    m = llm.get_metrics()
    assert m["kv_pages_running"] == 0 and m["state_slots_running"] == 0  # the draft pages went back


class _BrokenGuide:
    """A grammar whose matcher fails: it must fail its own request only."""

    def matcher(self):
        return self

    def fill_next_token_bitmask(self, bitmask, index):
        raise RuntimeError("matcher fell over")

    def accept_token(self, token):
        return True

    def is_terminated(self):
        return False


def test_a_failing_grammar_fails_its_request_alone():
    llm = LLM(default_model_path(), dtype="float32", max_model_len=128)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate("The answer is", plain)[0].outputs[0].text
    outs = llm.generate(["The answer is", "The answer is"], [plain, SamplingParams(max_tokens=6, guide=_BrokenGuide())])
    assert outs[0].outputs[0].text == alone and outs[0].error is None
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].error
