"""`hyla bench serve` against a live `hyla serve` of the bundled default model (one server for the
module, a second one without the prefix cache for one test), and its parts on their own: arrival
times, datasets, Prometheus parsing, the metrics, the flags."""

from __future__ import annotations

import itertools
import json
import math
import os

import httpx
import numpy as np
import pytest

from hyla.bench.__main__ import main as bench_main
from hyla.bench.serve import main as serve_bench
from hyla.bench.serve.client import RequestOutput
from hyla.bench.serve.datasets import DatasetSpec, build_workload
from hyla.bench.serve.load import arrival_times
from hyla.bench.serve.metrics import compute_metrics, parse_goodput
from hyla.bench.serve.server_metrics import engine_time, parse_prometheus, prefix_cache_counters
from hyla.bench.serve.tokens import LocalTokenizer, fit_text, local_checkpoint
from hyla.models.default import default_model_path
from tests.server.live import MAX_MODEL_LEN, free_port, metric, start, stop

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUIET = ["--disable-tqdm", "--seed", "3"]
METRICS = ("ttft", "tpot", "itl", "e2el")
# vLLM's result keys (the percentile ones for its default --percentile-metrics ttft,tpot,itl)
SAVED_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
              "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
              "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
              "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests", "latencies",
              "queue_times", "prefix_cache_hit_rate",
              *(f"{s}_{m}_ms" for s in ("mean", "median", "std") for m in METRICS),
              *(f"p99_{m}_ms" for m in ("ttft", "tpot", "itl"))}
DETAILED_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors"}


def serve_default(*extra: str):
    # served by its path: the name (default_model) is no checkpoint the benchmark finds locally,
    # so the server's /tokenize writes the prompts unless a test says otherwise
    proc, base = start(default_model_path(), *extra)
    yield base
    stop(proc)


@pytest.fixture(scope="module")
def step_log(tmp_path_factory):
    return tmp_path_factory.mktemp("steps") / "steps.jsonl"


@pytest.fixture(scope="module")
def server(step_log):
    yield from serve_default("--step-log", str(step_log))


@pytest.fixture(scope="module")
def no_cache_server():
    yield from serve_default("--no-enable-prefix-caching")


@pytest.fixture(scope="module")
def tokenizer():
    return LocalTokenizer(local_checkpoint("default"), "default")


def run(base: str, *args: str) -> dict:
    return serve_bench(["--base-url", base, *QUIET, *args])


def counters(base: str) -> tuple[float, float]:
    return metric(base, "hyla_prompt_tokens_total"), metric(base, "hyla_generation_tokens_total")


# ---- against the live server ------------------------------------------------------------------

TOKENIZER_FLAGS = {"ids": ["--skip-tokenizer-init"], "local": ["--tokenizer", "default"], "server": []}


@pytest.mark.parametrize("prompts", list(TOKENIZER_FLAGS))
def test_random_dataset_counts_what_the_server_counted(server, prompts):
    if prompts == "server" and httpx.post(server + "/tokenize", json={"prompt": "a"}).status_code == 404:
        pytest.skip("this server has no /tokenize")
    before = counters(server)
    r = run(server, "--random-input-len", "24", "--random-output-len", "5", "--num-prompts", "6",
            "--metric-percentiles", "50,90,99", "--percentile-metrics", "ttft,tpot,itl,e2el", *TOKENIZER_FLAGS[prompts])
    after = counters(server)
    assert (r["completed"], r["failed"], r["num_prompts"]) == (6, 0, 6)
    assert r["tokenizer_id"] == {"ids": None, "local": "default", "server": server + "/tokenize"}[prompts]
    # usage: the server's counts, and the random dataset forces ignore_eos (every token generated)
    assert r["output_lens"] == [5] * 6 and r["total_output_tokens"] == after[1] - before[1] == 30
    assert r["total_input_tokens"] == sum(r["input_lens"]) == after[0] - before[0]
    assert r["model_id"] == "default_model" and r["request_rate"] == "inf" and r["errors"] == [""] * 6
    for i in range(6):  # one token per chunk: hyla streams every token
        assert len(r["itls"][i]) == 4 and 0 < r["ttfts"][i] <= r["latencies"][i]
        assert r["latencies"][i] == pytest.approx(r["ttfts"][i] + sum(r["itls"][i]))
    for m in METRICS:
        assert r[f"median_{m}_ms"] == pytest.approx(r[f"p50_{m}_ms"])
        assert 0 < r[f"p50_{m}_ms"] <= r[f"p90_{m}_ms"] <= r[f"p99_{m}_ms"]
        assert r[f"std_{m}_ms"] >= 0
    assert max(r["ttfts"]) * 1e3 >= r["p99_ttft_ms"] >= min(r["ttfts"]) * 1e3
    assert r["request_throughput"] == pytest.approx(6 / r["duration"])
    assert r["output_throughput"] == pytest.approx(30 / r["duration"])
    assert r["total_token_throughput"] == pytest.approx((30 + r["total_input_tokens"]) / r["duration"])
    assert r["request_goodput"] is None
    # where the run's time went (a hyla server's /metrics): the engine's steps, their model executions
    assert r["engine_steps"] >= 5 and 0 < r["model_execute_seconds"] < r["engine_step_seconds"]
    assert 0 < r["model_execute_share"] < r["engine_step_share"] <= 1.05


def test_request_rate_and_max_concurrency(server):
    r = run(server, "--random-input-len", "8", "--random-output-len", "3", "--num-prompts", "8",
            "--request-rate", "40", "--max-concurrency", "2")
    assert r["completed"] == 8 and r["max_concurrent_requests"] <= 2
    assert r["request_rate"] == 40 and r["max_concurrency"] == 2
    assert r["duration"] >= 8 / 40  # the last arrival is at n / rate
    sent = sorted(r["start_times"])
    assert sent[-1] >= 8 / 40 - 0.01 and all(q >= 0 for q in r["queue_times"])


def test_goodput(server):
    met = run(server, "--random-input-len", "8", "--random-output-len", "3", "--num-prompts", "4",
              "--goodput", "ttft:100000", "e2el:100000", "tpot:100000")
    assert met["request_goodput"] == pytest.approx(met["request_throughput"])
    missed = run(server, "--random-input-len", "8", "--random-output-len", "3", "--num-prompts", "4",
                 "--goodput", "ttft:0")
    assert missed["request_goodput"] == 0.0 and missed["completed"] == 4


def test_prefix_dataset_hits_the_prefix_cache(server):
    for backend in ("openai", "openai-chat"):
        r = run(server, "--dataset-name", "prefix", "--backend", backend, "--prefix-len", "48", "--suffix-len", "6",
                "--num-prefixes", "2", "--num-prompts", "8", "--output-len", "3", "--max-concurrency", "1")
        assert r["completed"] == 8 and 0 < r["prefix_cache_hit_rate"] < 1
        assert r["prefix_cache_hit_tokens"] <= r["prefix_cache_query_tokens"]
        if r["prefix_cache_source"] == "usage":  # the server reports usage.prompt_tokens_details
            assert r["prefix_cache_hit_tokens"] == sum(r["cached_tokens"])
            assert r["prefix_cache_query_tokens"] == r["total_input_tokens"]
        else:
            assert r["prefix_cache_source"] == "metrics"


def test_agent_sessions_run_their_turns_in_order_and_hit_the_cache(server):
    r = run(server, "--dataset-name", "agent", "--num-sessions", "2", "--turns", "3", "--tool-output-len", "20",
            "--question-len", "6", "--output-len", "4", "--agent-system-len", "24", "--agent-session-prefix-len", "8")
    assert r["backend"] == "openai-chat" and (r["num_prompts"], r["completed"]) == (6, 6)
    assert min(r["input_lens"]) >= 24 + 8 + 20 + 6  # the server counted every turn's system message
    for session in range(2):
        turns = range(3 * session, 3 * session + 3)
        for a, b in itertools.pairwise(turns):  # each turn sent after the previous reply, with it as history
            assert r["start_times"][b] >= r["start_times"][a] + r["latencies"][a]
            assert r["input_lens"][b] > r["input_lens"][a] + r["output_lens"][a]
    assert r["prefix_cache_hit_rate"] > 0
    # TTFT of the turns after each session's first, on their own (what a prefix cache serves)
    assert r["turns"] == [0, 1, 2, 0, 1, 2]
    returning = [t for t, turn in zip(r["ttfts"], r["turns"]) if turn > 0]
    assert r["mean_ttft_returning_ms"] == pytest.approx(1000 * sum(returning) / len(returning))


def test_the_step_log_takes_each_ttft_apart(server, step_log, tmp_path):
    """The bench keeps each stream's id; the server's step log names the same ids in the steps
    that computed their prompts; step_log_summary joins them: every request found, by turn."""
    from tests.scripts import load_script

    saved = tmp_path / "agent.json"
    r = run(server, "--dataset-name", "agent", "--num-sessions", "2", "--turns", "2", "--tool-output-len", "20",
            "--question-len", "6", "--output-len", "3", "--save-result", "--save-detailed", "--result-filename",
            str(saved))
    result = json.loads(saved.read_text())
    assert result["response_ids"] == r["response_ids"]
    assert (result["tool_latency_ms"], result["tool_latency_dist"]) == (0.0, "exponential")  # the defaults
    # the server names each response after the bench's x-request-id (vLLM's rule), and the
    # engine's request after the response, "@" and a suffix of its own (a client's id need not be unique)
    assert all(isinstance(i, str) and i.startswith("chatcmpl-bench-") for i in r["response_ids"])
    lines = [json.loads(line) for line in step_log.read_text().splitlines()]

    def answered(engine_ids):
        return {e.rpartition("@")[0] for e in engine_ids}

    assert set(r["response_ids"]) <= answered(rid for s in lines for rid, _, _ in s.get("prefill", ()))
    assert set(r["response_ids"]) <= answered(line["request"] for line in lines if line["kind"] == "arrival")
    table = load_script("step_log_summary").ttft_parts(lines, str(saved)).splitlines()
    assert "to the engine ms | waiting ms | to the client ms" in table[0]  # one machine: one clock
    rows = [line.split("|")[1:-1] for line in table[2:]]
    assert [(int(t), int(n)) for t, n, *_ in rows] == [(0, 2), (1, 2)]
    for turn, row in enumerate(rows):
        want = 1000 * np.mean([t for t, k in zip(r["ttfts"], r["turns"]) if k == turn])
        ttft, span, to_engine, waiting, to_client = map(float, row[2:7])
        assert ttft == pytest.approx(want, abs=0.1)
        assert 0 < span <= ttft + 1  # its prefill steps lie inside its TTFT (1 ms of rounding)
        # the parts, each in order on the shared clock (0.1 ms of rounding each), add up to the TTFT
        assert min(to_engine, waiting, to_client) >= -0.1
        assert to_engine + waiting + span + to_client == pytest.approx(ttft, abs=0.5)


def test_sharegpt_dataset(server, tokenizer, tmp_path):
    entries = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"Write a Python function number {i} that adds up a list of numbers."},
        {"from": "gpt", "value": "def total(xs):\n    return sum(xs)\n" * (i + 1)}]} for i in range(3)]
    entries.append({"id": "short", "conversations": [{"from": "human", "value": "hi"},  # under 4 tokens: skipped
                                                     {"from": "gpt", "value": "hello there you"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    r = run(server, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "5", "--tokenizer",
            "default")
    assert (r["completed"], r["failed"]) == (5, 0)  # 3 usable pairs, topped up to 5
    longest = max(len(tokenizer.encode(e["conversations"][1]["value"])) for e in entries[:3])
    assert all(0 < n <= longest for n in r["output_lens"])  # max_tokens: the reply's length


def test_no_prefix_cache_means_a_zero_hit_rate(no_cache_server):
    for dataset in (["--dataset-name", "prefix", "--prefix-len", "48", "--suffix-len", "6", "--num-prefixes", "2",
                     "--num-prompts", "6", "--max-concurrency", "1"],
                    ["--dataset-name", "agent", "--num-sessions", "2", "--turns", "2", "--tool-output-len", "20",
                     "--question-len", "6"]):
        r = run(no_cache_server, *dataset, "--output-len", "3")
        assert r["completed"] == r["num_prompts"] and r["prefix_cache_hit_rate"] == 0.0


def test_plots_and_saved_results(server, tmp_path):
    bench_main(["serve", "--base-url", server, *QUIET, "--random-input-len", "8", "--random-output-len", "3",
                "--num-prompts", "4", "--save-result", "--result-dir", str(tmp_path / "res"), "--plot",
                str(tmp_path / "figs"), "--label", "t", "--metadata", "run=1"])
    for name in ("latency_cdf", "latency_over_time"):
        data = (tmp_path / "figs" / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    (saved,) = (tmp_path / "res").iterdir()
    assert saved.name.startswith("t-infqps-default_model-")
    result = json.loads(saved.read_text())
    assert SAVED_KEYS <= result.keys() and not DETAILED_KEYS & result.keys()
    assert result["run"] == "1" and result["label"] == "t" and "p99_e2el_ms" not in result  # e2el not selected
    run(server, "--random-input-len", "8", "--random-output-len", "3", "--num-prompts", "2", "--save-result",
        "--save-detailed", "--result-filename", str(tmp_path / "detailed.json"))
    detailed = json.loads((tmp_path / "detailed.json").read_text())
    assert (SAVED_KEYS | DETAILED_KEYS) <= detailed.keys()
    assert all(len(detailed[k]) == 2 for k in DETAILED_KEYS)


def test_failures_are_recorded(server):
    too_long = run(server, "--random-input-len", str(MAX_MODEL_LEN + 20), "--random-output-len", "3",
                   "--num-prompts", "3")
    assert (too_long["completed"], too_long["failed"]) == (0, 3)
    assert all(e.startswith("HTTP 400: ") and "max_model_len" in e for e in too_long["errors"])
    assert too_long["mean_ttft_ms"] == 0.0 and too_long["total_output_tokens"] == 0
    # an agent session whose history outgrows the model: the turn that does not fit fails, the
    # turn after it is never sent
    grows = run(server, "--dataset-name", "agent", "--num-sessions", "1", "--turns", "4", "--tool-output-len", "90",
                "--question-len", "8", "--output-len", "8")
    errors = grows["errors"]
    first = next(i for i, e in enumerate(errors) if e)
    assert first >= 1 and errors[first].startswith("HTTP 400: ")
    assert all(e.startswith("not sent: ") for e in errors[first + 1:]) and first + 1 < len(errors)
    assert grows["completed"] + grows["failed"] == 4


def test_unreachable_server_fails_every_request():
    r = serve_bench(["--port", str(free_port()), "--model", "x", "--skip-tokenizer-init", *QUIET,
                     "--random-input-len", "4", "--random-output-len", "2", "--num-prompts", "3"])
    assert r["failed"] == 3 and all(e.startswith("ConnectError") for e in r["errors"])
    assert r["prefix_cache_hit_rate"] is None and r["engine_step_share"] is None


# ---- the parts on their own -------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--request-rate", "0"], "--request-rate"),
    (["--burstiness", "-1"], "--burstiness"),
    (["--goodput", "ttft"], "KEY:MILLISECONDS"),
    (["--goodput", "ttft:-1"], "non-negative"),
    (["--goodput", "queue:5"], "ttft, tpot, e2el"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics"),
    (["--metric-percentiles", "50,101"], "[0, 100]"),
    (["--dataset-name", "sharegpt"], "--dataset-path"),
    (["--dataset-path", "x.json"], "sharegpt"),
    (["--random-range-ratio", "1.0"], "[0, 1)"),
    (["--dataset-name", "agent", "--backend", "openai"], "openai-chat"),
    (["--dataset-name", "agent", "--num-sessions", "2", "--turns", "2", "--num-prompts", "5"], "--num-prompts"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--endpoint"),
    (["--header", "novalue"], "KEY=VALUE"),
    (["--dataset-name", "agent", "--agent-system-len", "-1"], "--agent-system-len"),
    (["--dataset-name", "nope"], "--dataset-name"),
    (["--model", "default", "--dataset-name", "sharegpt", "--dataset-path", "/nonexistent/sg.json"], "/nonexistent"),
    (["--model", "default", "--dataset-name", "prefix", "--num-prefixes", "9", "--num-prompts", "3"], "--num-prefixes"),
])
def test_argument_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_bench(["--port", "1", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_arrival_times():
    rng = np.random.default_rng
    assert arrival_times(5, math.inf, 1.0, rng(0)) == [0.0] * 5
    times = arrival_times(50, 10.0, 1.0, rng(0))
    assert times == arrival_times(50, 10.0, 1.0, rng(0)) and times != arrival_times(50, 10.0, 1.0, rng(1))
    assert times[-1] == pytest.approx(5.0) and all(a <= b for a, b in itertools.pairwise(times))
    assert arrival_times(4, 2.0, math.inf, rng(0)) == pytest.approx([0.5, 1.0, 1.5, 2.0])

    def spread(burstiness):  # coefficient of variation of the gaps: 1 / sqrt(shape) for a gamma
        gaps = np.diff([0.0, *arrival_times(4000, 10.0, burstiness, rng(2))])
        return gaps.std() / gaps.mean()
    assert spread(0.25) == pytest.approx(2.0, rel=0.1) and spread(1.0) == pytest.approx(1.0, rel=0.1)
    assert spread(4.0) == pytest.approx(0.5, rel=0.1)


def test_datasets_are_seeded(tokenizer):
    for name, chat in (("random", False), ("prefix", False), ("prefix", True), ("agent", True)):
        spec = DatasetSpec(name=name, num_prompts=6, random_input_len=16, random_range_ratio=0.5, prefix_len=12,
                           suffix_len=4, num_prefixes=2, num_sessions=2, turns=3, tool_output_len=10, question_len=4)
        first, again = build_workload(spec, tokenizer, chat), build_workload(spec, tokenizer, chat)
        other = build_workload(DatasetSpec(**{**spec.__dict__, "seed": 1}), tokenizer, chat)
        assert first == again and first != other, name
        assert sum(len(c.requests) for c in first) == 6, name


def test_random_dataset_lengths(tokenizer):
    spec = DatasetSpec(num_prompts=40, random_input_len=21, random_output_len=10, random_range_ratio=0.5,
                       random_prefix_len=5)
    requests = [c.requests[0] for c in build_workload(spec, None, chat=False)]  # token ids: exact lengths
    assert all(10 <= len(r.prompt) - 5 <= 32 and 5 <= r.expected_output_len <= 15 for r in requests)
    assert len({tuple(r.prompt[:5]) for r in requests}) == 1  # the shared prefix
    texts = [c.requests[0] for c in build_workload(spec, tokenizer, chat=False)]
    # the tokenizer adds BOS: 20 sampled tokens around 21, and the text re-encodes to its count
    assert all(isinstance(r.prompt, str) and len(tokenizer.encode(r.prompt)) == r.prompt_len for r in texts)
    assert all(10 + 5 <= r.prompt_len <= 30 + 5 + 1 for r in texts)


def test_random_prompts_from_a_small_pool_differ():
    """Pools smaller than a vocabulary (no tokenizer: 1,000 anonymous ids or WORDS; a server's
    tokenizer: WORDS' ids) draw each id: consecutive runs from random offsets repeated, and the
    prefix cache then served most of a 'random' run (99% hits against a synthetic vocabulary)."""
    spec = DatasetSpec(num_prompts=200, random_input_len=16)
    for chat in (False, True):
        prompts = [c.requests[0].prompt for c in build_workload(spec, None, chat=chat)]
        starts = {tuple(p[:4]) if not chat else tuple(p.split()[:4]) for p in prompts}
        assert len(starts) == 200, chat


def test_a_one_token_pool_is_refused():
    class OneWord:  # a server tokenizer whose vocabulary has none of WORDS: one id for all of them
        name = "http://server/tokenize"

        def pool(self):
            return np.array([7])
    with pytest.raises(ValueError, match="1 ordinary token id.*--tokenizer"):
        build_workload(DatasetSpec(num_prompts=2, random_input_len=8), OneWord(), chat=False)


def test_prefix_and_agent_structure(tokenizer):
    spec = DatasetSpec(name="prefix", num_prompts=7, prefix_len=12, suffix_len=4, num_prefixes=3, shuffle=False)
    chat = [c.requests[0] for c in build_workload(spec, tokenizer, chat=True)]
    assert [r.system for r in chat[:3]] != [chat[0].system] * 3 and chat[3].system == chat[0].system
    assert len({r.system for r in chat}) == 3 and len({r.prompt for r in chat}) == 7
    plain = [c.requests[0] for c in build_workload(spec, tokenizer, chat=False)]
    assert plain[3].prompt.startswith(chat[0].system) and plain[0].prompt == chat[0].system + chat[0].prompt
    sessions = build_workload(DatasetSpec(name="agent", num_sessions=3, turns=4, tool_output_len=10, question_len=3,
                                          agent_output_len=5), tokenizer, chat=True)
    assert [len(s.requests) for s in sessions] == [4, 4, 4]
    lens = [r.prompt_len for r in sessions[0].requests]
    assert all(b > a + 5 for a, b in itertools.pairwise(lens))
    assert all(r.system is None for s in sessions for r in s.requests)
    # a system message of 12 shared tokens + 6 of each session's (vLLM multi-turn's two prefixes)
    prefixed = build_workload(DatasetSpec(name="agent", num_sessions=3, turns=4, tool_output_len=10, question_len=3,
                                          agent_output_len=5, agent_system_len=12, agent_session_prefix_len=6),
                              tokenizer, chat=True)
    systems = [s.requests[0].system for s in prefixed]
    assert all(r.system == system for s, system in zip(prefixed, systems) for r in s.requests)
    assert len(set(systems)) == 3 and len(tokenizer.encode(systems[0], add_special_tokens=False)) == 18
    shared = os.path.commonprefix(systems)
    assert len(tokenizer.encode(shared, add_special_tokens=False)) >= 11  # the shared 12 (a boundary may merge)
    first = prefixed[0].requests[0]  # its length counts the system message's
    assert first.prompt_len == 18 + len(tokenizer.encode(first.prompt, add_special_tokens=False))
    with pytest.raises(ValueError, match="chat"):
        build_workload(DatasetSpec(name="agent"), tokenizer, chat=False)


def test_sharegpt_parsing(tokenizer, tmp_path):
    path = tmp_path / "sg.json"
    long_reply = "the result of the function is returned to the caller " * 3
    path.write_text(json.dumps([
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "What does the sum "
                           "function do with a list?"}, {"from": "gpt", "value": long_reply}]},
        {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": long_reply}]},  # prompt < 4
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
        {"no": "conversations"},
    ]))
    spec = DatasetSpec(name="sharegpt", path=str(path), num_prompts=3)
    requests = [c.requests[0] for c in build_workload(spec, tokenizer, chat=False)]
    assert len(requests) == 3 and {r.prompt for r in requests} == {"What does the sum function do with a list?"}
    assert requests[0].expected_output_len == len(tokenizer.encode(long_reply))
    fewer = build_workload(DatasetSpec(name="sharegpt", path=str(path), num_prompts=3, oversample=False,
                                       sharegpt_output_len=7), tokenizer, chat=False)
    assert len(fewer) == 1 and fewer[0].requests[0].expected_output_len == 7
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="not a ShareGPT file"):
        build_workload(spec, tokenizer, chat=False)
    with pytest.raises(ValueError, match="--tokenizer"):
        build_workload(spec, None, chat=False)


def test_fit_text(tokenizer):
    rng = np.random.default_rng(0)
    pool = tokenizer.pool()
    assert 0 not in pool and len(pool) > 4000  # special tokens are never drawn
    hits = 0
    for n in (1, 7, 64):
        text, ids = fit_text(tokenizer, pool[rng.integers(0, len(pool), n)].tolist(), n, rng)
        assert tokenizer.encode(text) == ids
        hits += len(ids) == n
    assert hits == 3


def test_parse_prometheus():
    text = "\n".join([
        "# HELP hyla_prefix_cache_hit_tokens_total Prompt tokens served",
        "hyla_prefix_cache_hit_tokens_total 12.0",
        "hyla_prefix_cache_query_tokens_total 40.0",
        'vllm:prefix_cache_hits_total{engine="0",model_name="a b}"} 3',
        'vllm:prefix_cache_hits_total{engine="1",model_name="x \\"q\\""} 4',
        'vllm:prefix_cache_queries_total{engine="0"} 20',
        "garbage line without value",
    ])
    values = parse_prometheus(text)
    assert values["hyla_prefix_cache_hit_tokens"] == 12 and values["vllm:prefix_cache_hits"] == 7
    assert prefix_cache_counters(values) == (12, 40)
    del values["hyla_prefix_cache_hit_tokens"]
    assert prefix_cache_counters(values) == (7, 20)
    assert prefix_cache_counters({}) is None


def test_engine_time_from_counters():
    before = {"hyla_num_steps": 10, "hyla_engine_step_seconds": 1.0, "hyla_model_execute_seconds": 0.5}
    after = {"hyla_num_steps": 30, "hyla_engine_step_seconds": 3.0, "hyla_model_execute_seconds": 1.5}
    t = engine_time(before, after, duration=4.0)
    assert t == {"engine_steps": 20, "engine_step_seconds": 2.0, "model_execute_seconds": 1.0,
                 "engine_step_share": 0.5, "model_execute_share": 0.25}
    assert engine_time({}, after, 4.0)["engine_steps"] is None  # a server without them (vLLM)


def test_metrics_on_known_outputs():
    def done(start, ttft, itl, tokens):
        return RequestOutput(prompt_len=10, success=True, start_time=start, ttft=ttft, itl=itl,
                             latency=ttft + sum(itl), output_tokens=tokens)
    outputs = [done(0.0, 0.1, [0.02, 0.04], 3), done(0.5, 0.3, [], 1), RequestOutput(prompt_len=10, error="x")]
    m = compute_metrics(outputs, duration=2.0, percentiles=[50.0, 99.9], slos_ms=parse_goodput(["tpot:25"]))
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 20, 4)
    assert m["mean_tpot_ms"] == pytest.approx(30.0)  # (0.16 - 0.1) / 2; the 1-token request has no TPOT
    assert m["request_goodput"] == pytest.approx(0.5)  # TPOT 30 ms misses 25; a 1-token request counts as 0
    assert m["mean_itl_ms"] == pytest.approx(30.0) and m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["p50_ttft_ms"] == pytest.approx(200.0) and m["p99.9_ttft_ms"] == pytest.approx(299.8)
    assert m["max_concurrent_requests"] == 1 and m["max_output_tokens_per_s"] == 4
    assert m["request_throughput"] == 1.0 and m["total_token_throughput"] == 12.0
