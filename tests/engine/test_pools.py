"""size_pools: a budget split into state slots and KV pages."""

import torch

from hyla.engine.pools import size_pools


class _Model:
    def __init__(self, slot_bytes: int, kv_bytes: int):
        self.slot_bytes, self.kv_bytes = slot_bytes, kv_bytes

    def state_bytes_per_slot(self, state_dtype):
        return self.slot_bytes

    def kv_bytes_per_token(self):
        return self.kv_bytes


def test_a_model_without_attention_layers_gets_page_ids_for_its_block_tables_only():
    slots, pages = size_pools(_Model(1 << 20, 0), budget=64 << 20, max_num_seqs=4, max_model_len=1000, page_size=16,
                              state_dtype=torch.float32, device=torch.device("cpu"))
    assert slots == 4 and pages == 4 * 63  # not budget / 1 byte: a page costs nothing here


def test_pages_take_what_the_slots_leave():
    slots, pages = size_pools(_Model(1000, 10), budget=100_000, max_num_seqs=4, max_model_len=100, page_size=10,
                              state_dtype=torch.float32, device=torch.device("cpu"), extra_slots=4)
    assert slots == 8 and pages == (100_000 - 8 * 1000) // 100


def test_a_prefix_cache_gets_checkpoint_slots_from_a_larger_budget():
    """checkpoint_share: from a budget beyond the configuration's need (the wanted slots and every
    request's pages at max_model_len), the slots grow to that share of the budget; below it, or
    without a share, the split is as before."""
    model = _Model(1000, 10)
    kw = dict(max_num_seqs=4, max_model_len=100, page_size=10, state_dtype=torch.float32, device=torch.device("cpu"),
              extra_slots=4)  # the need: 8 slots (8,000 bytes) + 4 x 10 pages (4,000 bytes)
    assert size_pools(model, budget=100_000, **kw) == (8, (100_000 - 8_000) // 100)
    assert size_pools(model, budget=100_000, checkpoint_share=0.5, **kw) == (50, 500)
    # only the budget beyond the need goes to slots: 16,500 - 12,000 buys 4 more, not 16,500 / 2
    assert size_pools(model, budget=16_500, checkpoint_share=0.9, **kw) == (12, 45)
    # at or below the need nothing changes
    assert size_pools(model, budget=12_000, checkpoint_share=0.5, **kw) == size_pools(model, budget=12_000, **kw)
    # no attention layer: the slots take their share, the block tables still get their page ids
    assert size_pools(_Model(1000, 0), budget=100_000, checkpoint_share=0.5, **kw) == (50, 40)
