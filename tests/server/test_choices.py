"""n > 1, best_of and echo on a live server: one engine request per choice, seeds s + i."""

import httpx

from tests.server.live import NAME, PROMPT, metric

MSGS = [{"role": "user", "content": PROMPT}]


def test_n_choices_are_distinct_and_reproducible_by_seed(client):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=1234,
              extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3, texts
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert first.usage.completion_tokens == 24
    # choice i is the single request with seed + i
    for i, text in enumerate(texts):
        one = client.completions.create(**{**kw, "n": 1, "seed": 1234 + i})
        assert one.choices[0].text == text


def test_chat_n_streamed_equals_whole(client):
    kw = dict(model=NAME, messages=MSGS, max_tokens=6, temperature=1.0, n=2, seed=7,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    parts = {0: "", 1: ""}
    finish = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert parts == {c.index: c.message.content for c in whole.choices}
    assert finish == {0: "length", 1: "length"}


def test_n_shares_the_prompt_through_the_prefix_cache(client, server):
    before = metric(server, "hyla_prefix_cache_hit_tokens_total")
    prompt = "the big red house and the small blue tree sat on the mat"
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=1.0, n=4, seed=3)
    assert len(out.choices) == 4
    # the 3 later sequences hit the checkpoint the first one filed at the prompt's end
    assert metric(server, "hyla_prefix_cache_hit_tokens_total") - before >= 3 * (out.usage.prompt_tokens - 2)


def test_best_of_returns_the_most_likely_candidates(server):
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    cands = httpx.post(server + "/v1/completions", json={**body, "n": 4, "logprobs": 0}, timeout=60).json()
    score = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in cands["choices"]}
    best = httpx.post(server + "/v1/completions", json={**body, "n": 2, "best_of": 4}, timeout=60).json()
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert [c["text"] for c in best["choices"]] == sorted(score, key=lambda t: -score[t])[:2]
    assert all(c["logprobs"] is None for c in best["choices"])  # not asked for: not returned
    assert best["usage"]["completion_tokens"] == 20  # every candidate's tokens


def test_echo_puts_the_prompt_in_front(client, server):
    plain = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    # with logprobs the prompt's tokens come first, its first one without a logprob (tests/server/test_lm_eval.py)
    scored = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    assert scored.choices[0].logprobs.token_logprobs[0] is None
    assert len(scored.choices[0].logprobs.tokens) == scored.usage.prompt_tokens + 4
