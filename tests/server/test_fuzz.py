"""A bounded fuzz of the HTTP API (schemathesis-style, with hypothesis): bodies mixing valid and
junk values for every field either endpoint reads, on the bundled model. No 5xx, ever; a 200 is a
well-formed answer (a stream ends with [DONE] and no error event). Derandomised: the same cases
on every run."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("xgrammar")

from hyla import LLM  # noqa: E402
from hyla.models import default_model_path  # noqa: E402
from hyla.server.api import create_app  # noqa: E402

JUNK = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 20, 10 ** 20) | st.text(max_size=8)
                    | st.floats(allow_nan=False, allow_infinity=False), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
SCHEMAS = st.sampled_from([{"type": "object"}, {"type": "integer", "minimum": 0, "maximum": 9},
                           {"enum": ["a", "b"]}, {"type": "string", "maxLength": 2}, {"type": "array"},
                           {"type": "nope"}, {"enum": []}, {"not": {}}, {"type": "object", "required": ["x"]}])
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["a"]}}}
COMMON = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "n": st.integers(1, 3), "seed": st.integers(-(2 ** 63), 2 ** 64 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3), "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 5000).map(str), st.floats(-100, 100), max_size=3),
    "stream": st.booleans(), "stream_options": st.just({"include_usage": True}), "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 3), "skip_special_tokens": st.booleans(),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}])
    | SCHEMAS.map(lambda s: {"type": "json_schema", "json_schema": {"schema": s}}),
    "guided_regex": st.sampled_from(["[0-9]{1,2}", "a|b", "(", "x*"]) | st.text(max_size=6),
    "guided_choice": st.lists(st.text(max_size=4), max_size=3), "guided_json": SCHEMAS,
    "guided_grammar": st.sampled_from(['root ::= "a"', "root ::= x"]),
    "structured_outputs": st.sampled_from([{"regex": "[a-c]"}, {"choice": ["x"]}, {"disable_any_whitespace": True},
                                           {"json_object": True}]),
}
PROMPT = st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 5000), min_size=1, max_size=5)
COMPLETION = {**COMMON, "logprobs": st.integers(0, 5), "echo": st.booleans(), "best_of": st.integers(1, 3)}
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                           "content": st.text(max_size=12)}), min_size=1, max_size=3)
CHAT = {**COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3), "tools": st.just([TOOL]),
        "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}])}


@st.composite
def bodies(draw, required: dict, fields: dict) -> dict:
    """The required fields and max_tokens plus up to 4 optional fields, plausible values; then,
    one time in three, one field (maybe a required one) replaced by any JSON value."""
    body = {k: draw(v) for k, v in {**required, "max_tokens": st.integers(1, 3)}.items()}
    for k in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[k] = draw(fields[k])
    if draw(st.integers(0, 2)) == 0:
        body[draw(st.sampled_from(sorted({**required, **fields, "max_tokens": None})))] = draw(JUNK)
    return body


@pytest.fixture(scope="module")
def http():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLM(default_model_path(), dtype="float32", max_model_len=64).engine  # bounds every case's work
    app = create_app(engine, "m", tool_call_parser="hermes", enable_auto_tool_choice=True)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
    torch.set_num_threads(threads)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.one_of(st.tuples(st.just("/v1/completions"), bodies({"prompt": PROMPT}, COMPLETION)),
                      st.tuples(st.just("/v1/chat/completions"), bodies({"messages": MESSAGES}, CHAT))))
def test_no_5xx_and_well_formed_answers(http, data):
    path, body = data
    r = http.post(path, json=body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"], (body, r.text)
        return
    if body.get("stream") is True:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (body, r.text)
        assert all("error" not in json.loads(e) for e in events[:-1]), (body, r.text)
    else:
        assert r.json()["choices"], (body, r.text)
