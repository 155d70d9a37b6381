"""The MTP head's weights are loaded after the pools are sized, so the automatic (free-memory)
budget keeps their bytes out: the drafter reports them from the checkpoint's headers."""

from __future__ import annotations

import pytest
import torch

from hyla import LLM

SPEC = {"method": "mtp", "num_speculative_tokens": 2}


def test_reported_head_bytes_equal_the_loaded_head():
    llm = LLM("qwen3.5-mtp", dtype="float32", speculative_config=SPEC)
    drafter = llm.engine.spec.drafter
    head = drafter.head
    target = {t.data_ptr() for t in llm.engine.model.state_dict().values()}
    loaded = sum(t.numel() * t.element_size() for t in head.state_dict().values()
                 if t.data_ptr() not in target)  # embeddings / lm_head shared with the target excluded
    assert drafter.bind_weight_bytes(llm.engine.model) == loaded > 0


def test_automatic_cuda_budget_keeps_the_reserved_bytes_out(monkeypatch):
    """The engine's CUDA budget (hyla.engine.memory_profile) takes the head's bytes out of the pools'
    share: the same device state with reserved_bytes gives exactly that much less."""
    from hyla.engine import memory_profile

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: type("P", (), {"total_memory": 100 * gib}))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (40 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    device = torch.device("cuda")
    budget = memory_profile.device_pool_budget(device, 0.9, step_bytes=2 * gib)
    # 90 GiB asked; 60 GiB not free after the cached blocks went back; a 2 GiB step
    assert budget == 90 * gib - 60 * gib - 2 * gib
    assert memory_profile.device_pool_budget(device, 0.9, 2 * gib, reserved_bytes=gib // 4) == budget - gib // 4
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5 of 100.0 GiB leaves nothing"):
        memory_profile.device_pool_budget(device, 0.5, 2 * gib)
