"""/v1/responses through the real `openai` client against the in-process app: input items and
instructions as the chat template receives them, output items whole and streamed (the client's
stream state checks the event order), function calls and their outputs round trip, stored
responses and previous_response_id, reasoning items, structured text.format, tool_choice, and
400s that name the field. The model's text is scripted (tests.server.recording)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from hyla import LLM
from hyla.server.responses_api import ResponseStore
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.server.recording import PromptLog, RecordingEngine, recording_app

TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather", "strict": False,
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOL_FLAGS = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_kimi_checkpoint(tmp_path_factory.mktemp("responses"), "dense", with_tokenizer=True)
    return LLM(str(path), dtype="float32", max_model_len=256).engine


@dataclass
class Served:
    client: openai.OpenAI
    http: TestClient
    recorder: RecordingEngine
    prompts: PromptLog

    @property
    def params(self):
        return self.recorder.submitted[-1][1]


@pytest.fixture
def serve(engine, monkeypatch):
    """serve(**create_app flags) -> a context giving a Served app with the recording template."""

    @contextlib.contextmanager
    def start(**flags):
        with recording_app(engine, monkeypatch, **flags) as (http, recorder, prompts):
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
            yield Served(client, http, recorder, prompts)

    return start


def _streamed(s: Served, **body):
    """Through the client's stream helper (which checks the event order) -> (events, final response)."""
    with s.client.responses.stream(model="m", **body) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def test_text_whole_and_streamed(serve):
    with serve() as s:
        s.recorder.pieces = ["the cat", " sat"]
        r = s.client.responses.create(model="m", input="the sun", instructions="be brief", temperature=0.5,
                                      top_p=0.9, max_output_tokens=7, metadata={"k": "v"}, user="u1")
        assert s.prompts.last == "<|system|>be brief\n<|user|>the sun\n<|assistant|>"
        assert (s.params.temperature, s.params.top_p, s.params.max_tokens) == (0.5, 0.9, 7)
        assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
        assert r.output_text == "the cat sat" and r.incomplete_details is None and r.error is None
        [message] = r.output
        assert (message.type, message.role, message.status, message.id[:4]) == ("message", "assistant", "completed",
                                                                                 "msg_")
        assert (r.temperature, r.top_p, r.max_output_tokens, r.instructions, r.metadata, r.user) == (
            0.5, 0.9, 7, "be brief", {"k": "v"}, "u1")
        prompt_tokens = len(s.recorder.submitted[-1][0])
        assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (prompt_tokens, 2,
                                                                                       prompt_tokens + 2)
        assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.usage.input_tokens_details.cached_tokens == 0
        s.recorder.cached = 3
        assert s.client.responses.create(model="m", input="the sun").usage.input_tokens_details.cached_tokens == 3
        s.recorder.cached = 0
        s.client.responses.create(model="m", input="the sun", extra_body={"top_k": 3, "seed": 11, "stop": ["mat"]})
        assert (s.params.top_k, s.params.seed, s.params.stop_strings) == (3, 11, ["mat"])  # vLLM's extras
        events, final = _streamed(s, input=[{"role": "user", "content": [{"type": "input_text", "text": "the"},
                                                                         {"type": "input_text", "text": " sun"}]}])
        assert s.prompts.last == "<|user|>the sun\n<|assistant|>"  # text parts joined
        assert [e.type for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
            "response.content_part.done", "response.output_item.done", "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["the cat", " sat"]
        assert final.output_text == "the cat sat" and final.status == "completed" and final.usage.output_tokens == 2
        assert events[0].response.status == "in_progress" and events[0].response.id == final.id
        # on the wire: an `event:` line names each data line's type
        with s.http.stream("POST", "/v1/responses", json={"input": "the sun", "stream": True}) as raw:
            lines = [line for line in raw.iter_lines() if line]
        assert all(e.startswith("event: ") and d == "data: " + d[6:] and json.loads(d[6:])["type"] == e[7:]
                   for e, d in zip(lines[::2], lines[1::2], strict=True))


def test_function_call_round_trip(serve):
    with serve(**TOOL_FLAGS) as s:
        s.recorder.pieces = ["Sure. ", CALL]
        first = s.client.responses.create(model="m", input="the sun", tools=TOOLS, instructions="be brief")
        assert s.prompts.last.startswith("[tools: get_weather]<|system|>be brief\n")
        message, call = first.output
        assert message.content[0].text == "Sure. "
        assert (call.type, call.name, json.loads(call.arguments), call.status) == (
            "function_call", "get_weather", {"city": "Paris"}, "completed")
        assert call.id.startswith("fc_") and call.call_id and first.tools[0].name == "get_weather"
        # the result, after the stored conversation (its instructions are not carried over)
        s.recorder.pieces = ["the sun is big"]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "red"}
        second = s.client.responses.create(model="m", previous_response_id=first.id, input=[result], tools=TOOLS)
        expected = ('[tools: get_weather]<|user|>the sun\n<|assistant|>Sure. '
                    f'[call {call.call_id} get_weather {{"city": "Paris"}}]\n<|tool|>red[result of {call.call_id}]\n'
                    "<|assistant|>")
        assert s.prompts.last == expected
        assert second.previous_response_id == first.id and second.output_text == "the sun is big"
        # the same conversation sent as items: the same prompt
        items = [{"role": "user", "content": "the sun"}, *[o.model_dump(exclude_none=True) for o in first.output],
                 result]
        s.client.responses.create(model="m", input=items, tools=TOOLS)
        assert s.prompts.last == expected
        # streamed
        s.recorder.pieces = ["Sure. ", CALL]
        events, final = _streamed(s, input="the sun", tools=TOOLS)
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert added == ["message", "function_call"]
        arguments = [e for e in events if e.type.startswith("response.function_call_arguments")]
        assert [e.type for e in arguments] == ["response.function_call_arguments.delta",
                                               "response.function_call_arguments.done"]
        assert json.loads(arguments[-1].arguments) == {"city": "Paris"}
        assert [(o.type, o.status) for o in final.output] == [("message", "completed"), ("function_call", "completed")]


def test_parallel_tool_calls_false_keeps_the_first_call(serve):
    with serve(**TOOL_FLAGS) as s:
        s.recorder.pieces = [CALL, CALL.replace("Paris", "Oslo")]
        both = s.client.responses.create(model="m", input="the sun", tools=TOOLS)
        one = s.client.responses.create(model="m", input="the sun", tools=TOOLS, parallel_tool_calls=False)
        _, streamed = _streamed(s, input="the sun", tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(o.arguments)["city"] for o in both.output] == ["Paris", "Oslo"]
    assert [json.loads(o.arguments)["city"] for o in one.output] == ["Paris"] and one.parallel_tool_calls is False
    assert [json.loads(o.arguments)["city"] for o in streamed.output] == ["Paris"]


def test_reasoning_items(serve):
    with serve(reasoning_parser="qwen3") as s:
        s.recorder.pieces = ["I think", " hard</think>", "the cat"]
        r = s.client.responses.create(model="m", input="the sun", reasoning={"effort": "low"})
        assert "[thinking True][effort low]" in s.prompts.last and r.reasoning.effort == "low"
        reasoning, message = r.output
        assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
        assert [c.text for c in reasoning.content] == ["I think hard"] and message.content[0].text == "the cat"
        assert r.output_text == "the cat" and r.usage.output_tokens_details.reasoning_tokens > 0
        # handed back, the reasoning is that turn's reasoning_content
        s.client.responses.create(model="m", input=[{"role": "user", "content": "the sun"},
                                                    *[o.model_dump(exclude_none=True) for o in r.output],
                                                    {"role": "user", "content": "a dog"}])
        assert "<|assistant|>[reasoning I think hard]the cat\n<|user|>a dog" in s.prompts.last
        events, final = _streamed(s, input="the sun")
        assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["reasoning", "message"]
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "I think hard"
        [done] = [e for e in events if e.type == "response.reasoning_text.done"]
        assert done.text == "I think hard" and final.output[0].content[0].text == "I think hard"
        # a request that does not think has no reasoning item and no reasoning tokens
        r = s.client.responses.create(model="m", input="the sun", reasoning={"effort": "none"})
        assert "[thinking False]" in s.prompts.last
        assert [o.type for o in r.output] == ["message"] and r.usage.output_tokens_details.reasoning_tokens == 0


def test_max_output_tokens_makes_it_incomplete(serve):
    with serve() as s:
        s.recorder.pieces, s.recorder.finish = ["the cat", " sat"], "length"
        r = s.client.responses.create(model="m", input="the sun", max_output_tokens=2)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[-1].status == "incomplete" and r.output_text == "the cat sat"
        events = list(s.client.responses.create(model="m", input="the sun", max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]


class Thing(BaseModel):
    a: int


def test_text_format_follows_the_grammar(serve):
    pytest.importorskip("xgrammar")
    with serve() as s:
        s.recorder.pieces = ['{"a": 1}']
        parsed = s.client.responses.parse(model="m", input="the sun", text_format=Thing)
        assert s.params.guide is not None and parsed.output_parsed == Thing(a=1)
        assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Thing"
        r = s.client.responses.create(model="m", input="the sun", text={"format": {"type": "json_object"}})
        assert s.params.guide is not None and json.loads(r.output_text) == {"a": 1}
        bad = {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}
        with pytest.raises(openai.BadRequestError) as e:
            s.client.responses.create(model="m", input="the sun", text={"format": bad})
    assert e.value.body["param"] == "text.format"


def test_forced_tool_choices(serve):
    pytest.importorskip("xgrammar")
    with serve(**TOOL_FLAGS) as s:
        s.recorder.pieces = ['{"city": "Oslo"}']
        named = s.client.responses.create(model="m", input="the sun", tools=TOOLS,
                                          tool_choice={"type": "function", "name": "get_weather"})
        assert s.params.guide is not None
        assert [(o.name, json.loads(o.arguments)) for o in named.output] == [("get_weather", {"city": "Oslo"})]
        assert named.tool_choice.name == "get_weather"
        s.recorder.pieces = [('[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
                              '{"name": "get_weather", "parameters": {"city": "Rome"}}]')]
        required = s.client.responses.create(model="m", input="the sun", tools=TOOLS, tool_choice="required")
        assert [json.loads(o.arguments)["city"] for o in required.output] == ["Oslo", "Rome"]
        _, streamed = _streamed(s, input="the sun", tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        assert [json.loads(o.arguments)["city"] for o in streamed.output] == ["Oslo"]
        s.recorder.pieces = ["the cat"]
        none = s.client.responses.create(model="m", input="the sun", tools=TOOLS, tool_choice="none")
        assert none.output_text == "the cat" and s.params.guide is None


def test_stored_responses(serve):
    with serve() as s:
        r = s.client.responses.create(model="m", input="the sun")
        got = s.client.responses.retrieve(r.id)
        assert got.id == r.id and got.output_text == r.output_text == "the cat"
        unstored = s.client.responses.create(model="m", input="the sun", store=False)
        with pytest.raises(openai.NotFoundError):
            s.client.responses.retrieve(unstored.id)
        with pytest.raises(openai.BadRequestError) as e:
            s.client.responses.create(model="m", input="a dog", previous_response_id=unstored.id)
        assert (e.value.body["param"], e.value.body["code"]) == ("previous_response_id", "previous_response_not_found")
        _, streamed = _streamed(s, input="the sun")
        assert s.client.responses.retrieve(streamed.id).output_text == "the cat"
        # bounded: beyond the capacity the least recently used goes
        s.http.app.state.responses = ResponseStore(capacity=2)
        a, b = (s.client.responses.create(model="m", input="the sun") for _ in range(2))
        s.client.responses.retrieve(a.id)  # used: b is now the least recent
        s.client.responses.create(model="m", input="the sun")
        s.client.responses.retrieve(a.id)
        with pytest.raises(openai.NotFoundError):
            s.client.responses.retrieve(b.id)


def test_a_chain_of_responses(serve):
    with serve() as s:
        s.http.app.state.responses = ResponseStore(capacity=1)
        first = s.client.responses.create(model="m", input="the sun")
        s.recorder.pieces = ["a dog"]
        second = s.client.responses.create(model="m", input="the moon", previous_response_id=first.id)
        s.client.responses.create(model="m", input="the tree", previous_response_id=second.id)
        assert s.prompts.last == ("<|user|>the sun\n<|assistant|>the cat\n<|user|>the moon\n<|assistant|>a dog\n"
                                  "<|user|>the tree\n<|assistant|>")
        with pytest.raises(openai.NotFoundError):  # dropped from the store; its items live on in the chain
            s.client.responses.retrieve(first.id)


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"metadata": {"k": "v" * 600}}, "metadata"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 1000}, "input"),  # the prompt and max_output_tokens pass max_model_len
    ({"temperature": -1.0}, "temperature"),
    ({"input": 3}, "input.str"),  # (pydantic names the union's first member)
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"n": 2}, "n"),  # chat fields are refused, not ignored
    ({"max_tokens": 5}, "max_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_requests_name_the_field(serve, body, param):
    with serve(**TOOL_FLAGS) as s:
        r = s.http.post("/v1/responses", json={"model": "m", "input": "the sun", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_model_auth_and_server_flags(engine, serve):
    with serve(api_key="k") as s:
        r = s.http.post("/v1/responses", json={"model": "other", "input": "the sun"}, headers={"x-api-key": "k"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        with pytest.raises(openai.AuthenticationError):
            s.client.responses.create(model="m", input="the sun")  # its key is "x"
        keyed = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=s.http, max_retries=0)
        assert keyed.responses.create(model="m", input="the sun").output_text == "the cat"
        # "auto" tool choice needs the server's tool-call parser, as on /v1/chat/completions
        with pytest.raises(openai.BadRequestError) as e:
            keyed.responses.create(model="m", input="the sun", tools=TOOLS)
        assert e.value.body["param"] == "tool_choice"


def test_engine_failure(serve):
    with serve() as s:
        s.recorder.pieces, s.recorder.error = ["the cat", " sat"], "device fell over"
        with pytest.raises(openai.InternalServerError) as e:
            s.client.responses.create(model="m", input="the sun")
        assert "device fell over" in e.value.body["message"]
        events = list(s.client.responses.create(model="m", input="the sun", stream=True))
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        assert "device fell over" in events[-2].message and events[-1].response.status == "failed"
        assert events[-1].response.error.code == "server_error"
        s.recorder.error = None
        assert s.client.responses.create(model="m", input="the sun").output_text == "the cat sat"
