"""`/metrics` exports vLLM's metric names (vllm/v1/metrics/loggers.py) beside hyla's, labelled
model_name and engine as vLLM labels them, with the same numbers: what dashboards and autoscalers
written for vLLM read (in-process, a tiny checkpoint drafting for itself)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from hyla import LLM
from hyla.engine.outputs import CompletionOutput, RequestOutput
from hyla.server.api import create_app
from hyla.server.metrics import ServerMetrics
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint

NAME = "tiny-kimi"
LABELS = {"model_name": NAME, "engine": "0"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("prom"), "dense", with_tokenizer=True)


@pytest.fixture(scope="module")
def scraped(model):
    """The samples of a scrape after 3 requests finished by length and 1 by a stop token."""
    # the target drafting for itself: every verify step drafts (and accepts)
    llm = LLM(str(model), dtype="float32", max_model_len=64, enable_prefix_caching=True,
              speculative_config={"method": "draft_model", "model": str(model), "num_speculative_tokens": 2})
    with TestClient(create_app(llm.engine, NAME)) as http:
        for _ in range(3):
            r = http.post("/v1/completions", json={"prompt": "the cat sat on the mat the cat sat on", "max_tokens": 6,
                                                   "temperature": 0, "ignore_eos": True})
            assert r.json()["choices"][0]["finish_reason"] == "length"
        r = http.post("/v1/completions", json={"prompt": "the dog", "max_tokens": 6, "allowed_token_ids": [9],
                                               "stop_token_ids": [9]})
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        text = http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted({**LABELS, **labels}.items())))]


def hyla(samples: dict, name: str) -> float:
    return samples[(name, ())]


def test_vllm_gauges_and_counters_mirror_hylas(scraped):
    for vllm, own in (("vllm:num_requests_running", "hyla_num_requests_running"),
                      ("vllm:num_requests_waiting", "hyla_num_requests_waiting"),
                      ("vllm:prompt_tokens_total", "hyla_prompt_tokens_total"),
                      ("vllm:generation_tokens_total", "hyla_generation_tokens_total"),
                      ("vllm:num_preemptions_total", "hyla_num_preemptions_total"),
                      ("vllm:prefix_cache_queries_total", "hyla_prefix_cache_query_tokens_total"),
                      ("vllm:prefix_cache_hits_total", "hyla_prefix_cache_hit_tokens_total"),
                      ("vllm:spec_decode_num_draft_tokens_total", "hyla_spec_num_draft_tokens_total"),
                      ("vllm:spec_decode_num_accepted_tokens_total", "hyla_spec_num_accepted_tokens_total")):
        assert value(scraped, vllm) == hyla(scraped, own), vllm
    assert value(scraped, "vllm:generation_tokens_total") == 3 * 6 + 1
    assert value(scraped, "vllm:prefix_cache_hits_total") > 0  # the repeated prompt hit
    assert 0 < value(scraped, "vllm:spec_decode_num_drafts_total") <= value(
        scraped, "vllm:spec_decode_num_draft_tokens_total")
    assert value(scraped, "vllm:kv_cache_usage_perc") == 0.0  # nothing runs; cached pages are evictable


def test_request_success_by_finished_reason(scraped):
    counts = {r: value(scraped, "vllm:request_success_total", finished_reason=r)
              for r in ("stop", "length", "abort", "error")}
    assert counts == {"stop": 1, "length": 3, "abort": 0, "error": 0}


def test_latency_histograms(scraped):
    assert value(scraped, "vllm:time_to_first_token_seconds_count") == 4
    assert value(scraped, "vllm:e2e_request_latency_seconds_count") == 4
    steps = value(scraped, "vllm:inter_token_latency_seconds_count")
    assert 0 < steps <= 3 * 5  # one per engine output after the first (speculation emits several tokens)
    assert value(scraped, "vllm:time_per_output_token_seconds_count") == steps
    assert value(scraped, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 4
    # each finished request's phases, from the engine's timestamps
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value(scraped, f"vllm:request_{phase}_time_seconds_count") == 4, phase
    inference = value(scraped, "vllm:request_inference_time_seconds_sum")
    parts = value(scraped, "vllm:request_prefill_time_seconds_sum") + value(scraped, "vllm:request_decode_time_seconds_sum")
    assert inference == pytest.approx(parts) and inference > 0


def test_spec_decode_names_only_with_speculation(model):
    llm = LLM(str(model), dtype="float32", max_model_len=64)
    text = ServerMetrics(llm.engine, NAME).render().decode()
    assert 'vllm:num_requests_running{engine="0",model_name="tiny-kimi"} 0.0' in text
    assert "vllm:spec_decode" not in text and "vllm:prompt_tokens_total" in text


def test_an_aborted_request_leaves_no_latency_state(model):
    """The server forgets a request aborted before it finished (AsyncEngine's on_abort)."""
    llm = LLM(str(model), dtype="float32", max_model_len=64)
    metrics = ServerMetrics(llm.engine, NAME)
    metrics.arrived("r")
    metrics.observe(RequestOutput("r", None, [1], [CompletionOutput(0, "a", [5], None, None)], finished=False), 1.0)
    assert "r" in metrics._arrival and "r" in metrics._last
    metrics.forget("r")
    assert not metrics._arrival and not metrics._last
