"""MTP under eviction pressure: many requests with shared prefixes, the prefix cache on and a
budget of a few pages, so that the cache evicts pages and checkpoints and running requests are
preempted and recomputed (their head views start over, hits start the head at the hit). Greedy
output equals plain greedy decoding token for token."""

import pytest

from hyla import LLM, SamplingParams
from tests.engine.test_mtp_prompt import _checkpoint
from tests.oracles.variants import rand_tokens as rand

PREFIXES = [rand(24, 31), rand(21, 32), rand(26, 33)]
PROMPTS = [PREFIXES[i % 3] + rand(3 + i, 40 + i) for i in range(12)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=20 + 2 * (i % 4), ignore_eos=True) for i in range(12)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("mtp-evict"), repeat=True)


@pytest.fixture(scope="module")
def plain(ckpt):
    llm = LLM(str(ckpt), dtype="float64", max_model_len=80)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("k,rollback", [(2, "slots"), (3, "replay")])
def test_eviction_and_preemption_with_mtp_equal_plain_greedy(ckpt, plain, k, rollback):
    probe = LLM(str(ckpt), dtype="float64", max_model_len=80)
    model = probe.engine.model
    page = probe.engine.kv_bytes_per_page + model.config.layer_sizes().kv_per_token * 8 * 16  # + the head's layer
    per_seq = 1 + k if rollback == "slots" else 1
    slots = 3 * per_seq + 3  # three running requests and three checkpoints
    llm = LLM(str(ckpt), dtype="float64", max_model_len=80, max_num_seqs=3, enable_prefix_caching=True,
              checkpoint_interval=8, memory_budget=slots * model.state_bytes_per_slot() + 10 * page,
              speculative_config={"method": "mtp", "num_speculative_tokens": k, "rollback": rollback})
    assert llm.engine.pools.pages.num_pages == 10 and llm.engine.pools.slots.num_slots == slots
    for _ in range(2):  # the second pass hits what the first filed (what eviction left)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == plain
    m = llm.get_metrics()
    assert m["pages_evicted"] > 0 and m["checkpoints_evicted"] > 0, m
    assert m["num_preemptions"] > 0 and m["prefix_cache_hit_tokens"] > 0, m
    assert 0 < m["spec_num_accepted_tokens"] < m["spec_num_draft_tokens"]
    assert m["kv_pages_free"] + m["cached_pages"] == m["kv_pages_total"]
    assert m["state_slots_free"] + m["cached_checkpoints"] == m["state_slots_total"]
    assert not llm.engine.spec.drafter.views
