"""vLLM's extra request fields over HTTP (in-process, the bundled byte-level BPE model): each is
honoured with vLLM's meaning or refused with a 400 naming it, never accepted and dropped.

allowed_token_ids, bad_words, truncate_prompt_tokens, return_tokens_as_token_ids, priority
(with and without --scheduling-policy priority), structural tags (response_format and
structured_outputs), use_beam_search / length_penalty, stream_options.continuous_usage_stats."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from hyla import LLM
from hyla.models import default_model_path
from hyla.server.api import create_app
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint

MAX_MODEL_LEN = 256
PROMPT = "The cat"
CHAT = [{"role": "user", "content": "Say something about files."}]


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the test machine's cores are shared: one thread is several times faster
    yield LLM(default_model_path(), dtype="float32", max_model_len=MAX_MODEL_LEN).engine
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def http(engine):
    with TestClient(create_app(engine, "m")) as c:
        yield c


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(http, path: str, body: dict) -> dict:
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    r = http.post(path, json={**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


def token_ids(choice: dict) -> list[int]:
    """The output's token ids, from logprobs named by return_tokens_as_token_ids."""
    tokens = choice["logprobs"]["tokens"] if "tokens" in choice["logprobs"] else [
        t["token"] for t in choice["logprobs"]["content"]]
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":")[1]) for t in tokens]


def test_return_tokens_as_token_ids_names_every_logprob_token(http, engine):
    plain = complete(http, logprobs=2)["choices"][0]
    named = complete(http, logprobs=2, return_tokens_as_token_ids=True)["choices"][0]
    ids = token_ids(named)
    assert engine.tokenizer.decode(ids) == named["text"] == plain["text"]
    assert [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids] == plain["logprobs"]["tokens"]
    assert all(k.startswith("token_id:") for top in named["logprobs"]["top_logprobs"] for k in top)
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "temperature": 0,
                                                   "logprobs": True, "top_logprobs": 2,
                                                   "return_tokens_as_token_ids": True}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert engine.tokenizer.decode(token_ids(chat)) == chat["message"]["content"]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])


def test_allowed_token_ids_are_the_only_tokens_sampled(http, engine):
    allowed = [t for w in (" the", " a", " file", " is") for t in engine.tokenizer.encode(w, add_special_tokens=False)]
    for temperature in (0, 1.0):
        choice = complete(http, allowed_token_ids=allowed, logprobs=0, return_tokens_as_token_ids=True,
                          temperature=temperature, seed=4, ignore_eos=True)["choices"][0]
        assert set(token_ids(choice)) <= set(allowed) and len(token_ids(choice)) == 12
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "allowed_token_ids": allowed,
                                                   "logprobs": True, "return_tokens_as_token_ids": True,
                                                   "ignore_eos": True}).json()["choices"][0]
    assert set(token_ids(chat)) <= set(allowed)
    assert refused(http, "/v1/completions", {"allowed_token_ids": [1, 4096]})["param"] == "allowed_token_ids"
    assert refused(http, "/v1/chat/completions", {"allowed_token_ids": []})["param"] == "allowed_token_ids"


def test_bad_words_are_never_written(http, engine):
    plain = complete(http, max_tokens=24)["choices"][0]["text"]
    word = next(w for w in plain.split() if w.isalpha() and len(w) > 2)  # a word the model writes unasked
    banned = [engine.tokenizer.encode(v, add_special_tokens=False) for v in (word, " " + word)]
    got = complete(http, max_tokens=24, bad_words=[word], logprobs=0, return_tokens_as_token_ids=True)["choices"][0]
    ids = token_ids(got)
    assert got["text"] != plain
    for seq in banned:
        assert all(ids[i:i + len(seq)] != seq for i in range(len(ids))), (word, got["text"])
    assert refused(http, "/v1/completions", {"bad_words": [""]})["param"] == "bad_words"
    assert refused(http, "/v1/chat/completions", {"bad_words": ["ok", "   "]})["param"] == "bad_words"


def test_truncate_prompt_tokens_keeps_the_last_k(http, engine):
    long = "one two three four five six seven eight nine ten"
    ids = engine.tokenizer.encode(long)
    cut = complete(http, prompt=long, truncate_prompt_tokens=3)
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["text"] == complete(http, prompt=ids[-3:])["choices"][0]["text"]
    assert complete(http, prompt=long, truncate_prompt_tokens=100)["usage"]["prompt_tokens"] == len(ids)
    # -1: as many as max_model_len - max_tokens leaves
    huge = " ".join(["word"] * MAX_MODEL_LEN)
    assert complete(http, prompt=huge, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 12
    echo = complete(http, prompt=long, truncate_prompt_tokens=2, echo=True, max_tokens=1)["choices"][0]["text"]
    assert echo.startswith(engine.tokenizer.decode(ids[-2:])) and not echo.startswith(long)
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "truncate_prompt_tokens": 5})
    assert chat.json()["usage"]["prompt_tokens"] == 5
    err = refused(http, "/v1/completions", {"truncate_prompt_tokens": MAX_MODEL_LEN - 3})
    assert err["param"] == "truncate_prompt_tokens" and "max_model_len - max_tokens" in err["message"]
    assert refused(http, "/v1/completions", {"truncate_prompt_tokens": -2})["param"] == "truncate_prompt_tokens"


def test_priority_needs_the_priority_policy(http, tmp_path):
    complete(http, priority=0)
    err = refused(http, "/v1/completions", {"priority": 3})
    assert err["param"] == "priority" and "priority scheduling policy" in err["message"]
    model = build_kimi_checkpoint(tmp_path, "dense", with_tokenizer=True)
    llm = LLM(str(model), dtype="float32", max_model_len=64, scheduling_policy="priority")
    with TestClient(create_app(llm.engine, "k")) as other:
        r = other.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 3, "priority": -5})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,param", [({"use_beam_search": True}, "use_beam_search"),
                                        ({"length_penalty": 0.5}, "length_penalty")])
def test_beam_search_is_refused(http, body, param):
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert refused(http, path, body)["param"] == param
    complete(http, use_beam_search=False, length_penalty=1.0)


TAG = {"type": "tag", "begin": "<answer>", "end": "</answer>", "content": {"type": "regex", "pattern": "[0-9]{1,3}"}}
SCHEMA = {"enum": ["yes", "no"]}


def _tagged(text: str) -> str:
    assert text.startswith("<answer>") and text.endswith("</answer>"), text
    return text[len("<answer>"):-len("</answer>")]


def test_structural_tags_constrain_the_output(http):
    fmt = {"type": "structural_tag", "format": TAG}
    out = complete(http, max_tokens=20, response_format=fmt)["choices"][0]
    assert _tagged(out["text"]).isdigit() and out["finish_reason"] == "stop"
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 20, "temperature": 0,
                                                   "structured_outputs": {"structural_tag": json.dumps(fmt)}})
    assert _tagged(chat.json()["choices"][0]["message"]["content"]).isdigit()
    # the older form: free text until a trigger, then its structure (the model writes imports here)
    legacy = {"type": "structural_tag", "triggers": ["import "],
              "structures": [{"begin": "import ", "schema": SCHEMA, "end": "\n"}]}
    text = complete(http, prompt="Answer: <answer>yes</answer> and <answer>", max_tokens=20,
                    response_format=legacy)["choices"][0]["text"]
    lines = [line for line in text.split("\n") if line.startswith("import ")]
    assert lines and all(json.loads(line[len("import "):]) in ("yes", "no") for line in lines[:-1]), text
    bad = {"type": "structural_tag", "format": {"type": "nope"}}
    assert refused(http, "/v1/completions", {"response_format": bad})["param"] == "response_format"
    both = {"response_format": fmt, "guided_regex": "a+"}
    assert refused(http, "/v1/completions", both)["param"] == "guided_regex"
    assert refused(http, "/v1/completions", {"response_format": {"type": "structural_tag"}})["param"] == \
        "response_format"
    assert refused(http, "/v1/completions", {"structured_outputs": {"structural_tag": "{no"}})["param"] == \
        "structured_outputs.structural_tag"


def test_continuous_usage_stats_puts_the_usage_in_every_chunk(http):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [e for e in events if e["choices"]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
