"""`hyla bench serve`: the flags (vLLM's names where vLLM has them) and the run.

    hyla bench serve [--base-url URL | --host H --port P] [--model NAME] [--backend openai|openai-chat]
        [--ready-check-timeout-sec S] [--request-id-prefix P]
        [--dataset-name random|sharegpt|prefix|agent] [--num-prompts N]
        [--tool-latency-ms MEAN [--tool-latency-dist fixed|exponential]]
        [--request-rate R | --ramp-up-strategy linear|exponential --ramp-up-start-rps R0 --ramp-up-end-rps R1]
        [--burstiness B] [--max-concurrency C] [--num-warmups N] [--logprobs N]
        [--goodput ttft:MS ...] [--save-result] [--plot DIR] ...

The run: wait for the server to answer GET /v1/models when --ready-check-timeout-sec is set; ask
/v1/models for the model when --model is omitted; find a tokenizer (hyla.bench.serve.tokens);
build the requests (hyla.bench.serve.datasets); send the --num-warmups warm-up requests (copies of
the first, measured nowhere); read the prefix-cache counters of /metrics; send everything
(hyla.bench.serve.load); read the counters again; print and return the result
(hyla.bench.serve.report), save it and draw it when asked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import sys
import time

import httpx
import numpy as np

from hyla.bench.serve.client import OpenAIClient
from hyla.cli import finite_non_negative
from hyla.bench.serve.datasets import DATASETS, Conversation, DatasetSpec, build_workload, check_range_ratio
from hyla.bench.serve.load import (
    RAMP_UP_STRATEGIES, TOOL_LATENCY_DISTS, arrival_times, ramp_arrival_times, run_workload, tool_latencies, warm_up,
)
from hyla.bench.serve.metrics import PERCENTILE_METRICS, compute_metrics, parse_goodput, usage_prefix_cache
from hyla.bench.serve.report import (
    keep_selected_percentiles, now_stamp, per_request_lists, prefix_cache_fields, print_report, rate_value,
    result_filename, save_result,
)
from hyla.bench.serve.server_metrics import engine_time, prefix_cache_counters, scrape
from hyla.bench.serve.tokens import find_tokenizer

BACKEND_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
DATASET_ALIASES = {"prefix_repetition": "prefix"}  # vLLM's name of the shared-prefix dataset
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty")


class FlagError(Exception):
    """Flags (or the files they name) the benchmark cannot run with; main() reports it as argparse does."""


class ServerError(Exception):
    """A server not worth measuring (not ready in time, every warm-up failed); main() exits with it."""


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


_milliseconds = finite_non_negative("milliseconds")


def _rps(text: str) -> float:
    """A ramp's rate: a number, an integral one as an int (vLLM's rates are, and they name the
    result file)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    return int(value) if value.is_integer() else value


def _key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    pairs = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        pairs[key.strip()] = value.strip()
    return pairs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyla bench serve", description="Load an OpenAI-compatible server "
                                "(hyla serve, vllm serve, ...) and report TTFT, TPOT, ITL, E2EL and throughput.")
    server = p.add_argument_group("server")
    server.add_argument("--backend", choices=list(BACKEND_ENDPOINTS), default=None,
                        help="openai: /v1/completions; openai-chat: /v1/chat/completions (default: from "
                        "--endpoint, else openai, or openai-chat for the agent dataset)")
    server.add_argument("--endpoint", default=None, help="the API path (default: the backend's)")
    server.add_argument("--base-url", default=None, help="the server's URL, instead of --host and --port")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--model", default=None, help="the model (default: the first of the server's /v1/models)")
    server.add_argument("--served-model-name", default=None,
                        help="the name requests carry, when it differs from --model")
    server.add_argument("--api-key", default=None, help="Bearer key (default: $OPENAI_API_KEY)")
    server.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra HTTP headers on every request")
    server.add_argument("--tokenizer", default=None, help="checkpoint directory, bundled model or Hub id whose "
                        "tokenizer writes the prompts (default: the served model's when found locally, else "
                        "the server's /tokenize, else token-id prompts)")
    server.add_argument("--skip-tokenizer-init", action="store_true",
                        help="use no tokenizer: token-id prompts (words for chat)")
    server.add_argument("--ready-check-timeout-sec", type=_count(0), default=0, metavar="S",
                        help="first wait up to S seconds for GET /v1/models to answer 200 (0: do not wait)")
    server.add_argument("--request-id-prefix", default=None, metavar="P",
                        help="requests carry x-request-id: P<i>, warm-ups Pwarmup-<j> (default P: bench-<8 random "
                        "hex digits>-)")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=[*DATASETS, *DATASET_ALIASES])
    data.add_argument("--dataset-path", default=None, help="the sharegpt dataset's JSON file")
    data.add_argument("--num-prompts", type=_count(1), default=None,
                      help="requests to send (default 1000; agent: --num-sessions x --turns)")
    data.add_argument("--seed", type=_count(0), default=0)
    data.add_argument("--disable-shuffle", action="store_true", help="keep the dataset's order")
    data.add_argument("--no-oversample", action="store_true",
                      help="sharegpt: send fewer requests when the file has fewer usable samples")
    data.add_argument("--input-len", type=_count(1), default=None, help="sets --random-input-len")
    data.add_argument("--output-len", type=_count(1), default=None, help="sets every dataset's output length")
    data.add_argument("--random-input-len", type=_count(1), default=1024)
    data.add_argument("--random-output-len", type=_count(1), default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths drawn from [len (1 - r), len (1 + r)], r in [0, 1)")
    data.add_argument("--random-prefix-len", type=_count(0), default=0, help="a random prefix every prompt shares")
    data.add_argument("--sharegpt-output-len", type=_count(1), default=None,
                      help="output length of every request instead of the reply's")
    data.add_argument("--prefix-len", "--prefix-repetition-prefix-len", dest="prefix_len", type=_count(1),
                      default=256, help="prefix: tokens of each shared prefix (a chat request's system message)")
    data.add_argument("--suffix-len", "--prefix-repetition-suffix-len", dest="suffix_len", type=_count(1),
                      default=256, help="prefix: tokens of each request's own question")
    data.add_argument("--num-prefixes", "--prefix-repetition-num-prefixes", dest="num_prefixes", type=_count(1),
                      default=10, help="prefix: distinct shared prefixes")
    data.add_argument("--prefix-output-len", "--prefix-repetition-output-len", dest="prefix_output_len",
                      type=_count(1), default=128)
    data.add_argument("--num-sessions", type=_count(1), default=8, help="agent: concurrent sessions")
    data.add_argument("--turns", type=_count(1), default=5, help="agent: turns per session")
    data.add_argument("--tool-output-len", type=_count(1), default=256, help="agent: tokens of each tool output")
    data.add_argument("--question-len", type=_count(1), default=32, help="agent: tokens of each new question")
    data.add_argument("--agent-output-len", type=_count(1), default=64, help="agent: max tokens of each reply")
    data.add_argument("--agent-range-ratio", type=float, default=0.0,
                      help="agent: each turn's tool output, question and reply lengths drawn uniformly within "
                      "this ratio of their flags' (as --random-range-ratio; 0: equal turns, so sessions that "
                      "start together stay in step)")
    data.add_argument("--agent-system-len", type=_count(0), default=0,
                      help="agent: tokens of the system message every session shares (instructions, tool "
                      "definitions; vLLM multi-turn's common_prefix_num_tokens)")
    data.add_argument("--agent-session-prefix-len", type=_count(0), default=0,
                      help="agent: tokens of each session's own system text after the shared one (its task; "
                      "vLLM multi-turn's prefix_num_tokens), within --agent-range-ratio")
    data.add_argument("--tool-latency-ms", type=_milliseconds, default=0.0, metavar="MEAN",
                      help="agent: mean pause in ms before each turn after a session's first, as if a tool ran "
                      "between the reply and the next turn (in the duration, in no request's TTFT or E2EL; "
                      "0: the next turn goes at once)")
    data.add_argument("--tool-latency-dist", choices=TOOL_LATENCY_DISTS, default="exponential",
                      help="agent: fixed pauses of --tool-latency-ms, or exponential ones of that mean drawn from "
                      "--seed")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests (agent: sessions) per second; inf sends all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps between arrivals: 1 Poisson, < 1 burstier, > 1 more even")
    load.add_argument("--ramp-up-strategy", choices=RAMP_UP_STRATEGIES, default=None,
                      help="instead of --request-rate: the rate moves from --ramp-up-start-rps (the first request) "
                      "to --ramp-up-end-rps (the last)")
    load.add_argument("--ramp-up-start-rps", type=_rps, default=None, metavar="R0")
    load.add_argument("--ramp-up-end-rps", type=_rps, default=None, metavar="R1")
    load.add_argument("--max-concurrency", type=_count(1), default=None, help="requests in flight at most")
    load.add_argument("--num-warmups", type=_count(0), default=0, metavar="N",
                      help="first send N copies of the first request, measured nowhere")
    load.add_argument("--ignore-eos", action="store_true", help="generate every requested token (always on "
                      "with the random dataset, as in vLLM)")
    for flag in SAMPLING_FLAGS:
        load.add_argument(f"--{flag.replace('_', '-')}", type=int if flag == "top_k" else float, default=None,
                          help="sent with every request when set")
    load.add_argument("--logprobs", type=_count(0), default=None, metavar="N",
                      help="ask for N log probabilities per token (chat: logprobs true, top_logprobs N)")
    load.add_argument("--extra-body", type=json.loads, default=None, help="JSON object merged into every request")
    load.add_argument("--disable-tqdm", action="store_true")

    out = p.add_argument_group("results")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                     help=f"comma-separated, of {','.join(PERCENTILE_METRICS)}")
    out.add_argument("--metric-percentiles", default="99", help='comma-separated percentiles, e.g. "50,90,99"')
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help="SLOs of a good request: ttft, tpot, e2el in milliseconds")
    out.add_argument("--save-result", action="store_true", help="write the result JSON")
    out.add_argument("--save-detailed", action="store_true", help="with the per-request lists")
    out.add_argument("--result-dir", default=None)
    out.add_argument("--result-filename", default=None)
    out.add_argument("--label", default=None, help="the result's label (default: the backend)")
    out.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="stored in the result JSON")
    out.add_argument("--plot", default=None, metavar="DIR", help="draw the latency figures (PNG) into DIR")
    return p


def resolve_args(args: argparse.Namespace) -> None:
    """Check the flags and fill in what they imply. Raises ValueError naming the problem."""
    args.dataset_name = DATASET_ALIASES.get(args.dataset_name, args.dataset_name)
    if args.request_rate <= 0 or math.isnan(args.request_rate):
        raise ValueError(f"--request-rate must be positive (inf: all at once), got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {args.burstiness}")
    _check_ramp(args)
    check_range_ratio("--random-range-ratio", args.random_range_ratio)
    check_range_ratio("--agent-range-ratio", args.agent_range_ratio)
    if args.agent_range_ratio and args.dataset_name != "agent":
        raise ValueError(f"--agent-range-ratio sets the agent dataset's turn lengths, not the "
                         f"{args.dataset_name} dataset's (use --random-range-ratio for random prompts)")
    if args.dataset_name == "sharegpt" and args.dataset_path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    if args.dataset_name != "sharegpt" and args.dataset_path is not None:
        raise ValueError(f"--dataset-path is for the sharegpt dataset, not {args.dataset_name!r}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")

    if args.endpoint is not None and not args.endpoint.startswith("/"):
        raise ValueError(f"--endpoint must be a path starting with /, got {args.endpoint!r}")
    if args.backend is None:
        if args.endpoint is not None:
            args.backend = "openai-chat" if args.endpoint.endswith("chat/completions") else "openai"
        else:
            args.backend = "openai-chat" if args.dataset_name == "agent" else "openai"
    args.endpoint = args.endpoint or BACKEND_ENDPOINTS[args.backend]
    chat = args.backend == "openai-chat"
    if chat != args.endpoint.endswith("chat/completions") or not args.endpoint.endswith("completions"):
        raise ValueError(f"--backend {args.backend} sends {'chat ' if chat else ''}completion requests; "
                         f"--endpoint {args.endpoint} does not take them")
    if args.dataset_name == "agent" and not chat:
        raise ValueError("the agent dataset sends chat requests: use --backend openai-chat "
                         "(--endpoint /v1/chat/completions)")

    if args.dataset_name == "agent":
        sessions = args.num_sessions * args.turns
        if args.num_prompts is not None and args.num_prompts != sessions:
            raise ValueError(f"the agent dataset sends --num-sessions x --turns = {sessions} requests; "
                             f"--num-prompts {args.num_prompts} disagrees (leave it out)")
        args.num_prompts = sessions
    elif args.num_prompts is None:
        args.num_prompts = 1000
    if args.tool_latency_ms and args.dataset_name != "agent":
        raise ValueError(f"--tool-latency-ms is the pause between an agent session's turns; the "
                         f"{args.dataset_name} dataset sends one request per conversation (use --dataset-name agent "
                         "or leave it out)")
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        for name in ("random_output_len", "sharegpt_output_len", "prefix_output_len", "agent_output_len"):
            setattr(args, name, args.output_len)
    if args.dataset_name == "random":  # as vLLM: random prompts run to their full output length
        args.ignore_eos = True

    args.selected_metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in args.selected_metrics if m not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {','.join(PERCENTILE_METRICS)}")
    try:
        args.percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: expected numbers, e.g. 50,90,99") from None
    if not args.percentiles or not all(0 <= p <= 100 for p in args.percentiles):
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: each must be in [0, 100]")
    args.slos = parse_goodput(args.goodput or [])
    args.headers = _key_values(args.header, "--header")
    args.metadata_pairs = _key_values(args.metadata, "--metadata")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        args.headers.setdefault("Authorization", f"Bearer {api_key}")
    args.base_url = (args.base_url or f"http://{_host(args.host)}:{args.port}").rstrip("/")
    if args.request_id_prefix is None:  # vLLM's default: a run of its own, told apart in the server's logs
        args.request_id_prefix = f"bench-{secrets.token_hex(4)}-"
    if not (args.request_id_prefix.isascii() and args.request_id_prefix.isprintable()):
        raise ValueError(f"--request-id-prefix {args.request_id_prefix!r}: it goes into the x-request-id header, "
                         "so printable ASCII only")


def _check_ramp(args: argparse.Namespace) -> None:
    """vLLM's rules for --ramp-up-*: all three or none, and the ramp, not --request-rate, sets the rate."""
    rates = (args.ramp_up_start_rps, args.ramp_up_end_rps)
    if args.ramp_up_strategy is None:
        if rates != (None, None):
            raise ValueError("--ramp-up-start-rps and --ramp-up-end-rps need --ramp-up-strategy linear|exponential")
        return
    if None in rates:
        raise ValueError(f"--ramp-up-strategy {args.ramp_up_strategy} needs both --ramp-up-start-rps and "
                         "--ramp-up-end-rps")
    if not math.isinf(args.request_rate):
        raise ValueError(f"--request-rate {args.request_rate} with --ramp-up-strategy: leave --request-rate out "
                         "(inf), the ramp sets the rate")
    if not all(0 < r < math.inf for r in rates):
        raise ValueError(f"--ramp-up-start-rps and --ramp-up-end-rps must be positive and finite (a rate of 0 "
                         f"sends nothing), got {rates[0]} and {rates[1]}")
    if rates[0] > rates[1]:
        raise ValueError(f"--ramp-up-start-rps {rates[0]} must not exceed --ramp-up-end-rps {rates[1]}")


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(
        name=args.dataset_name, num_prompts=args.num_prompts, seed=args.seed, shuffle=not args.disable_shuffle,
        oversample=not args.no_oversample, path=args.dataset_path, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len, sharegpt_output_len=args.sharegpt_output_len,
        prefix_len=args.prefix_len, suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
        prefix_output_len=args.prefix_output_len, num_sessions=args.num_sessions, turns=args.turns,
        tool_output_len=args.tool_output_len, question_len=args.question_len,
        agent_output_len=args.agent_output_len, agent_range_ratio=args.agent_range_ratio,
        agent_system_len=args.agent_system_len, agent_session_prefix_len=args.agent_session_prefix_len)


def served_model(http: httpx.Client, base_url: str) -> tuple[str, str | None]:
    """(the first model's id, its `root` when the server reports one) from GET /v1/models."""
    response = http.get(base_url + "/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return models[0]["id"], models[0].get("root")


def wait_until_ready(http: httpx.Client, base_url: str, timeout_s: float, interval_s: float = 1.0) -> None:
    """Poll GET /v1/models every interval_s until it answers 200: a server still loading its
    model refuses connections or answers an error, and measuring it then would record failures.
    Raises ServerError once timeout_s have passed."""
    url = base_url + "/v1/models"
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            response = http.get(url, timeout=max(0.5, min(10.0, left)))
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServerError(f"{url} did not answer 200 within --ready-check-timeout-sec {timeout_s} s "
                              f"(last: {last})")
        time.sleep(min(interval_s, left))


def _arrivals(args: argparse.Namespace, n: int) -> list[float]:
    """The n conversations' arrival times: a ramp when --ramp-up-strategy is set, else --request-rate."""
    rng = np.random.default_rng(args.seed)
    if args.ramp_up_strategy is not None:
        return ramp_arrival_times(n, args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps,
                                  args.burstiness, rng)
    return arrival_times(n, args.request_rate, args.burstiness, rng)


def _pauses(args: argparse.Namespace, conversations: list[Conversation]) -> list[list[float]] | None:
    """The pauses before each turn (--tool-latency-ms, drawn from --seed); None when there are none,
    so that a run without them sends exactly as before."""
    if not args.tool_latency_ms:
        return None
    return tool_latencies([len(c.requests) for c in conversations], args.tool_latency_ms, args.tool_latency_dist,
                          args.seed)


async def _measure(args, conversations, sampling: dict) -> tuple[list, float, dict]:
    """Send the warm-ups, then the workload, over one connection pool; returns (outputs, duration,
    prefix-cache and engine-time fields, the clock's origin). The counters are read and the clock
    starts after the warm-ups, so that nothing of them is counted."""
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    timeout = httpx.Timeout(connect=60.0, read=None, write=60.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        client = OpenAIClient(http, args.base_url + args.endpoint, args.request_model, args.backend == "openai-chat",
                              args.ignore_eos, sampling, args.headers, args.logprobs)
        if args.num_warmups:
            warmups = await warm_up(client, conversations[0].requests[0], args.num_warmups, args.max_concurrency,
                                    args.request_id_prefix)
            errors = [o.error for o in warmups if not o.success]
            print(f"warm-up: {len(warmups)} requests, {len(errors)} failed")
            if len(errors) == len(warmups):
                raise ServerError(f"every warm-up request to {client.api_url} failed, the first with: {errors[0]}")
        before = await scrape(http, args.base_url, args.headers)
        arrivals = _arrivals(args, len(conversations))
        pauses = _pauses(args, conversations)
        total = sum(len(c.requests) for c in conversations)
        origin = time.perf_counter()
        with tqdm(total=total, disable=args.disable_tqdm, desc="requests") as bar:
            outputs, duration = await run_workload(client, conversations, arrivals, args.max_concurrency, bar,
                                                   args.request_id_prefix, pauses, origin)
        after = await scrape(http, args.base_url, args.headers)
    from_usage = usage_prefix_cache(outputs)
    counters = prefix_cache_counters(before), prefix_cache_counters(after)
    if from_usage is not None:
        cache = prefix_cache_fields("usage", *from_usage)
    elif None not in counters:
        cache = prefix_cache_fields("metrics", counters[1][0] - counters[0][0], counters[1][1] - counters[0][1])
    else:
        cache = prefix_cache_fields(None, None, None)
    # the start times' zero on time.perf_counter()'s clock (system-wide on Linux): a server's step
    # log on the same machine has its own (hyla.engine.step_log), so that the two can be joined
    return outputs, duration, {**cache, **engine_time(before, after, duration), "clock_origin_s": origin}


def run(args: argparse.Namespace) -> dict:
    """Run a benchmark with resolved flags; returns the whole result (per-request lists included)."""
    with httpx.Client(headers=args.headers, timeout=60.0) as http:
        if args.ready_check_timeout_sec:
            wait_until_ready(http, args.base_url, args.ready_check_timeout_sec)
        try:
            if args.model is None:
                model, root = served_model(http, args.base_url)
            else:
                model, root = args.model, None
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:
            raise SystemExit(f"hyla bench serve: cannot read the model from {args.base_url}/v1/models: {e}") from None
        args.request_model = args.served_model_name or model
        model_id = args.model or root or model
        try:
            tokenizer = None if args.skip_tokenizer_init else find_tokenizer(http, args.base_url, args.request_model,
                                                                              model_id, args.tokenizer)
            conversations = build_workload(dataset_spec(args), tokenizer, chat=args.backend == "openai-chat")
        except ValueError as e:  # flags or files the dataset cannot be built from
            raise FlagError(str(e)) from None
    ramp = (args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps)
    rate = (f"ramp-up {ramp[0]} {ramp[1]} -> {ramp[2]} rps" if args.ramp_up_strategy is not None
            else f"rate {args.request_rate}")
    tools = (f", tool latency {args.tool_latency_dist} {args.tool_latency_ms:g} ms between turns"
             if args.tool_latency_ms else "")
    tools += f", turn lengths within {args.agent_range_ratio:g} of their flags'" if args.agent_range_ratio else ""
    print(f"model {args.request_model} at {args.base_url}{args.endpoint}; dataset {args.dataset_name}; "
          f"tokenizer {tokenizer.name if tokenizer else 'none (token ids or words)'}; "
          f"{sum(len(c.requests) for c in conversations)} requests, {rate}, "
          f"burstiness {args.burstiness}, max concurrency {args.max_concurrency}{tools}")

    sampling = {f: getattr(args, f) for f in SAMPLING_FLAGS if getattr(args, f) is not None}
    sampling.update(args.extra_body or {})
    outputs, duration, cache = asyncio.run(_measure(args, conversations, sampling))

    date = now_stamp()
    result = {"date": date, "endpoint_type": args.backend, "backend": args.backend, "label": args.label,
              "model_id": model_id, "tokenizer_id": tokenizer.name if tokenizer else None,
              "num_prompts": len(outputs), "dataset_name": args.dataset_name,
              "tool_latency_ms": args.tool_latency_ms, "tool_latency_dist": args.tool_latency_dist,
              "agent_range_ratio": args.agent_range_ratio,
              **args.metadata_pairs,
              "request_rate": rate_value(args.request_rate), "burstiness": rate_value(args.burstiness),
              "ramp_up_strategy": ramp[0], "ramp_up_start_rps": ramp[1], "ramp_up_end_rps": ramp[2],
              "max_concurrency": args.max_concurrency, "duration": duration}
    metrics = compute_metrics(outputs, duration, args.percentiles, args.slos)
    result.update(keep_selected_percentiles(metrics, args.selected_metrics, args.percentiles))
    result.update(per_request_lists(outputs))
    result.update(cache)
    print_report(result, args.selected_metrics, args.percentiles)

    if args.save_result:
        path = result_filename(args.label or args.backend, args.request_rate, args.max_concurrency, model_id, date,
                               args.result_filename, args.result_dir, ramp if ramp[0] is not None else None)
        print(f"result: {save_result(result, path, args.save_detailed)}")
    if args.plot:
        from hyla.bench.serve.plots import render_serve_plots

        for name, path in render_serve_plots(result, args.plot).items():
            print(f"{name}: {path}")
    return result


def main(argv: list[str] | None = None) -> dict:
    """`hyla bench serve ARGS`: run, print, and return the result (see `run`)."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        resolve_args(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        return run(args)
    except FlagError as e:
        parser.error(str(e))
    except ServerError as e:
        raise SystemExit(f"hyla bench serve: {e}") from None
