"""What the pools get and what the startup log says about them: the prefix-cache checkpoint reserve
never caps the running batch, the log states the concurrency the engine really runs; on CUDA the
pools fill gpu_memory_utilization of the device less what is in use and a profiled step."""

from __future__ import annotations

import logging

import pytest
import torch

from hyla.engine import LLM, EngineConfig, SamplingParams
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("memprof"), "moe")


def test_the_checkpoint_reserve_does_not_cap_the_batch_and_the_log_says_so(checkpoint, caplog):
    # 8 requests, prefix caching on: 8 slots for them + 8 for checkpoints are wanted; slots may take
    # half the budget, which holds 10 (25,600 B each), the rest is 16 pages: the engine runs all 8,
    # checkpoints take the slots no request holds
    with caplog.at_level(logging.INFO, logger="hyla.engine"):
        llm = LLM(str(checkpoint), dtype=torch.float64, device="cpu", max_num_seqs=8, max_model_len=64,
                  enable_prefix_caching=True, memory_budget=520_000)
    assert llm.engine.pools.slots.num_slots == 10
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("pools:"))
    assert "up to 8 requests at once (max_num_seqs=8)" in line, line
    assert not any("max_num_seqs=8: the memory holds" in r.getMessage() for r in caplog.records)
    assert llm.engine.scheduler.max_num_seqs == 8
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([[5 + i, 6, 7] for i in range(8)], params)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_too_few_slots_for_max_num_seqs_is_logged_with_the_true_figure(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="hyla.engine"):
        LLM(str(checkpoint), dtype=torch.float64, device="cpu", max_num_seqs=8, max_model_len=64,
            memory_budget=308_200)  # half of it: 6 slots of 25,600 B
    assert any("max_num_seqs=8: the memory holds state slots for 6 running requests" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("value", [0, 1.5, -0.1, "0.9", True])
def test_bad_gpu_memory_utilization_is_a_value_error(checkpoint, value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction in"):
        EngineConfig(model=str(checkpoint), device="cpu", gpu_memory_utilization=value)


def test_expandable_segments_are_asked_for_unless_configured(monkeypatch):
    from hyla.engine import memory_profile

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert not memory_profile.prefer_expandable_segments()  # the user's setting stands
    assert memory_profile.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert memory_profile.prefer_expandable_segments()
    assert memory_profile.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.real_gpu_memory
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pools_fill_the_utilization_less_what_is_in_use(checkpoint):
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    llm = LLM(str(checkpoint), dtype=torch.bfloat16, device="cuda", gpu_memory_utilization=0.3,
              max_model_len=256, enforce_eager=True)
    used = torch.cuda.memory_allocated()
    assert 0.2 * total < used <= 0.3 * total  # the pools took the rest of the 30%, not more
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
