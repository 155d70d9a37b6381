"""Prometheus metrics for `GET /metrics` (prometheus-client, one registry per server).

Two families of names over the same numbers: hyla's own (`hyla_*`), and vLLM's (`vllm:*`, the
names of vllm/v1/metrics/loggers.py, labelled model_name and engine="0" as vLLM labels them), so
that dashboards and autoscalers written for a vLLM server read this one unchanged:

    gauges      vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc
                (KV pages held by running requests / all pages: pages the prefix cache alone
                holds are free to evict, as in vLLM's block pool)
    counters    vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:num_preemptions_total,
                vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total (tokens),
                vllm:request_success_total{finished_reason="stop" | "length" | "abort" | "error"},
                with speculative decoding vllm:spec_decode_num_drafts_total (verify steps that
                drafted), vllm:spec_decode_num_draft_tokens_total,
                vllm:spec_decode_num_accepted_tokens_total
    histograms  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds (and its older
                name vllm:time_per_output_token_seconds: the same observations), one per engine
                output after the first as vLLM observes it, vllm:e2e_request_latency_seconds, and
                per finished request its phases from the engine's timestamps:
                vllm:request_queue_time_seconds (added -> first scheduled),
                vllm:request_prefill_time_seconds (-> first token),
                vllm:request_decode_time_seconds (first -> last token),
                vllm:request_inference_time_seconds (first scheduled -> last token)

Engine counters and pool gauges are read from `LLMEngine.get_metrics()` at scrape time (a
collector), so they can never drift from the engine; latency histograms and the finish reasons
are observed by the server as outputs stream out of the engine loop (an aborted or failed
request's count is the engine's).
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
    "num_steps": "Engine steps run",
    "engine_step_seconds": "Wall seconds spent inside engine steps (scheduling, host work and device waits)",
    "model_execute_seconds": "Device seconds of the model's step executions (CUDA events on a GPU, wall time "
                             "on the CPU; speculative drafting outside them)",
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
# The prefix cache's tiers: exported name -> (the engine key, help)
_TIER_COUNTERS = {
    "prefix_cache_device_hits": ("hits_device", "Prefix-cache hits served from device memory alone (requests)"),
    "prefix_cache_host_hits": ("hits_host", "Prefix-cache hits that read pages or a checkpoint from the host tier "
                               "(requests)"),
    "prefix_cache_host_hit_tokens": ("hit_tokens_host", "Prompt tokens of hits that read the host tier"),
    "prefix_cache_bytes_to_host": ("bytes_to_host", "Bytes the prefix cache copied to the host tier"),
    "prefix_cache_bytes_from_host": ("bytes_from_host", "Bytes the prefix cache copied back from the host tier"),
    "prefix_cache_restore_seconds": ("restore_seconds", "Seconds the restores from the host tier took where they "
                                     "ran (CUDA events on a GPU, wall time on the CPU)"),
}
_TIER_GAUGES = {
    "prefix_cache_host_pages": ("host_cached_pages", "KV pages held in the host tier"),
    "prefix_cache_host_checkpoints": ("host_cached_checkpoints", "State checkpoints held in the host tier"),
}
# vLLM's names -> (the engine key, vLLM's help text)
_VLLM_GAUGES = {
    "vllm:num_requests_running": ("num_requests_running", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("num_requests_waiting", "Number of requests waiting to be processed."),
}
_VLLM_COUNTERS = {
    "vllm:prompt_tokens": ("prompt_tokens", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("generation_tokens", "Number of generation tokens processed."),
    "vllm:num_preemptions": ("num_preemptions", "Cumulative number of preemption from the engine."),
    "vllm:prefix_cache_queries": ("prefix_cache_query_tokens",
                                  "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("prefix_cache_hit_tokens", "Prefix cache hits, in terms of number of cached tokens."),
}
_VLLM_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": ("spec_num_drafts", "Number of spec decoding drafts."),
    "vllm:spec_decode_num_draft_tokens": ("spec_num_draft_tokens", "Number of draft tokens."),
    "vllm:spec_decode_num_accepted_tokens": ("spec_num_accepted_tokens", "Number of accepted tokens."),
}
FINISHED_REASONS = ("stop", "length", "abort", "error")  # vllm:request_success's label values here
LABELS = ("model_name", "engine")
ENGINE_LABEL = "0"  # one engine per server (vLLM numbers its data-parallel engines)
# vLLM's buckets
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    def __init__(self, engine, model_name: str, finished: dict[str, int]):
        self.engine, self.model_name, self.finished = engine, model_name, finished

    def collect(self):
        m = self.engine.get_metrics()
        m["kv_pages_used"] = m["kv_pages_total"] - m["kv_pages_free"]
        m["state_slots_used"] = m["state_slots_total"] - m["state_slots_free"]
        # Strict: a key the engine no longer reports is an error, never a silent 0.
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"hyla_{name}", doc, value=m[name])
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"hyla_{name}", doc, value=m[name])
        for name, (key, doc) in _TIER_COUNTERS.items():
            yield CounterMetricFamily(f"hyla_{name}", doc, value=m[key])
        for name, (key, doc) in _TIER_GAUGES.items():
            yield GaugeMetricFamily(f"hyla_{name}", doc, value=m[key])
        yield from self._vllm(m)

    def _vllm(self, m: dict):
        labels = [self.model_name, ENGINE_LABEL]

        def family(cls, name: str, doc: str, value, extra: tuple[str, ...] = (), values: tuple[str, ...] = ()):
            f = cls(name, doc, labels=[*LABELS, *extra])
            f.add_metric([*labels, *values], value)
            return f

        for name, (key, doc) in _VLLM_GAUGES.items():
            yield family(GaugeMetricFamily, name, doc, m[key])
        usage = m["kv_pages_running"] / m["kv_pages_total"] if m["kv_pages_total"] else 0.0
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                     usage)
        spec = getattr(self.engine, "spec", None) is not None  # vLLM exports these with speculation only
        for name, (key, doc) in {**_VLLM_COUNTERS, **(_VLLM_SPEC_COUNTERS if spec else {})}.items():
            yield family(CounterMetricFamily, name, doc, m[key])
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*LABELS, "finished_reason"])
        counts = {**self.finished, "abort": m["num_requests_aborted"], "error": m["num_requests_failed"]}
        for reason in FINISHED_REASONS:
            success.add_metric([*labels, reason], counts[reason])
        yield success


class ServerMetrics:
    """The server's registry. model_name: the served name (vLLM's model_name label)."""

    def __init__(self, engine, model_name: str = "hyla"):
        self.registry = CollectorRegistry()
        self._finished = {"stop": 0, "length": 0}  # observed here; abort / error are the engine's counts
        self.registry.register(_EngineCollector(engine, model_name, self._finished))
        self.ttft = Histogram("hyla_time_to_first_token_seconds", "Time from arrival to the first token",
                              registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("hyla_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             registry=self.registry,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        labels = (model_name, ENGINE_LABEL)

        def vllm_histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets).labels(*labels)

        self.vllm_ttft = vllm_histogram("vllm:time_to_first_token_seconds",
                                        "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.vllm_itl = [vllm_histogram("vllm:inter_token_latency_seconds",
                                        "Histogram of inter-token latency in seconds.", _ITL_BUCKETS),
                         vllm_histogram("vllm:time_per_output_token_seconds",
                                        "Histogram of time per output token in seconds (the older name of "
                                        "vllm:inter_token_latency_seconds).", _ITL_BUCKETS)]
        self.vllm_e2e = vllm_histogram("vllm:e2e_request_latency_seconds",
                                       "Histogram of e2e request latency in seconds.", _E2E_BUCKETS)
        # a finished request's phases from the engine's timestamps (RequestOutput.metrics), as vLLM splits them
        self.vllm_phases = {
            name: vllm_histogram(f"vllm:request_{name}_time_seconds", doc, _E2E_BUCKETS) for name, doc in (
                ("queue", "Histogram of time spent in WAITING phase for request."),
                ("prefill", "Histogram of time spent in PREFILL phase for request."),
                ("decode", "Histogram of time spent in DECODE phase for request."),
                ("inference", "Histogram of time spent in RUNNING phase for request."))}
        self._arrival: dict[str, float] = {}
        self._last: dict[str, tuple[float, int]] = {}

    def arrived(self, request_id: str) -> None:
        self._arrival[request_id] = time.monotonic()

    def observe(self, output, now: float) -> None:
        """Called in the engine loop for every output: first token -> TTFT, later ones -> ITL
        (hyla's per token, vLLM's per output), the finished ones -> e2e latency and their
        finish reason."""
        rid = output.request_id
        n = len(output.outputs[0].token_ids) if output.outputs else 0
        last = self._last.get(rid)
        start = self._arrival.get(rid)
        if last is None and n:
            if start is not None:
                self.ttft.observe(now - start)
                self.vllm_ttft.observe(now - start)
        elif last is not None and n > last[1]:
            self.itl.observe((now - last[0]) / (n - last[1]))
            for histogram in self.vllm_itl:
                histogram.observe(now - last[0])
        if output.finished:
            self._last.pop(rid, None)
            self._arrival.pop(rid, None)
            if start is not None:
                self.vllm_e2e.observe(now - start)
            self._observe_phases(output.metrics)
            reason = output.outputs[0].finish_reason if output.outputs else None
            if not output.error and reason in self._finished:
                self._finished[reason] += 1
        elif n:
            self._last[rid] = (now, n)

    def _observe_phases(self, times) -> None:
        """queue: added to the engine -> first scheduled; prefill: -> first token; decode: first ->
        last token; inference: first scheduled -> last token (a phase not reached is not observed)."""
        if times is None or times.first_scheduled_time is None:
            return
        self.vllm_phases["queue"].observe(times.first_scheduled_time - times.arrival_time)
        if times.first_token_time is not None:
            self.vllm_phases["prefill"].observe(times.first_token_time - times.first_scheduled_time)
            self.vllm_phases["decode"].observe(times.last_token_time - times.first_token_time)
            self.vllm_phases["inference"].observe(times.last_token_time - times.first_scheduled_time)

    def forget(self, request_id: str) -> None:
        """A request ended without a finished output (aborted): drop what was kept for it."""
        self._arrival.pop(request_id, None)
        self._last.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
