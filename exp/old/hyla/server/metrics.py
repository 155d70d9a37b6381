"""Prometheus metrics for `GET /metrics` (prometheus-client, one registry per server).

Engine counters and pool gauges are read from `LLMEngine.get_metrics()` at scrape time (a
collector), so they can never drift from the engine; latency histograms are observed by the
server as outputs stream out of the engine loop.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_COUNTERS = {
    "prompt_tokens": "Prompt tokens processed",
    "generation_tokens": "Tokens generated",
    "num_requests_finished": "Requests finished",
    "num_requests_aborted": "Requests aborted (client gone or cancelled)",
    "prefix_cache_query_tokens": "Prompt tokens looked up in the prefix cache",
    "prefix_cache_hit_tokens": "Prompt tokens served from the prefix cache",
    "spec_num_draft_tokens": "Speculative tokens drafted",
    "spec_num_accepted_tokens": "Speculative tokens accepted",
    "num_preemptions": "Requests preempted for recomputation",
}
_GAUGES = {
    "num_requests_running": "Requests running",
    "num_requests_waiting": "Requests waiting",
    "kv_pages_total": "KV cache pages in the pool",
    "kv_pages_used": "KV cache pages in use (running requests and the prefix cache)",
    "kv_pages_running": "KV cache pages held by running requests",
    "state_slots_total": "Recurrent state slots in the pool",
    "state_slots_used": "Recurrent state slots in use (running requests and prefix-cache checkpoints)",
    "state_slots_running": "Recurrent state slots held by running requests",
    "cached_pages": "KV pages held by the prefix cache",
    "cached_checkpoints": "State checkpoints held by the prefix cache",
}


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        m = self.engine.get_metrics()
        m["kv_pages_used"] = m["kv_pages_total"] - m["kv_pages_free"]
        m["state_slots_used"] = m["state_slots_total"] - m["state_slots_free"]
        # Strict: a key the engine no longer reports is an error, never a silent 0.
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"hyla_{name}", doc, value=m[name])
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"hyla_{name}", doc, value=m[name])


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("hyla_time_to_first_token_seconds", "Time from arrival to the first token",
                              registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("hyla_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             registry=self.registry,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self._arrival: dict[str, float] = {}
        self._last: dict[str, tuple[float, int]] = {}

    def arrived(self, request_id: str) -> None:
        self._arrival[request_id] = time.monotonic()

    def observe(self, output, now: float) -> None:
        """Called in the engine loop for every output: first token -> TTFT, later ones -> ITL."""
        rid = output.request_id
        n = len(output.outputs[0].token_ids) if output.outputs else 0
        last = self._last.get(rid)
        if last is None and n:
            start = self._arrival.pop(rid, None)
            if start is not None:
                self.ttft.observe(now - start)
        elif last is not None and n > last[1]:
            self.itl.observe((now - last[0]) / (n - last[1]))
        if output.finished:
            self._last.pop(rid, None)
            self._arrival.pop(rid, None)
        elif n:
            self._last[rid] = (now, n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
