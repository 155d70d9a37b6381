"""RequestOutput.metrics: each finished request's engine timestamps (vLLM's RequestMetrics fields),
what the server's vllm:request_{queue,prefill,decode,inference}_time_seconds histograms read."""

import torch

from hyla import SamplingParams
from hyla.engine import EngineConfig, LLMEngine
from tests.oracles.kimi_checkpoint import kimi_checkpoint  # noqa: F401  (session fixture)


def test_finished_outputs_carry_ordered_timestamps(kimi_checkpoint):
    """Three requests through a one-request engine: the second and third wait in the queue while
    the first runs; every finished output's times are ordered, running ones carry none, and the
    queue time of a request that waited covers the run before it."""
    engine = LLMEngine(EngineConfig(model=str(kimi_checkpoint("moe")), dtype="float32", max_num_seqs=1))
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=torch.randint(3, 250, (9,), generator=gen).tolist())
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.metrics
            else:
                assert out.metrics is None
    assert sorted(finished) == ["r0", "r1", "r2"]
    for m in finished.values():
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    # one request at a time: r1 was first scheduled after r0 produced its last token
    assert finished["r1"].first_scheduled_time >= finished["r0"].last_token_time
    assert finished["r2"].first_scheduled_time >= finished["r1"].last_token_time
