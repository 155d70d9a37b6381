"""The Prometheus export reads the engine's metric keys strictly: a renamed engine key fails here
instead of exporting 0."""

import pytest

from hyla import LLM
from hyla.server.metrics import _COUNTERS, _GAUGES, _TIER_COUNTERS, _TIER_GAUGES, ServerMetrics
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint

DERIVED = {"kv_pages_used", "state_slots_used"}  # computed by the collector from two engine keys


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_every_exported_metric_is_an_engine_key(tmp_path, prefix_cache):
    llm = LLM(str(build_kimi_checkpoint(tmp_path, "dense")), dtype="float64", max_model_len=64,
              enable_prefix_caching=prefix_cache)
    m = llm.get_metrics()
    missing = [name for name in {**_COUNTERS, **_GAUGES} if name not in m and name not in DERIVED]
    missing += [key for key, _ in {**_TIER_COUNTERS, **_TIER_GAUGES}.values() if key not in m]
    assert not missing, f"exported metrics the engine does not report: {missing}"
    text = ServerMetrics(llm.engine).render().decode()
    assert "hyla_kv_pages_total " in text and "hyla_cached_checkpoints " in text
    assert "hyla_prefix_cache_host_hits_total " in text and "hyla_prefix_cache_host_pages " in text


class _Renamed:
    """An engine whose metrics lost one key (as after a rename)."""

    def __init__(self, real: dict, drop: str):
        self.m = {k: v for k, v in real.items() if k != drop}

    def get_metrics(self):
        return dict(self.m)


def test_a_renamed_engine_key_fails_the_scrape(tmp_path):
    llm = LLM(str(build_kimi_checkpoint(tmp_path, "dense")), dtype="float64", max_model_len=64)
    real = llm.get_metrics()
    ServerMetrics(_Renamed(real, "spec_num_verify_steps")).render()  # not exported: no error
    for name in ("prompt_tokens", "num_requests_waiting"):
        with pytest.raises(KeyError, match=name):
            ServerMetrics(_Renamed(real, name)).render()


def test_step_and_execute_time_are_counted(tmp_path):
    """engine_step_seconds (wall time inside step) and model_execute_seconds (the model's step
    executions: wall time on the CPU, CUDA events on a GPU) grow with the work, the second within
    the first; /metrics exports both with the step count."""
    from hyla import SamplingParams

    llm = LLM(str(build_kimi_checkpoint(tmp_path, "dense")), dtype="float64", max_model_len=64)
    before = llm.get_metrics()
    llm.generate([[5, 6, 7, 8]] * 3, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    m = llm.get_metrics()
    step = m["engine_step_seconds"] - before["engine_step_seconds"]
    execute = m["model_execute_seconds"] - before["model_execute_seconds"]
    assert m["num_steps"] - before["num_steps"] >= 6 and 0 < execute < step
    text = ServerMetrics(llm.engine).render().decode()
    assert "hyla_engine_step_seconds_total " in text and "hyla_model_execute_seconds_total " in text
    assert "hyla_num_steps_total " in text
