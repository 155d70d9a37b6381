"""`hyla bench serve`'s vLLM flags around the measured run: --num-warmups, --ramp-up-strategy /
--ramp-up-start-rps / --ramp-up-end-rps, --ready-check-timeout-sec, --request-id-prefix and
--logprobs, and hyla's --tool-latency-ms / --tool-latency-dist of agent sessions. Against a fake
OpenAI-compatible server (a thread of the test process, so fast) that records every request's
headers and body and counts what it served in its /metrics, and on their own: the ramp's arrival
times, the tool pauses' draws, the result file's name, the flags' errors."""

from __future__ import annotations

import itertools
import json
import math
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

import hyla.bench.serve.cli as serve_cli
from hyla.bench.serve import main as serve_bench
from hyla.bench.serve.load import ramp_arrival_times, ramp_rates, tool_latencies
from hyla.bench.serve.report import result_filename
from tests.server.live import free_port

PROMPT_TOKENS, HIT_TOKENS = 10, 4  # what the fake server counts in /metrics for each request it serves


class FakeServer(ThreadingHTTPServer):
    """/v1/models, /metrics (prefix-cache and engine-step counters of the requests served so far)
    and streamed completions and chat completions of two tokens (usage without cached tokens,
    so that the bench reads the prefix cache from /metrics). `seen`: (path, headers, body) of
    every request; fail(request_id) -> an HTTP 500 answer; delay(request_id) -> seconds to wait
    first; not_ready: /v1/models answers 503 that many times before 200."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.seen: list[tuple[str, object, dict]] = []
        self.served = 0
        self.not_ready = 0
        self.fail: Callable[[str], bool] = lambda request_id: False
        self.delay: Callable[[str], float] = lambda request_id: 0.0
        self.lock = threading.Lock()

    def posts(self) -> list[tuple[object, dict]]:
        return [(headers, body) for path, headers, body in self.seen if path.endswith("completions")]

    def ids(self) -> list[str]:
        return [headers["x-request-id"] for headers, _ in self.posts()]

    def gets(self, path: str) -> int:
        return sum(p == path for p, _, _ in self.seen)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeServer

    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.seen.append((self.path, self.headers, {}))
            served, not_ready = self.server.served, self.server.not_ready
            self.server.not_ready = max(0, not_ready - 1)
        if self.path == "/v1/models":
            if not_ready:
                self._answer(503, b'{"error": {"message": "loading"}}', "application/json")
            else:
                self._answer(200, json.dumps({"data": [{"id": "fake-model"}]}).encode(), "application/json")
        elif self.path == "/metrics":
            text = (f"hyla_prefix_cache_hit_tokens_total {HIT_TOKENS * served}\n"
                    f"hyla_prefix_cache_query_tokens_total {PROMPT_TOKENS * served}\n"
                    f"hyla_num_steps_total {served}\nhyla_engine_step_seconds_total {0.01 * served}\n"
                    f"hyla_model_execute_seconds_total {0.005 * served}\n")
            self._answer(200, text.encode(), "text/plain")
        else:
            self._answer(404, b"{}", "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        request_id = self.headers.get("x-request-id", "")
        with self.server.lock:
            self.server.seen.append((self.path, self.headers, body))
        time.sleep(self.server.delay(request_id))
        if self.server.fail(request_id):
            self._answer(500, b'{"error": {"message": "model not loaded"}}', "application/json")
            return
        chat = self.path.endswith("chat/completions")
        if chat:
            chunks = [{"delta": {"role": "assistant"}}, {"delta": {"content": "a "}},
                      {"delta": {"content": "b"}, "finish_reason": "length"}]
        else:
            chunks = [{"text": "a "}, {"text": "b", "finish_reason": "length"}]
        events = [{"choices": [{"index": 0, **c}]} for c in chunks]
        events.append({"choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 2}})
        with self.server.lock:  # counted before the answer ends: the bench's last scrape sees it
            self.server.served += 1
        stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._answer(200, stream.encode(), "text/event-stream")


@pytest.fixture
def fake():
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def bench(server: FakeServer, *flags: str, quiet: bool = True) -> dict:
    return serve_bench(["--base-url", server.url, "--model", "fake-model", "--skip-tokenizer-init", "--seed", "3",
                        "--random-input-len", "4", "--random-output-len", "2", *(["--disable-tqdm"] if quiet else []),
                        *flags])


# ---- --num-warmups -----------------------------------------------------------------------------

def test_warmups_go_first_and_count_nowhere(fake, capsys):
    fake.delay = lambda request_id: 0.5 if "warmup" in request_id else 0.0  # slow warm-ups, off the clock
    r = bench(fake, "--num-warmups", "2", "--num-prompts", "3", "--max-concurrency", "1", "--request-id-prefix",
              "run7-", quiet=False)
    out, err = capsys.readouterr()
    assert "warm-up: 2 requests, 0 failed" in out
    assert fake.ids() == ["run7-warmup-0", "run7-warmup-1", "run7-0", "run7-1", "run7-2"]
    bodies = [body for _, body in fake.posts()]
    assert bodies[0] == bodies[1] == bodies[2]  # copies of the workload's first request
    # the outputs, the /metrics differences and the clock are the measured run's only
    assert (r["num_prompts"], r["completed"], len(r["errors"]), len(r["start_times"])) == (3, 3, 3, 3)
    assert r["prefix_cache_source"] == "metrics"
    assert (r["prefix_cache_query_tokens"], r["prefix_cache_hit_tokens"]) == (3 * PROMPT_TOKENS, 3 * HIT_TOKENS)
    assert r["engine_steps"] == 3
    assert max(r["start_times"]) < 0.5 and r["duration"] < 0.5
    assert "| 3/3 " in err and "/5 " not in err  # the progress bar counts the measured requests


def test_warmups_that_all_fail_stop_the_run(fake, capsys):
    fake.fail = lambda request_id: True
    with pytest.raises(SystemExit) as exit_info:
        bench(fake, "--num-warmups", "3", "--num-prompts", "2")
    message = str(exit_info.value.code)
    assert "every warm-up request" in message and "HTTP 500: model not loaded" in message
    assert "warm-up: 3 requests, 3 failed" in capsys.readouterr().out
    assert len(fake.ids()) == 3 and all("warmup" in i for i in fake.ids()) and fake.gets("/metrics") == 0

    fake.fail = lambda request_id: request_id.endswith("warmup-0")  # one of two: the run goes on
    r = bench(fake, "--num-warmups", "2", "--num-prompts", "2")
    assert "warm-up: 2 requests, 1 failed" in capsys.readouterr().out
    assert (r["completed"], r["failed"]) == (2, 0)


# ---- --request-id-prefix, --logprobs -------------------------------------------------------------

def test_request_ids_and_logprobs_as_the_server_sees_them(fake):
    r = bench(fake, "--num-prompts", "3", "--logprobs", "2", "--header", "x-team=bench", "X-Request-Id=mine",
              "--api-key", "k")
    ids = fake.ids()
    prefix = re.fullmatch(r"(bench-[0-9a-f]{8}-)\d", ids[0]).group(1)  # vLLM's default prefix
    assert sorted(ids) == [f"{prefix}{i}" for i in range(3)]
    for headers, body in fake.posts():
        assert headers.get_all("x-request-id") == [headers["x-request-id"]]  # replaced --header's, not added
        assert headers["x-team"] == "bench" and headers["authorization"] == "Bearer k"
        assert body["logprobs"] == 2 and "top_logprobs" not in body
    assert (r["ramp_up_strategy"], r["ramp_up_start_rps"], r["ramp_up_end_rps"]) == (None, None, None)

    bench(fake, "--num-prompts", "2", "--backend", "openai-chat", "--logprobs", "0")
    bench(fake, "--num-prompts", "2")
    bench(fake, "--num-prompts", "2", "--backend", "openai-chat")
    chat, plain, chat_plain = (body for _, body in fake.posts()[3:5]), fake.posts()[5:7], fake.posts()[7:]
    assert all(body["logprobs"] is True and body["top_logprobs"] == 0 for body in chat)
    assert all("logprobs" not in body and "top_logprobs" not in body for _, body in [*plain, *chat_plain])
    assert len({i.rsplit("-", 1)[0] for i in fake.ids()}) == 4  # each run a prefix of its own


def test_agent_sessions_number_their_requests_in_send_order(fake):
    r = bench(fake, "--dataset-name", "agent", "--num-sessions", "2", "--turns", "3", "--tool-output-len", "4",
              "--question-len", "2", "--output-len", "2", "--request-id-prefix", "a-", "--max-concurrency", "1")
    assert r["completed"] == 6 and fake.ids() == [f"a-{i}" for i in range(6)]
    turns = [len(body["messages"]) for _, body in fake.posts()]  # the sessions take turns: 0, 0, 1, 1, 2, 2
    assert turns[0] == turns[1] < turns[2] == turns[3] < turns[4] == turns[5]


def test_agent_range_ratio_varies_each_turns_lengths_within_its_bounds(fake):
    """Reply lengths (max_tokens) and the turns' new messages vary within the ratio; ratio 0 keeps
    every turn the same; the result records it."""
    flags = ("--dataset-name", "agent", "--num-sessions", "6", "--turns", "4", "--tool-output-len", "40",
             "--question-len", "10", "--output-len", "20", "--max-concurrency", "4")
    equal = bench(fake, *flags)
    varied = bench(fake, *flags, "--agent-range-ratio", "0.5")
    assert equal["agent_range_ratio"] == 0 and varied["agent_range_ratio"] == 0.5
    bodies = [body for _, body in fake.posts()]
    replies = [b.get("max_completion_tokens", b.get("max_tokens")) for b in bodies]
    news = [len(b["messages"][-1]["content"].split()) for b in bodies]  # words: one a token
    n = len(equal["ttfts"])
    assert set(replies[:n]) == {20} and set(news[:n]) == {50}
    assert all(10 <= m <= 30 for m in replies[n:]) and len(set(replies[n:])) > 3
    assert all(25 <= m <= 75 for m in news[n:]) and len(set(news[n:])) > 6


# ---- --tool-latency-ms, --tool-latency-dist ------------------------------------------------------

AGENT = ("--dataset-name", "agent", "--num-sessions", "2", "--turns", "3", "--tool-output-len", "4",
         "--question-len", "2", "--output-len", "2")


def _gaps(r: dict) -> list[float]:
    """Seconds from each reply's end to the next turn's start, over every conversation's turns."""
    ends = [s + e for s, e in zip(r["start_times"], r["latencies"])]
    return [r["start_times"][i] - ends[i - 1] for i, turn in enumerate(r["turns"]) if turn > 0]


def _span(r: dict, first: int, n: int) -> float:
    """Seconds from the start of a conversation's first turn (output `first`) to its last reply."""
    last = first + n - 1
    return r["start_times"][last] + r["latencies"][last] - r["start_times"][first]


# A pause far above what a fake server's request or the client's turnaround takes, even on a loaded
# 2-core machine (a 50 ms pause there once saw a 50.7 ms first TTFT)
PAUSE_MS = 300
P = PAUSE_MS / 1e3


def test_tool_latency_pauses_between_turns_outside_the_requests(fake, tmp_path, capsys):
    base = bench(fake, *AGENT, "--tool-latency-ms", "0", "--tool-latency-dist", "fixed")
    paused = bench(fake, *AGENT, "--tool-latency-ms", str(PAUSE_MS), "--tool-latency-dist", "fixed", "--save-result",
                   "--result-dir", str(tmp_path))
    assert f"tool latency fixed {PAUSE_MS} ms between turns" in capsys.readouterr().out
    for r in (base, paused):
        assert r["completed"] == 6 and r["turns"] == [0, 1, 2, 0, 1, 2]
    # 0: the next turn goes the instant the reply ends; fixed: every later turn waits PAUSE_MS first
    assert all(g < P for g in _gaps(base)) and len(_gaps(paused)) == 4 and all(g >= P for g in _gaps(paused))
    for first in (0, 3):  # each conversation: its three requests and at least two pauses between them
        requests = sum(paused["latencies"][first:first + 3])
        assert _span(paused, first, 3) >= requests + 2 * P
        assert _span(paused, first, 3) > _span(base, first, 3) + P
    assert paused["duration"] >= 2 * P and paused["duration"] > base["duration"] + P  # in the duration
    # in no request's TTFT or E2E latency: the fake server answers at once
    assert max(paused["ttfts"]) < P and max(paused["latencies"]) < P
    (saved,) = tmp_path.iterdir()
    result = json.loads(saved.read_text())
    assert (result["tool_latency_ms"], result["tool_latency_dist"]) == (float(PAUSE_MS), "fixed")
    assert (base["tool_latency_ms"], base["tool_latency_dist"]) == (0.0, "fixed")
    assert bench(fake, "--num-prompts", "1", "--tool-latency-ms", "0")["tool_latency_ms"] == 0.0  # 0: any dataset

    # a session pausing for its tool holds no place under --max-concurrency
    one = bench(fake, *AGENT, "--tool-latency-ms", str(PAUSE_MS), "--tool-latency-dist", "fixed", "--max-concurrency", "1")
    assert one["completed"] == 6 and max(one["queue_times"]) < P and all(g >= P for g in _gaps(one))


def test_tool_latency_draws_are_seeded():
    assert tool_latencies([3, 1, 0], 50, "fixed", 0) == [[0.0, 0.05, 0.05], [0.0], []]
    assert tool_latencies([2, 2], 0, "exponential", 0) == [[0.0, 0.0], [0.0, 0.0]]
    draws = tool_latencies([4001], 50, "exponential", 7)
    assert draws == tool_latencies([4001], 50, "exponential", 7) != tool_latencies([4001], 50, "exponential", 8)
    pauses = np.asarray(draws[0][1:])
    assert draws[0][0] == 0.0 and len(pauses) == 4000 and (pauses >= 0).all()
    assert pauses.mean() == pytest.approx(0.05, rel=0.05) and pauses.std() == pytest.approx(0.05, rel=0.1)
    # a stream of its own: not the draws the arrival times take from the same seed
    assert not np.allclose(pauses, np.random.default_rng(7).exponential(0.05, 4000))
    with pytest.raises(ValueError, match="fixed, exponential"):
        tool_latencies([2], 50, "gamma", 0)
    with pytest.raises(ValueError, match="non-negative and finite"):
        tool_latencies([2], math.inf, "fixed", 0)


def test_tool_latency_runs_are_reproducible(fake, monkeypatch):
    drawn = []

    def spy(*args):
        drawn.append(tool_latencies(*args))
        return drawn[-1]
    monkeypatch.setattr(serve_cli, "tool_latencies", spy)
    runs = [bench(fake, *AGENT, "--tool-latency-ms", "5", *seed) for seed in ([], [], ["--seed", "4"])]
    assert drawn[0] == drawn[1] != drawn[2] and all(r["tool_latency_dist"] == "exponential" for r in runs)
    assert [len(d) for d in drawn[0]] == [3, 3] and all(p > 0 for d in drawn[0] for p in d[1:])
    for r, d in zip(runs, drawn):  # each pause waited between its turns
        assert all(g >= p for g, p in zip(_gaps(r), [p for c in d for p in c[1:]]))
    bench(fake, *AGENT)
    assert len(drawn) == 3  # 0, the default: nothing drawn, nothing waited


# ---- --ready-check-timeout-sec -------------------------------------------------------------------

def test_ready_check_times_out_on_a_closed_port():
    port = free_port()
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        serve_bench(["--port", str(port), "--model", "x", "--skip-tokenizer-init", "--disable-tqdm",
                     "--num-prompts", "2", "--ready-check-timeout-sec", "1"])
    elapsed = time.perf_counter() - start
    message = str(exit_info.value.code)
    assert f"http://127.0.0.1:{port}/v1/models" in message and "--ready-check-timeout-sec 1 s" in message
    assert "ConnectError" in message and 1.0 <= elapsed < 3.0


def test_ready_check_waits_for_the_server(fake):
    bench(fake, "--num-prompts", "1")
    assert fake.gets("/v1/models") == 0  # 0, the default: no check (and --model asks no model)
    fake.not_ready = 1
    start = time.perf_counter()
    r = bench(fake, "--num-prompts", "1", "--ready-check-timeout-sec", "5")
    assert r["completed"] == 1 and fake.gets("/v1/models") == 2 and time.perf_counter() - start >= 1.0


# ---- --ramp-up-strategy ------------------------------------------------------------------------

def test_ramp_arrival_times():
    rng = np.random.default_rng
    assert ramp_rates(5, "linear", 1, 5) == pytest.approx([1, 2, 3, 4, 5])
    assert ramp_rates(5, "exponential", 1, 16) == pytest.approx([1, 2, 4, 8, 16])
    assert ramp_rates(1, "linear", 2, 8) == ramp_rates(1, "exponential", 2, 8) == [2.0]
    # burstiness inf: every gap exactly 1 / its rate, summed, not rescaled
    linear = ramp_arrival_times(5, "linear", 1, 5, math.inf, rng(0))
    assert linear == pytest.approx(np.cumsum([1, 1 / 2, 1 / 3, 1 / 4, 1 / 5]).tolist(), rel=1e-12)
    exponential = ramp_arrival_times(5, "exponential", 1, 16, math.inf, rng(0))
    assert exponential == pytest.approx(np.cumsum([1, 1 / 2, 1 / 4, 1 / 8, 1 / 16]).tolist(), rel=1e-12)
    assert ramp_arrival_times(1, "exponential", 2, 8, math.inf, rng(0)) == [0.5]

    for strategy, burstiness in itertools.product(("linear", "exponential"), (1.0, 4.0)):
        times = ramp_arrival_times(4000, strategy, 1, 100, burstiness, rng(2))
        assert len(times) == 4000 and all(a <= b for a, b in itertools.pairwise(times))
        assert times == ramp_arrival_times(4000, strategy, 1, 100, burstiness, rng(2))
        assert times != ramp_arrival_times(4000, strategy, 1, 100, burstiness, rng(3))
        # each gap over its mean 1 / r_i: a gamma of shape `burstiness` and mean 1
        scaled = np.diff([0.0, *times]) * np.asarray(ramp_rates(4000, strategy, 1, 100))
        assert scaled.mean() == pytest.approx(1.0, rel=0.05)
        assert scaled.std() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_ramp_run_records_the_ramp_and_names_the_file(fake, tmp_path, capsys):
    r = bench(fake, "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "20", "--ramp-up-end-rps", "40",
              "--burstiness", "inf", "--num-prompts", "3", "--max-concurrency", "2", "--save-result",
              "--result-dir", str(tmp_path), "--label", "lab")
    assert "3 requests, ramp-up linear 20 -> 40 rps, burstiness inf" in capsys.readouterr().out
    assert (r["ramp_up_strategy"], r["ramp_up_start_rps"], r["ramp_up_end_rps"]) == ("linear", 20, 40)
    assert r["request_rate"] == "inf" and r["completed"] == 3
    arrivals = np.cumsum([1 / 20, 1 / 30, 1 / 40])
    assert all(start >= arrival - 0.01 for start, arrival in zip(sorted(r["start_times"]), arrivals))
    (saved,) = tmp_path.iterdir()
    assert re.fullmatch(r"lab-ramp-up-linear-20qps-40qps-concurrency2-fake-model-\d{8}-\d{6}\.json", saved.name)
    result = json.loads(saved.read_text())
    assert (result["ramp_up_strategy"], result["ramp_up_start_rps"], result["ramp_up_end_rps"]) == ("linear", 20, 40)


def test_agent_ramp_arrivals_are_per_session(fake, monkeypatch):
    counts = []

    def spy(n, *args):
        counts.append(n)
        return ramp_arrival_times(n, *args)
    monkeypatch.setattr(serve_cli, "ramp_arrival_times", spy)
    r = bench(fake, "--dataset-name", "agent", "--num-sessions", "2", "--turns", "2", "--tool-output-len", "4",
              "--question-len", "2", "--output-len", "2", "--ramp-up-strategy", "exponential",
              "--ramp-up-start-rps", "50", "--ramp-up-end-rps", "100")
    assert counts == [2] and r["completed"] == 4 and r["ramp_up_strategy"] == "exponential"


def test_result_filename():
    ramp = result_filename("vllm", math.inf, 8, "org/m", "20250101-000000", None, "res", ("exponential", 1, 2.5))
    assert str(ramp) == "res/vllm-ramp-up-exponential-1qps-2.5qps-concurrency8-m-20250101-000000.json"
    assert str(result_filename("vllm", math.inf, None, "m", "d", None, None, ("linear", 3, 3))) == \
        "vllm-ramp-up-linear-3qps-3qps-m-d.json"
    assert str(result_filename("vllm", 8.0, None, "org/m", "d", None, None)) == "vllm-8.0qps-m-d.json"
    assert str(result_filename("vllm", 8.0, 2, "m", "d", "mine.json", None, ("linear", 1, 2))) == "mine.json"


# ---- the flags' errors -------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--ramp-up-strategy", "linear"], "needs both --ramp-up-start-rps and --ramp-up-end-rps"),
    (["--ramp-up-strategy", "linear", "--ramp-up-end-rps", "4"], "needs both --ramp-up-start-rps and"),
    (["--ramp-up-start-rps", "1", "--ramp-up-end-rps", "4"], "need --ramp-up-strategy"),
    (["--ramp-up-end-rps", "4"], "need --ramp-up-strategy"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "4", "--request-rate", "5"],
     "--request-rate 5.0 with --ramp-up-strategy: leave --request-rate out (inf), the ramp sets the rate"),
    (["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0", "--ramp-up-end-rps", "4"],
     "a rate of 0 sends nothing"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "-2"],
     "--ramp-up-start-rps and --ramp-up-end-rps must be positive"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "inf"], "and finite"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "5", "--ramp-up-end-rps", "2"],
     "--ramp-up-start-rps 5 must not exceed --ramp-up-end-rps 2"),
    (["--ramp-up-strategy", "quadratic"], "--ramp-up-strategy"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "fast"], "--ramp-up-start-rps"),
    (["--num-warmups", "-1"], "--num-warmups"),
    (["--ready-check-timeout-sec", "-1"], "--ready-check-timeout-sec"),
    (["--logprobs", "-1"], "--logprobs"),
    (["--request-id-prefix", "a\nb"], "--request-id-prefix"),
    (["--dataset-name", "agent", "--tool-latency-ms", "-1"],
     "argument --tool-latency-ms: must be a finite number of milliseconds, at least 0, got -1"),
    (["--dataset-name", "agent", "--tool-latency-ms", "inf"], "argument --tool-latency-ms: must be a finite"),
    (["--dataset-name", "agent", "--tool-latency-ms", "nan"], "argument --tool-latency-ms: must be a finite"),
    (["--dataset-name", "agent", "--tool-latency-ms", "slow"], "argument --tool-latency-ms: expected a number"),
    (["--dataset-name", "agent", "--tool-latency-dist", "gamma"], "argument --tool-latency-dist: invalid choice"),
    (["--tool-latency-ms", "50"], "--tool-latency-ms is the pause between an agent session's turns; the random "
     "dataset sends one request per conversation"),
    (["--dataset-name", "prefix", "--tool-latency-ms", "0.5"], "the prefix dataset sends one request"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1), got 1.5"),
    (["--dataset-name", "agent", "--agent-range-ratio", "1"], "--agent-range-ratio must be in [0, 1), got 1.0"),
    (["--dataset-name", "agent", "--agent-range-ratio", "-0.1"], "--agent-range-ratio must be in [0, 1)"),
    (["--agent-range-ratio", "0.5"], "--agent-range-ratio sets the agent dataset's turn lengths, not the random"),
])
def test_flag_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_bench(["--port", "1", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
