"""Counters from the server's Prometheus `GET /metrics`, read before and after a run: the prefix
cache's (when the responses' usage does not report cached tokens) and, from a hyla server, the
engine's time (`engine_time`: the steps' wall time and the model executions' device time, against
which the run's duration shows what the host, the scheduler and the HTTP server cost).

Known counter pairs (hits, queries), in prompt tokens: hyla's hyla_prefix_cache_hit_tokens /
hyla_prefix_cache_query_tokens, vLLM's vllm:prefix_cache_hits / vllm:prefix_cache_queries (each
exposed with the `_total` suffix of a counter; series of several label sets are summed). The
difference covers every request the server ran meanwhile, also other clients'.
"""

from __future__ import annotations

import httpx

PREFIX_CACHE_COUNTERS = (
    ("hyla_prefix_cache_hit_tokens", "hyla_prefix_cache_query_tokens"),
    ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
)


def _series_end(line: str) -> int:
    """Index just past a sample line's series (its name and {labels}; label values are quoted and
    may hold spaces, braces and escaped quotes), or -1 when the line is malformed."""
    brace, space = line.find("{"), line.find(" ")
    if brace == -1 or (space != -1 and space < brace):
        return space
    quoted = escaped = False
    for i in range(brace, len(line)):
        c = line[i]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            quoted = not quoted
        elif c == "}" and not quoted:
            return i + 1
    return -1


def parse_prometheus(text: str) -> dict[str, float]:
    """{metric name: value summed over its label sets} of a Prometheus text exposition, with a
    counter's `_total` suffix dropped from its name."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        end = _series_end(line) if line and not line.startswith("#") else -1
        if end <= 0:
            continue
        name = line[:end].split("{", 1)[0].removesuffix("_total")
        try:
            value = float(line[end:].split()[0])
        except (ValueError, IndexError):
            continue
        values[name] = values.get(name, 0.0) + value
    return values


def prefix_cache_counters(values: dict[str, float]) -> tuple[float, float] | None:
    """(hit tokens, query tokens) of the first known counter pair present, or None."""
    for hits, queries in PREFIX_CACHE_COUNTERS:
        if hits in values and queries in values:
            return values[hits], values[queries]
    return None


ENGINE_TIME_COUNTERS = ("hyla_num_steps", "hyla_engine_step_seconds", "hyla_model_execute_seconds")


def engine_time(before: dict[str, float], after: dict[str, float], duration: float) -> dict:
    """The run's engine steps, their wall seconds and the model executions' device seconds (the
    counters' differences), each share of the run's duration; None values from a server without
    them (vLLM)."""
    if not all(k in before and k in after for k in ENGINE_TIME_COUNTERS):
        return {"engine_steps": None, "engine_step_seconds": None, "model_execute_seconds": None,
                "engine_step_share": None, "model_execute_share": None}
    steps, step_s, execute_s = (after[k] - before[k] for k in ENGINE_TIME_COUNTERS)
    share = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    return {"engine_steps": int(steps), "engine_step_seconds": step_s, "model_execute_seconds": execute_s,
            "engine_step_share": share(step_s), "model_execute_share": share(execute_s)}


async def scrape(http: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """The server's /metrics now (parse_prometheus), or {} when it has none."""
    try:
        response = await http.get(base_url + "/metrics", headers=headers)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    return parse_prometheus(response.text)
