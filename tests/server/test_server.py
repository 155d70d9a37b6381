"""A live `hyla serve` subprocess driven by the official openai client and raw HTTP."""

import concurrent.futures
import json
import subprocess
import time

import httpx
import openai
import pytest

from tests.server.live import MAX_MODEL_LEN, NAME, PROMPT
from tests.server.live import metric as _metric
from tests.server.live import start as _start


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_completion_greedy_usage_and_stream_concat(client):
    full = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 20 and full.usage.prompt_tokens > 5
    assert full.usage.total_tokens == full.usage.prompt_tokens + 20
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completion_and_stream(client):
    messages = [{"role": "system", "content": "the sun"}, {"role": "user", "content": "a red house"}]
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 16
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
    assert "".join(parts) == text and usage.completion_tokens == 16


def test_stop_sequences_and_max_tokens(client):
    full = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = full.split()
    assert len(words) >= 3
    stop = " " + words[2]
    cut = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0.0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[: full.find(stop)] and cut.finish_reason == "stop"
    short = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0.0)
    assert short.usage.completion_tokens <= 3


def test_metrics_exposed(client, server):
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0.0)
    text = httpx.get(server + "/metrics").text
    for name in ("hyla_num_requests_running", "hyla_num_requests_waiting", "hyla_prompt_tokens_total",
                 "hyla_generation_tokens_total", "hyla_time_to_first_token_seconds_bucket",
                 "hyla_inter_token_latency_seconds_bucket", "hyla_prefix_cache_query_tokens_total",
                 "hyla_prefix_cache_hit_tokens_total", "hyla_spec_num_draft_tokens_total",
                 "hyla_spec_num_accepted_tokens_total", "hyla_kv_pages_used", "hyla_state_slots_used",
                 "hyla_state_slots_running", "hyla_cached_checkpoints"):
        assert name in text, name
    assert _metric(server, "hyla_generation_tokens_total") >= 4


BAD = [
    ("malformed json", "/v1/completions", b"{not json", 400),
    ("body not an object", "/v1/completions", b"[1, 2]", 400),
    ("wrong type", "/v1/completions", {"prompt": "a", "max_tokens": "many"}, 400),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404),
    ("max_tokens < 1", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400),
    ("max_tokens too big", "/v1/completions", {"prompt": "a", "max_tokens": MAX_MODEL_LEN + 1}, 400),
    ("prompt too long", "/v1/completions", {"prompt": " the" * (MAX_MODEL_LEN + 10), "max_tokens": 1}, 400),
    ("bad token id", "/v1/completions", {"prompt": [5, 99999], "max_tokens": 2}, 400),
    ("n too large", "/v1/completions", {"prompt": "a", "n": 17}, 400),
    ("best_of < n", "/v1/completions", {"prompt": "a", "n": 3, "best_of": 2}, 400),
    ("best_of streamed", "/v1/completions", {"prompt": "a", "n": 1, "best_of": 2, "stream": True}, 400),
    ("prompt_logprobs streamed", "/v1/completions", {"prompt": "a", "prompt_logprobs": 1, "stream": True}, 400),
    ("negative temperature", "/v1/completions", {"prompt": "a", "temperature": -0.5}, 400),
    ("top_p > 1", "/v1/completions", {"prompt": "a", "top_p": 1.5}, 400),
    ("logprobs too many", "/v1/completions", {"prompt": "a", "logprobs": 50}, 400),
    ("too many stops", "/v1/completions", {"prompt": "a", "stop": [str(i) for i in range(20)]}, 400),
    ("body too large", "/v1/completions", {"prompt": "a" * 30000}, 413),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"x": 1}]}, 400),
    ("unknown route", "/v1/nothing", {}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_4xx_with_error_json(server, name, path, body, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]


def test_concurrent_streaming_clients(client, server):
    prompts = [f"the {w} sat on the mat" for w in ("cat", "dog", "sun", "moon")] * 8
    want = {p: client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0.0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in set(prompts)}

    def stream(p):
        chunks = client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(stream, prompts))
    assert got == [want[p] for p in prompts]


def test_dropped_client_frees_resources(client, server):
    with httpx.stream("POST", server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 200, "stream": True,
                                                                  "ignore_eos": True, "temperature": 0.0}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert _metric(server, "hyla_num_requests_running") >= 1
    deadline = time.time() + 20
    while time.time() < deadline:
        if _metric(server, "hyla_num_requests_running") == 0 and _metric(server, "hyla_state_slots_running") == 0:
            break
        time.sleep(0.1)
    # Everything the request held is back; what remains in use belongs to the prefix cache.
    assert _metric(server, "hyla_state_slots_running") == 0 and _metric(server, "hyla_kv_pages_running") == 0
    assert _metric(server, "hyla_state_slots_used") == _metric(server, "hyla_cached_checkpoints")
    assert _metric(server, "hyla_num_requests_aborted_total") >= 1
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2).usage.completion_tokens <= 2


def test_api_key_enforced(model_dir):
    proc, base = _start(model_dir, "--api-key", "sekret")
    try:
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(base + "/v1/completions", json={"prompt": "a"}).status_code == 401
        ok = openai.OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0)
        assert ok.models.list().data[0].id == NAME
        assert httpx.get(base + "/health").status_code == 200  # health stays open for probes
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- bad input: a clear 4xx naming the problem, and the connection stays usable ----------------

def _post(http: httpx.Client, base: str, body: str, ctype: str = "application/json"):
    return http.post(base + "/v1/completions", content=body.encode("utf-8", "surrogatepass"),
                     headers={"content-type": ctype}, timeout=60)


def test_non_json_content_type_is_415(server):
    with httpx.Client() as http:
        r = _post(http, server, json.dumps({"model": NAME, "prompt": "x", "max_tokens": 1}),
                  ctype="application/x-www-form-urlencoded")
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


def test_lone_surrogate_and_deep_nesting_are_400_and_the_connection_lives(server):
    with httpx.Client() as http:
        r = _post(http, server, '{"model": "%s", "prompt": "\\ud800abc", "max_tokens": 1}' % NAME)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
        r = _post(http, server, "[" * 5000 + "]" * 5000)  # past Python's JSON recursion limit
        assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"]
        nested: list = []
        for _ in range(40):  # within the recursion limit, past the server's nesting bound
            nested = [nested]
        r = _post(http, server, json.dumps({"model": NAME, "prompt": "x", "max_tokens": 1, "x": nested}))
        assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"]
        r = _post(http, server, json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 2}))
        assert r.status_code == 200  # the same keep-alive connection still serves


@pytest.mark.parametrize("field,value", [("temperature", "NaN"), ("top_p", "Infinity"),
                                         ("presence_penalty", "-Infinity"), ("seed", str(2 ** 64)),
                                         ("max_tokens", "true"), ("stream", '"yes"')])
def test_non_finite_out_of_range_and_loose_values_name_the_field(server, field, value):
    with httpx.Client() as http:
        r = _post(http, server, '{"model": "%s", "prompt": "x", "max_tokens": 2, "%s": %s}' % (NAME, field, value)
                  if field != "max_tokens" else '{"model": "%s", "prompt": "x", "max_tokens": %s}' % (NAME, value))
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_tiny_temperature_decodes_greedily(client):
    tiny = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=1e-300)
    zero = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    assert tiny.choices[0].text == zero.choices[0].text


# ---- parameters follow the OpenAI rules, never silently ignored -------------------------------

def test_chat_logprobs_alone_has_no_alternatives_and_top_logprobs_gives_exactly_n(client):
    msgs = [{"role": "user", "content": PROMPT}]
    alone = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] for t in alone.choices[0].logprobs.content)
    two = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                         top_logprobs=2)
    assert all(len(t.top_logprobs) == 2 for t in two.choices[0].logprobs.content)


def test_completion_text_offsets_follow_the_tokens(client):
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1)
    lp = out.choices[0].logprobs
    assert len(lp.text_offset) == len(lp.tokens) and lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_parameters_that_need_another_are_rejected(server, path, body, param):
    r = httpx.post(server + path, json={"model": NAME, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_model_card_route(server):
    assert httpx.get(f"{server}/v1/models/{NAME}").json()["id"] == NAME
    r = httpx.get(f"{server}/v1/models/not-this-one")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_abandoned_non_streamed_request_is_aborted(server):
    before = _metric(server, "hyla_num_requests_aborted_total")
    body = {"model": NAME, "prompt": "import a", "max_tokens": 240, "temperature": 1.0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/completions", json=body, timeout=0.3)  # the client gives up
    deadline = time.time() + 10
    while time.time() < deadline and _metric(server, "hyla_num_requests_aborted_total") == before:
        time.sleep(0.05)
    assert _metric(server, "hyla_num_requests_aborted_total") == before + 1
    deadline = time.time() + 5
    while time.time() < deadline and _metric(server, "hyla_num_requests_running") > 0:
        time.sleep(0.05)
    assert _metric(server, "hyla_num_requests_running") == 0


def test_sigterm_with_requests_in_flight_exits_within_the_drain_time(model_dir):
    import signal
    import threading

    # requests far longer than the drain time (~20 s of generation each at this size)
    proc, base = _start(model_dir, "--shutdown-drain-s", "1", "--max-model-len", "4096")
    body = {"model": NAME, "prompt": "import a", "max_tokens": 4000, "temperature": 1.0, "ignore_eos": True}

    def call():
        try:
            httpx.post(base + "/v1/completions", json=body, timeout=60)
        except httpx.HTTPError:
            pass  # the server went away: expected

    calls = [threading.Thread(target=call, daemon=True) for _ in range(3)]
    for t in calls:
        t.start()
    time.sleep(0.3)  # the requests are running
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the server did not exit after SIGTERM")
    assert time.time() - t0 < 8


def test_logit_bias_min_tokens_and_include_stop_str_are_honoured(client, server):
    base = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    forced_id = 7
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logit_bias": {str(forced_id): 100},
            "logprobs": 0}
    forced = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    plain = httpx.post(server + "/v1/completions", json={**body, "logit_bias": None}, timeout=60).json()["choices"][0]
    assert len(set(plain["logprobs"]["tokens"])) > 1  # without the bias the tokens differ ...
    assert len(set(forced["logprobs"]["tokens"])) == 1  # ... with it every token is the biased one
    stop = base.choices[0].text.strip()[:1]
    assert stop, "the greedy output must have a visible character"
    cut = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop])
    kept = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == cut.choices[0].text + stop
    n_cut = cut.usage.completion_tokens
    late = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop],
                                     extra_body={"min_tokens": n_cut + 2})
    assert late.usage.completion_tokens >= n_cut + 2


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),  # the whole vocabulary
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
     "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"not-a-token": 1}}, "logit_bias"),
])
def test_unimplemented_parameters_are_named_not_ignored(server, path, extra, param):
    r = httpx.post(server + path, json={"model": NAME, "max_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
