"""The MTP head's weights are loaded after the pools are sized, so the automatic (free-memory)
budget keeps their bytes out: the drafter reports them from the checkpoint's headers."""

from __future__ import annotations

import torch

from hyla import LLM
from hyla.engine.pools import size_pools
from hyla.models.default import bundled_model_path

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
    llm = LLM(bundled_model_path("qwen3.5-mtp"), dtype="float32")
    model = llm.engine.model
    free = 64 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (free, 2 * free))
    opts = dict(budget=None, max_num_seqs=4, max_model_len=256, page_size=16, state_dtype=torch.float32,
                device=torch.device("cuda"))
    slots, pages = size_pools(model, **opts)
    slots_r, pages_r = size_pools(model, reserved_bytes=free // 4, **opts)
    page_bytes = model.kv_bytes_per_token() * 16
    assert slots_r == slots and pages - pages_r >= (free // 4) // page_bytes - 1
