"""vLLM's /tokenize, /detokenize, /version and /ping (hyla.server.tokenize_api), in-process over
the tiny Kimi checkpoint with its word-level tokenizer; the token strings of both tokenizer
formats (convert_ids_to_tokens) against transformers' byte-to-unicode table."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import hyla
from hyla import LLM
from hyla.models.tokenizer import load_tokenizer
from hyla.server.api import create_app
from tests.models.test_tiktoken_tokenizer import write_tiktoken_tokenizer
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint

MSGS = [{"role": "user", "content": "the cat sat"}]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("tokenize"), "moe", with_tokenizer=True)


@pytest.fixture(scope="module")
def engine(path):
    return LLM(str(path), dtype="float32", max_model_len=64).engine


@pytest.fixture(scope="module")
def http(engine):
    with TestClient(create_app(engine, "m")) as client:
        yield client


def test_tokenize_a_text(http, engine):
    r = http.post("/tokenize", json={"model": "m", "prompt": "the cat sat", "return_token_strs": True}).json()
    ids = engine.tokenizer.encode("the cat sat")
    assert r == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": ["<s>", "the", "cat", "sat"]}
    bare = http.post("/tokenize", json={"prompt": "the cat sat", "add_special_tokens": False}).json()
    assert bare["tokens"] == ids[1:] and bare["token_strs"] is None  # no BOS; strings only when asked


def test_tokenize_messages_gives_the_chat_routes_prompt(http, engine):
    r = http.post("/tokenize", json={"messages": MSGS, "return_token_strs": True}).json()
    want = engine.tokenizer.apply_chat_template(MSGS, tokenize=True)
    assert r["tokens"] == want and r["count"] == len(want)
    assert r["token_strs"] == engine.tokenizer.convert_ids_to_tokens(want)
    chat = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r["count"]  # the prompt the chat route runs
    open_turn = http.post("/tokenize", json={"messages": MSGS, "add_generation_prompt": False}).json()
    assert open_turn["tokens"] == engine.tokenizer.apply_chat_template(MSGS, add_generation_prompt=False,
                                                                       tokenize=True)
    extra_bos = http.post("/tokenize", json={"messages": MSGS, "add_special_tokens": True}).json()
    assert extra_bos["tokens"] == [engine.tokenizer.bos_token_id] + want  # the template's BOS, then the encoder's


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": 5}, 400, "prompt"),
    ({"messages": []}, 400, "messages"),
    ({"model": "other", "prompt": "the"}, 404, "model"),
    ({"messages": MSGS, "continue_final_message": True}, 400, "continue_final_message"),
    ({"messages": MSGS, "chat_template": "{{ messages }}"}, 400, "chat_template"),  # not without the flag
    ({"messages": MSGS, "mm_processor_kwargs": {"size": 2}}, 400, "mm_processor_kwargs"),
])
def test_bad_tokenize_requests(http, body, status, param):
    r = http.post("/tokenize", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_detokenize(http, engine):
    ids = engine.tokenizer.encode("the big red house")
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "<s> the big red house"}
    r = http.post("/detokenize", json={"tokens": [7, engine.tokenizer.vocab_size]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert http.post("/detokenize", json={"tokens": ["the"]}).status_code == 400


def test_version_and_ping(http):
    assert http.get("/version").json() == {"version": hyla.__version__}
    assert http.get("/ping").status_code == http.post("/ping").status_code == 200
    assert http.get("/ping").json() == http.get("/health").json()


def test_a_model_without_a_tokenizer_cannot_tokenize(tmp_path_factory):
    bare = build_kimi_checkpoint(tmp_path_factory.mktemp("no_tokenizer"), "moe")
    with TestClient(create_app(LLM(str(bare), dtype="float32", max_model_len=64).engine, "m")) as client:
        for route, body in (("/tokenize", {"prompt": "the"}), ("/detokenize", {"tokens": [1]})):
            r = client.post(route, json=body)
            assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]


def test_token_strings_of_a_tiktoken_vocabulary_are_byte_level(tmp_path):
    """Kimi's tiktoken tokens are written in GPT-2's byte-to-unicode characters (" the" is
    "Ġthe"), special tokens by name, as the released tokenizer's convert_ids_to_tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    write_tiktoken_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    chars = bytes_to_unicode()
    ids = tok.encode("the cat, 你好\n<|im_end|>")
    strs = tok.convert_ids_to_tokens(ids)
    base = len(tok._base_ranks)
    for token_id, s in zip(ids, strs):
        if token_id >= base:
            assert s == "<|im_end|>"
        else:
            assert s == "".join(chars[b] for b in tok.encoding.decode_single_token_bytes(token_id))
    assert any(s.startswith("Ġ") for s in strs)  # a space-led piece
