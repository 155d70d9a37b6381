"""The figures of a run, as `vllm bench serve` computes and names them.

Over the successful requests: TTFT, TPOT = (E2EL - TTFT) / (output tokens - 1) (requests of more
than one output token), ITL (every gap between token chunks of every request) and E2EL; each with
mean, median, std (numpy's, population) and the chosen percentiles (numpy's linear
interpolation), in milliseconds. Throughputs divide by the run's duration; goodput counts the
requests that meet every SLO given (a request of one output token has TPOT 0 for this).
max_output_tokens_per_s: the most token chunks that arrived within one whole second since the
first request's start; max_concurrent_requests: the most requests in flight at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyla.bench.serve.client import RequestOutput

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class LatencyStats:
    """One metric's summary in milliseconds; percentiles: [(p, value)] in the order asked."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]


def latency_stats(values_s: list[float], percentiles: list[float]) -> LatencyStats:
    """Summary of `values_s` (seconds) in ms; all zeros when there is no value (as vLLM)."""
    v = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    return LatencyStats(float(v.mean()), float(np.median(v)), float(v.std()),
                        [(p, float(np.percentile(v, p))) for p in percentiles])


def request_tpot(out: RequestOutput) -> float:
    """Seconds per output token after the first (0 for a request of one token)."""
    return (out.latency - out.ttft) / (out.output_tokens - 1) if out.output_tokens > 1 else 0.0


def meets_slos(out: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (milliseconds; keys ttft, tpot, e2el)."""
    measured = {"ttft": out.ttft, "tpot": request_tpot(out), "e2el": out.latency}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """`--goodput ttft:200 tpot:50` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds). Raises
    ValueError naming the bad pair."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            limit = float(value)
        except ValueError:
            limit = None
        if not sep or limit is None:
            raise ValueError(f"--goodput {pair!r}: expected KEY:MILLISECONDS, e.g. ttft:200")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: the metric must be one of {', '.join(GOODPUT_METRICS)}")
        if not limit >= 0:
            raise ValueError(f"--goodput {pair!r}: the SLO must be a non-negative number of milliseconds")
        slos[name] = limit
    return slos


def _peaks(done: list[RequestOutput]) -> tuple[float, int]:
    """(the most token chunks in one second bucket, the most requests in flight at once)."""
    if not done:
        return 0.0, 0
    origin = min(o.start_time for o in done)
    end = max(o.start_time + o.latency for o in done)
    buckets = np.zeros(int(np.ceil(end - origin)) + 1)
    for o in done:
        token_times = o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
        np.add.at(buckets, (token_times - origin).astype(np.int64), 1)
    # half-open [start, end): at equal times a departure comes before an arrival
    events = sorted([(o.start_time, 1) for o in done] + [(o.start_time + o.latency, -1) for o in done])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return float(buckets.max()), peak


def compute_metrics(outputs: list[RequestOutput], duration: float, percentiles: list[float],
                    slos_ms: dict[str, float]) -> dict:
    """The result's figures under vLLM's keys: completed, failed, total_input_tokens,
    total_output_tokens, request_throughput, request_goodput (None without SLOs),
    output_throughput, total_token_throughput, max_output_tokens_per_s, max_concurrent_requests,
    and {mean,median,std}_{ttft,tpot,itl,e2el}_ms with p{P}_{metric}_ms for every metric (the CLI
    keeps the percentiles of --percentile-metrics); with multi-turn conversations (the agent
    dataset) also {mean,median}_ttft_returning_ms over the turns after each conversation's first,
    the requests a prefix cache can serve from their own history."""
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    series = {
        "ttft": [o.ttft for o in done],
        "tpot": [request_tpot(o) for o in done if o.output_tokens > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    peak_tokens, peak_requests = _peaks(done)
    result = {
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": sum(meets_slos(o, slos_ms) for o in done) / duration if slos_ms else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    returning = [o.ttft for o in done if o.turn > 0]
    if returning:
        stats = latency_stats(returning, [])
        result["mean_ttft_returning_ms"], result["median_ttft_returning_ms"] = stats.mean, stats.median
    for name, values in series.items():
        stats = latency_stats(values, percentiles)
        result[f"mean_{name}_ms"], result[f"median_{name}_ms"], result[f"std_{name}_ms"] = (
            stats.mean, stats.median, stats.std)
        for p, value in stats.percentiles:
            result[f"p{percentile_word(p)}_{name}_ms"] = value
    return result


def percentile_word(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (vLLM's key spelling)."""
    return str(int(p)) if int(p) == p else str(p)


def usage_prefix_cache(outputs: list[RequestOutput]) -> tuple[int, int] | None:
    """(cached prompt tokens, prompt tokens) over the successful requests whose usage reported
    cached_tokens, or None when none did."""
    reported = [o for o in outputs if o.success and o.cached_tokens is not None]
    if not reported:
        return None
    return sum(o.cached_tokens for o in reported), sum(o.prompt_len for o in reported)
