"""The prefix cache's counters from the server's Prometheus `GET /metrics`, read before and after
a run when the responses' usage does not report cached tokens.

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


async def scrape_prefix_cache(http: httpx.AsyncClient, base_url: str,
                              headers: dict[str, str] | None = None) -> tuple[float, float] | None:
    """The server's prefix-cache counters now, or None when it has no /metrics or no known pair."""
    try:
        response = await http.get(base_url + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return prefix_cache_counters(parse_prometheus(response.text))
