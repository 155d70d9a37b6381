"""What lm-evaluation-harness sends to /v1/completions, answered as vLLM answers it.

Its loglikelihood (multiple-choice) requests are `{"prompt": [[ids], ...], "temperature": 0,
"max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}` (token-id lists by default, texts
with tokenized_requests=False, several prompts with --batch_size), read back by its
`parse_logprobs`: token_logprobs[ctxlen:-1] summed, greedy when each is its top_logprobs' max.
The prompt logprobs are checked against a full forward's log_softmax; batched prompts for their
prompt-major choice order with n > 1 and best_of; cached_tokens with the prefix cache on; the
prompt_logprobs field in vLLM's shape (completions: per choice; chat: the response's). One
in-process app (TestClient) over a tiny fp64 Kimi checkpoint with a word-level tokenizer."""

from __future__ import annotations

import json
from operator import itemgetter

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from hyla import LLM
from hyla.server.api import create_app
from hyla.server.protocol import MAX_PROMPTS
from tests.oracles.kimi_checkpoint import WORDS, build_kimi_checkpoint

TOL = 1e-5  # fp32 logits' log-softmax against fp64 (tests/engine/test_prompt_logprobs.py)
WORD_IDS = range(7, 7 + len(WORDS))  # ids of the tokenizer's words (their texts are distinct)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_kimi_checkpoint(tmp_path_factory.mktemp("lm_eval"), "moe", with_tokenizer=True)
    return LLM(str(path), dtype=torch.float64, max_model_len=128, enable_prefix_caching=True).engine


@pytest.fixture(scope="module")
def http(engine):
    with TestClient(create_app(engine, "m")) as client:
        yield client


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [WORD_IDS[i] for i in torch.randint(0, len(WORD_IDS), (n,), generator=g).tolist()]


def _forward(engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of one full forward over ids: row i scores the token after position i."""
    with torch.no_grad():
        return torch.log_softmax(engine.model(torch.tensor([ids]))[0].double(), dim=-1)


def _parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs, as it reads a response."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
        res.append((sum(tokens_logprobs), is_greedy))
    return res


def _loglikelihood_body(prompt, max_tokens: int = 1) -> dict:
    return {"model": "m", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}


def _check_prompt_rows(engine, lp: dict, ids: list[int]) -> None:
    """The echoed prompt rows of a choice's logprobs against a full forward."""
    ref = _forward(engine, ids)
    decode = [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["tokens"][: len(ids)] == decode
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) <= TOL
        top = lp["top_logprobs"][i]
        assert len(top) <= 2 and abs(top[decode[i]] - ref[i - 1, ids[i]].item()) <= TOL
        assert abs(max(top.values()) - ref[i - 1].max().item()) <= TOL  # logprobs=1: the token and the top 1
    offsets = [sum(map(len, decode[:i])) for i in range(len(ids))]
    assert lp["text_offset"][: len(ids)] == offsets


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_loglikelihood_of_token_id_prompts_in_a_batch(http, engine, max_tokens):
    contexts = [_ids(1, 9), _ids(2, 5), _ids(3, 12), _ids(4, 6)]
    continuations = [_ids(5, 3), _ids(6, 1), _ids(7, 2), _ids(8, 4)]
    prompts = [c + k for c, k in zip(contexts, continuations)]
    r = http.post("/v1/completions", json=_loglikelihood_body(prompts, max_tokens))
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for choice, ids in zip(out["choices"], prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens  # the prompt, then the generated token (if any)
        _check_prompt_rows(engine, lp, ids)
        assert choice["finish_reason"] == "length"
        assert choice["text"].startswith(engine.tokenizer.decode(ids, skip_special_tokens=False))
        # vLLM also puts the engine's prompt logprobs on the choice
        assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)
    usage = out["usage"]
    assert usage["prompt_tokens"] == sum(map(len, prompts)) and usage["completion_tokens"] == 4 * max_tokens
    if max_tokens == 0:  # the prompt alone: lm-eval's [ctxlen:-1] would drop its last token, so it sends 1
        return
    for (total, greedy), ctx, ids in zip(_parse_logprobs(out, [len(c) for c in contexts]), contexts, prompts):
        ref = _forward(engine, ids)
        rows = range(len(ctx), len(ids))
        assert abs(total - sum(ref[i - 1, ids[i]].item() for i in rows)) <= len(ids) * TOL
        assert greedy == all(ref[i - 1].argmax().item() == ids[i] for i in rows)


def test_loglikelihood_of_text_prompts(http, engine):
    """tokenized_requests=False: the prompts are texts; the echo is the text, the tokens the
    tokenizer's (its BOS included, as vLLM's)."""
    texts = ["the cat sat on the mat", "a big red house"]
    out = http.post("/v1/completions", json=_loglikelihood_body(texts)).json()
    for choice, text in zip(out["choices"], texts):
        ids = engine.tokenizer.encode(text)
        assert choice["text"].startswith(text)
        _check_prompt_rows(engine, choice["logprobs"], ids)


def test_the_openai_client_reads_echoed_logprobs(http, engine):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    ids = _ids(9, 10)
    out = client.completions.create(model="m", prompt=[ids], echo=True, logprobs=1, max_tokens=0, temperature=0)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids)
    ref = _forward(engine, ids)
    assert all(abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) <= TOL for i in range(1, len(ids)))
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 0


def test_streamed_echo_with_logprobs_adds_up_to_the_whole(http):
    body = {"model": "m", "prompt": "the dog ran to the tree", "echo": True, "logprobs": 2, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    events = [json.loads(line[6:]) for line in http.post("/v1/completions", json={**body, "stream": True}).text
              .splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    parts = [e["choices"][0] for e in events]
    assert "".join(p["text"] for p in parts) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p["logprobs"][key]] == whole["logprobs"][key]


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(http):
    r = http.post("/v1/completions", json={"model": "m", "prompt": "the sun", "echo": True, "max_tokens": 0}).json()
    assert r["choices"][0]["text"] == "the sun" and r["choices"][0]["logprobs"] is None
    assert r["usage"]["completion_tokens"] == 0
    bad = http.post("/v1/completions", json={"model": "m", "prompt": "the sun", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # no echo: vLLM refuses it too


def _sampled(choice: dict) -> list[float]:
    """What identifies a choice's tokens (the tiny model's texts are mostly empty): their logprobs."""
    return choice["logprobs"]["token_logprobs"]


def test_batched_prompts_are_answered_prompt_major_with_n(http):
    prompts = [_ids(10, 4), _ids(11, 7), _ids(12, 5)]
    body = {"model": "m", "prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 5,
            "ignore_eos": True, "logprobs": 0}
    out = http.post("/v1/completions", json=body).json()
    got = {c["index"]: _sampled(c) for c in out["choices"]}
    assert sorted(got) == list(range(6))
    for p, ids in enumerate(prompts):  # choice p * n + i: prompt p alone, sampled with seed + i
        for i in range(2):
            one = http.post("/v1/completions", json={**body, "prompt": ids, "n": 1, "seed": 5 + i}).json()
            assert got[p * 2 + i] == _sampled(one["choices"][0])
    assert out["usage"]["prompt_tokens"] == 16 and out["usage"]["completion_tokens"] == 18
    events = [json.loads(line[6:]) for line in http.post("/v1/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}).text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"]
    streamed: dict[int, list[float]] = {}
    for e in events:
        for c in e["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], []) + _sampled(c)
    assert streamed == got
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (16, 18)


def test_best_of_ranks_each_prompts_candidates(http):
    prompts = [_ids(13, 5), _ids(14, 6)]
    body = {"model": "m", "prompt": prompts, "max_tokens": 3, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    cands = http.post("/v1/completions", json={**body, "n": 3, "logprobs": 0}).json()["choices"]
    best = http.post("/v1/completions", json={**body, "n": 1, "best_of": 3, "logprobs": 0}).json()
    assert [c["index"] for c in best["choices"]] == [0, 1]
    for p in range(2):
        mine = [c for c in cands if c["index"] // 3 == p]
        assert _sampled(best["choices"][p]) == max(map(_sampled, mine), key=sum)
    assert best["usage"]["completion_tokens"] == 2 * 3 * 3  # every candidate's tokens


@pytest.mark.parametrize("prompt,needle", [
    ([[7, 8], []], "prompt[1]: the prompt is empty"),
    ([[7, 8], [7, 100000]], "prompt[1]: token id 100000"),
    ([[7]] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS} prompts"),
])
def test_a_bad_prompt_of_a_batch_is_named(http, prompt, needle):
    r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert needle in r.json()["error"]["message"]


def test_mixed_prompt_kinds_are_refused(http):
    r = http.post("/v1/completions", json={"model": "m", "prompt": ["the cat", [7, 8]], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt")


def _check_vllm_prompt_logprobs(engine, got: list, ids: list[int], n: int) -> None:
    """vLLM's shape: None, then {str(id): {logprob, rank, decoded_token}}, the prompt token
    first with its rank in the vocabulary, then the top n ranked 1..n."""
    ref = _forward(engine, ids)
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        row = ref[i - 1]
        top = torch.topk(row, n).indices.tolist()
        want = [ids[i], *[t for t in top if t != ids[i]]]
        assert list(got[i]) == [str(t) for t in want]
        for t in want:
            entry = got[i][str(t)]
            rank = top.index(t) + 1 if t in top else int((row >= row[t]).sum())
            assert entry["rank"] == rank and abs(entry["logprob"] - row[t].item()) <= TOL
            assert entry["decoded_token"] == engine.tokenizer.decode([t], skip_special_tokens=False)


def test_prompt_logprobs_in_vllms_shape(http, engine):
    ids = _ids(15, 11)
    out = http.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 2, "prompt_logprobs": 3,
                                             "n": 2, "temperature": 0}).json()
    for choice in out["choices"]:  # every choice of the prompt (only the first sequence computed them)
        _check_vllm_prompt_logprobs(engine, choice["prompt_logprobs"], ids, 3)
        assert choice["logprobs"] is None  # not asked for
    msgs = [{"role": "user", "content": "the small blue moon"}]
    chat = http.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 1,
                                                   "prompt_logprobs": 0}).json()
    prompt = engine.tokenizer.apply_chat_template(msgs, tokenize=True)
    _check_vllm_prompt_logprobs(engine, chat["prompt_logprobs"], prompt, 0)  # the response's, as vLLM's chat


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "the cat", "prompt_logprobs": 1, "stream": True}),
    ("/v1/completions", {"prompt": "the cat", "prompt_logprobs": -1}),
    ("/v1/completions", {"prompt": "the cat", "prompt_logprobs": 21}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 2, "stream": True}),
])
def test_prompt_logprobs_hyla_cannot_give_are_refused(http, path, body):
    r = http.post(path, json={"model": "m", "max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_cached_tokens_reports_the_prefix_cache_hit(http, engine):
    prompt = _ids(16, 40)
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = http.post("/v1/completions", json=body).json()["usage"]
    hits = engine.get_metrics()["prefix_cache_hit_tokens"]
    again = http.post("/v1/completions", json=body).json()["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < cached == engine.get_metrics()["prefix_cache_hit_tokens"] - hits < len(prompt)
    events = [json.loads(line[6:]) for line in http.post("/v1/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}).text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    msgs = [{"role": "user", "content": "the red house and the big tree sat on the mat and the dog ran to the sun"}]
    chat = {"model": "m", "messages": msgs, "max_tokens": 1}
    assert http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
