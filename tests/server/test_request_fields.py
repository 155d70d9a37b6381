"""Request fields OpenAI or vLLM define, each honoured or refused with a 400 that names it (in-process,
the bundled model): request_id and the X-Request-Id header, return_token_ids, chat's echo, best_of
and parallel_tool_calls, cache_salt, spaces_between_special_tokens, and the fields hyla does not
implement (hyla.server.protocol.NOT_IMPLEMENTED)."""

from __future__ import annotations

import json

import pytest

from hyla.engine.outputs import CompletionOutput
from hyla.server.protocol import NOT_IMPLEMENTED
from hyla.server.tool_choices import SingleToolCall, ToolChatChoice
from hyla.server.tool_parsers import make_parser
from tests.server.test_structured import engine, http  # noqa: F401 (fixtures)

MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
CHAT = {"model": "m", "messages": MSGS, "max_tokens": 6, "temperature": 0}
COMPLETION = {"model": "m", "prompt": "The cat sat on", "max_tokens": 6, "temperature": 0}
ROUTES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}


def post(http, path, status=200, headers=None, **fields):
    r = http.post(path, json={**ROUTES[path], **fields}, headers=headers or {})
    assert r.status_code == status, r.text
    return r.json()


def events(http, path, **fields) -> list[dict]:
    with http.stream("POST", path, json={**ROUTES[path], "stream": True, **fields}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- refused ----------------------------------------------------------------------------------
REFUSED = {"logits_processors": ["my_module.Processor"], "prompt_embeds": "AAAA", "kv_transfer_params": {"a": 1},
           "vllm_xargs": {"k": 1}, "audio": {"voice": "alloy", "format": "wav"}, "web_search_options": {},
           "verbosity": "low", "functions": [{"name": "f"}], "function_call": "auto",
           "guided_whitespace_pattern": " ", "guided_decoding_backend": "outlines", "modalities": ["text", "audio"]}


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("name", list(REFUSED))
def test_fields_hyla_does_not_implement_are_a_400_naming_them(http, path, name):
    assert set(REFUSED) >= set(NOT_IMPLEMENTED)  # every refusal is tried here
    err = post(http, path, 400, **{name: REFUSED[name]})["error"]
    assert err["param"] == name and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("fields", [
    {"logits_processors": []}, {"kv_transfer_params": None}, {"vllm_xargs": {}}, {"modalities": ["text"]},
    {"guided_decoding_backend": "xgrammar"}, {"guided_decoding_backend": "auto"}, {"store": True},
    {"metadata": {"a": "b"}}, {"service_tier": "auto"}, {"prompt_cache_key": "k"}, {"safety_identifier": "u1"},
    {"prediction": {"type": "content", "content": "It is sunny"}},
], ids=lambda f: next(iter(f)))
def test_fields_that_ask_for_nothing_or_only_label_the_request_are_accepted(http, fields):
    plain = post(http, "/v1/chat/completions")["choices"][0]["message"]
    assert post(http, "/v1/chat/completions", **fields)["choices"][0]["message"] == plain


def test_stream_obfuscation_is_refused_as_on_the_responses_route(http):
    err = post(http, "/v1/chat/completions", 400, stream=True, stream_options={"include_obfuscation": True})["error"]
    assert err["param"] == "stream_options.include_obfuscation"
    chunks = events(http, "/v1/chat/completions", stream_options={"include_obfuscation": False, "include_usage": True})
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_a_modalities_list_of_objects_is_a_400_not_a_500(http):
    assert post(http, "/v1/chat/completions", 400, modalities=["text", {"x": 1}])["error"]["param"] == "modalities"


@pytest.mark.parametrize("value", [True, False])
def test_spaces_between_special_tokens_keeps_the_text_of_a_fast_tokenizer(http, value):
    """vLLM's rule: only a slow tokenizer puts spaces between special tokens; hyla's are fast."""
    plain = post(http, "/v1/completions", skip_special_tokens=False)["choices"][0]["text"]
    got = post(http, "/v1/completions", skip_special_tokens=False, spaces_between_special_tokens=value)
    assert got["choices"][0]["text"] == plain


# ---- request ids ------------------------------------------------------------------------------
def test_the_response_id_carries_the_clients_request_id_the_header_first(http):
    assert post(http, "/v1/chat/completions", request_id="job-7")["id"] == "chatcmpl-job-7"
    assert post(http, "/v1/completions", request_id="job-7")["id"] == "cmpl-job-7"
    both = post(http, "/v1/chat/completions", headers={"X-Request-Id": "from-header"}, request_id="from-body")
    assert both["id"] == "chatcmpl-from-header"  # vLLM's rule: the header wins
    assert post(http, "/v1/chat/completions")["id"].startswith("chatcmpl-")  # else a fresh one
    chunks = events(http, "/v1/completions", request_id="streamed")
    assert {c["id"] for c in chunks} == {"cmpl-streamed"}


@pytest.mark.parametrize("bad", ["has space", "x" * 257, "tab\there", "ünïcode"])
def test_a_request_id_outside_printable_ascii_is_a_400(http, bad):
    assert post(http, "/v1/chat/completions", 400, request_id=bad)["error"]["param"] == "request_id"
    if bad.isascii():  # a header holds latin-1 only
        r = http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


def test_requests_sharing_a_request_id_run_side_by_side(http, engine):
    """A client's id need not be unique: each request keeps its own engine id and stream."""
    with http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True, "request_id": "same",
                                                        "max_tokens": 12, "ignore_eos": True}) as first:
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the first request is running
        second = post(http, "/v1/completions", request_id="same", max_tokens=12, ignore_eos=True)
        rest = [line for line in lines if line.startswith("data: ")]
    assert second["id"] == "cmpl-same" and second["choices"][0]["finish_reason"] == "length"
    assert rest[-1] == "data: [DONE]" and not any("error" in line for line in rest)
    assert not engine.has_unfinished_requests()


# ---- return_token_ids -------------------------------------------------------------------------
def test_return_token_ids_whole_chat_and_completion(http, engine):
    tok = engine.tokenizer
    chat = post(http, "/v1/chat/completions", return_token_ids=True)
    prompt_ids = chat["prompt_token_ids"]
    assert len(prompt_ids) == chat["usage"]["prompt_tokens"]
    choice = chat["choices"][0]
    assert len(choice["token_ids"]) == chat["usage"]["completion_tokens"]
    assert tok.decode(choice["token_ids"]) == choice["message"]["content"]
    assert "prompt_token_ids" not in post(http, "/v1/chat/completions")  # only when asked
    # completions: both in the choice; with echo the generated ids alone (vLLM's rule)
    for echo in (False, True):
        c = post(http, "/v1/completions", return_token_ids=True, echo=echo)["choices"][0]
        assert c["prompt_token_ids"] == tok.encode(COMPLETION["prompt"])
        assert len(c["token_ids"]) == 6
        assert c["text"].endswith(tok.decode(c["token_ids"]))


@pytest.mark.parametrize("path", list(ROUTES))
def test_return_token_ids_streamed_add_up_to_the_whole_response(http, path):
    whole = post(http, path, return_token_ids=True, n=2, seed=3, temperature=1.0)
    chunks = events(http, path, return_token_ids=True, n=2, seed=3, temperature=1.0)
    for i, choice in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert sum((c.get("token_ids", []) for c in mine), []) == choice["token_ids"]
        if path == "/v1/completions":  # the prompt's ids in each choice's first chunk only
            assert [c.get("prompt_token_ids") for c in mine][:2] == [choice["prompt_token_ids"], None]
    if path == "/v1/chat/completions":  # in the opening chunks (the role), at the top level
        openings = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
        assert [c["prompt_token_ids"] for c in openings] == [whole["prompt_token_ids"]] * 2


# ---- chat: echo, best_of, parallel_tool_calls --------------------------------------------------
CONTINUED = [*MSGS, {"role": "assistant", "content": "The weather is"}]


def test_chat_echo_puts_the_final_assistant_message_in_front_of_the_reply(http):
    kw = dict(messages=CONTINUED, add_generation_prompt=False, continue_final_message=True)
    plain = post(http, "/v1/chat/completions", **kw)["choices"][0]["message"]["content"]
    echoed = post(http, "/v1/chat/completions", echo=True, **kw)["choices"][0]["message"]["content"]
    assert echoed == "The weather is" + plain
    streamed = "".join(c["choices"][0]["delta"].get("content", "")
                       for c in events(http, "/v1/chat/completions", echo=True, **kw) if c["choices"])
    assert streamed == echoed
    # the final message is the user's: the reply starts a turn of its own, nothing is echoed
    assert post(http, "/v1/chat/completions", echo=True)["choices"][0]["message"] == \
        post(http, "/v1/chat/completions")["choices"][0]["message"]


def test_chat_best_of_returns_the_candidate_with_the_highest_cumulative_logprob(http):
    kw = dict(temperature=1.0, seed=11, max_tokens=5, ignore_eos=True)
    candidates = post(http, "/v1/chat/completions", n=3, logprobs=True, **kw)["choices"]
    total = [sum(t["logprob"] for t in c["logprobs"]["content"]) for c in candidates]
    best = post(http, "/v1/chat/completions", best_of=3, **kw)
    assert len(best["choices"]) == 1 and best["usage"]["completion_tokens"] == 15  # three ran
    assert best["choices"][0]["message"] == candidates[total.index(max(total))]["message"]
    assert best["choices"][0]["logprobs"] is None  # asked for internally only
    assert post(http, "/v1/chat/completions", 400, best_of=3, stream=True)["error"]["param"] == "best_of"
    assert post(http, "/v1/chat/completions", 400, best_of=1, n=2)["error"]["param"] == "best_of"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
TWO_CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')


def test_parallel_tool_calls_false_returns_the_first_call_whole_and_streamed():
    def builder():
        return SingleToolCall(ToolChatChoice(0, None, None, make_parser("hermes"), TOOLS))

    done = CompletionOutput(0, TWO_CALLS, [], finish_reason="stop")
    message = builder().whole(done)["message"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == ["Paris"]
    assert ToolChatChoice(0, None, None, make_parser("hermes"), TOOLS).whole(done)["message"]["tool_calls"][1]
    stream, calls, reasons = builder(), [], []
    for end in range(1, len(TWO_CALLS) + 1):
        finished = end == len(TWO_CALLS)
        chunk = stream.delta(CompletionOutput(0, TWO_CALLS[:end], [], finish_reason="stop" if finished else None))
        if chunk is not None:
            calls += chunk["delta"].get("tool_calls", [])
            reasons.append(chunk["finish_reason"])
    assert [c["index"] for c in calls] == [0] and json.loads(calls[0]["function"]["arguments"])["city"] == "Paris"
    assert reasons[-1] == "tool_calls"


# ---- cache_salt -------------------------------------------------------------------------------
def test_cache_salt_reaches_the_engine_and_an_empty_one_is_a_400(http, engine):
    got = []
    real = engine.add_request

    def spy(request_id, prompt, params=None, **kw):
        got.append(params.cache_salt)
        return real(request_id, prompt, params, **kw)

    engine.add_request = spy
    try:
        post(http, "/v1/chat/completions", cache_salt="tenant-a")
        post(http, "/v1/completions")
    finally:
        del engine.add_request
    assert got == ["tenant-a", None]
    assert post(http, "/v1/completions", 400, cache_salt="")["error"]["param"] == "cache_salt"
