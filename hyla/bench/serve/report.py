"""The run's result: the JSON document (vLLM's keys) and the printed table (vLLM's layout)."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

from hyla.bench.serve.client import RequestOutput
from hyla.bench.serve.metrics import PERCENTILE_METRICS, percentile_word

# Per-request lists vLLM drops from the saved result unless --save-detailed (it keeps latencies
# and queue_times), and hyla's additions.
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors",
                 "cached_tokens", "response_ids")
METRIC_TITLES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                 "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def per_request_lists(outputs: list[RequestOutput]) -> dict:
    """The per-request lists, in request order (a failure: its error, zeros elsewhere)."""
    return {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "queue_times": [o.queue_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "cached_tokens": [o.cached_tokens for o in outputs],
        "turns": [o.turn for o in outputs],
        "response_ids": [o.response_id for o in outputs],
    }


def prefix_cache_fields(source: str | None, hits: float | None, queries: float | None) -> dict:
    """prefix_cache_hit_rate (hit / query tokens; 0.0 when nothing was looked up, None when the
    server reports neither usage cached_tokens nor known /metrics counters) and where it came from."""
    if source is None:
        return {"prefix_cache_hit_rate": None, "prefix_cache_hit_tokens": None,
                "prefix_cache_query_tokens": None, "prefix_cache_source": None}
    return {"prefix_cache_hit_rate": hits / queries if queries else 0.0, "prefix_cache_hit_tokens": int(hits),
            "prefix_cache_query_tokens": int(queries), "prefix_cache_source": source}


def keep_selected_percentiles(metrics: dict, selected: list[str], percentiles: list[float]) -> dict:
    """Drop the percentile keys of the metrics not in --percentile-metrics."""
    dropped = {f"p{percentile_word(p)}_{m}_ms" for m in PERCENTILE_METRICS if m not in selected for p in percentiles}
    return {k: v for k, v in metrics.items() if k not in dropped}


def result_filename(label: str, request_rate: float, max_concurrency: int | None, model_id: str,
                    date: str, filename: str | None, result_dir: str | None,
                    ramp: tuple[str, float, float] | None = None) -> Path:
    """vLLM's name, {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json, or with ramp
    (strategy, start rps, end rps) {label}-ramp-up-{strategy}-{start}qps-{end}qps[-concurrency{N}]-
    {model}-{date}.json, unless --result-filename; inside --result-dir when given."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    rate = f"ramp-up-{ramp[0]}-{ramp[1]}qps-{ramp[2]}qps" if ramp is not None else f"{request_rate}qps"
    name = filename or f"{label}-{rate}{concurrency}-{model_id.split('/')[-1]}-{date}.json"
    return Path(result_dir) / name if result_dir else Path(name)


def now_stamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def save_result(result: dict, path: Path, detailed: bool) -> Path:
    saved = result if detailed else {k: v for k, v in result.items() if k not in DETAILED_KEYS}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved), encoding="utf-8")
    return path


def _line(name: str, value, fmt: str = "") -> None:
    print(f"{name:<40} {value:{fmt}}")


def print_report(result: dict, selected: list[str], percentiles: list[float]) -> None:
    """Print the result as `vllm bench serve` does (plus the prefix-cache hit rate)."""
    failures = [e for e in result["errors"] if e]
    if failures:
        print(f"Failed requests ({len(failures)}; the first {min(10, len(failures))}):")
        for i, error in enumerate(failures[:10]):
            print(f"  {i}: {error}")
    print(" Serving Benchmark Result ".center(50, "="))
    _line("Successful requests:", result["completed"])
    _line("Failed requests:", result["failed"])
    if result["max_concurrency"] is not None:
        _line("Maximum request concurrency:", result["max_concurrency"])
    if result["request_rate"] != "inf":
        _line("Request rate configured (RPS):", result["request_rate"], ".2f")
    _line("Benchmark duration (s):", result["duration"], ".2f")
    _line("Total input tokens:", result["total_input_tokens"])
    _line("Total generated tokens:", result["total_output_tokens"])
    _line("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result["request_goodput"] is not None:
        _line("Request goodput (req/s):", result["request_goodput"], ".2f")
    _line("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    _line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    _line("Peak concurrent requests:", result["max_concurrent_requests"], ".2f")
    _line("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    if result["prefix_cache_hit_rate"] is not None:
        _line(f"Prefix cache hit rate (%, {result['prefix_cache_source']}):",
              100 * result["prefix_cache_hit_rate"], ".2f")
    if result.get("engine_step_share") is not None:  # a hyla server: where the run's time went
        _line("Engine steps:", result["engine_steps"], "d")
        _line("Engine step time (% of the run):", 100 * result["engine_step_share"], ".2f")
        _line("Model execute time (device, %):", 100 * result["model_execute_share"], ".2f")
    for metric in PERCENTILE_METRICS:
        short, title = METRIC_TITLES[metric]
        print(title.center(50, "-"))
        _line(f"Mean {short} (ms):", result[f"mean_{metric}_ms"], ".2f")
        _line(f"Median {short} (ms):", result[f"median_{metric}_ms"], ".2f")
        if metric == "ttft" and "mean_ttft_returning_ms" in result:  # multi-turn: the turns after the first
            _line("Mean TTFT, returning turns (ms):", result["mean_ttft_returning_ms"], ".2f")
            _line("Median TTFT, returning turns (ms):", result["median_ttft_returning_ms"], ".2f")
        if metric in selected:
            for p in percentiles:
                _line(f"P{percentile_word(p)} {short} (ms):", result[f"p{percentile_word(p)}_{metric}_ms"], ".2f")
    print("=" * 50)


def rate_value(value: float) -> float | str:
    """A request rate or burstiness as the result stores it: "inf" for infinity (not valid JSON)."""
    return "inf" if math.isinf(value) else value
