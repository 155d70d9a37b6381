"""The MTP head's KV lives in the engine's page pool: its attention layer is one more layer per
page in the engine's bytes per page (so memory_budget accounts for it), its rows are addressed
by the request's own block table, and it never writes into a page shared through the prefix
cache. Greedy output equals plain greedy with the prefix cache on, preemption and both rollbacks."""

import pytest
import torch

from hyla import LLM, SamplingParams
from tests.engine.test_mtp_prompt import PROMPTS, SHARED, _checkpoint, _record
from tests.oracles.variants import rand_tokens as rand

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("mtp-pool"), repeat=True)


def test_bytes_per_page_include_the_heads_layer(ckpt):
    plain = LLM(str(ckpt), dtype="float64", max_model_len=256, memory_budget=1 << 23)
    llm = LLM(str(ckpt), dtype="float64", max_model_len=256, memory_budget=1 << 23,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "rollback": "replay"})
    kv = llm.engine.spec.drafter.kv
    head_page = sum(t[0].numel() * t.element_size() for t in kv.tensors())  # one page of the head's layer
    assert head_page > 0 and kv.k.shape[0] == llm.engine.runner.cache.num_pages  # every engine page
    assert llm.engine.kv_bytes_per_page == plain.engine.kv_bytes_per_page + head_page
    engine = llm.engine
    slots, pages = engine.pools.slots.num_slots, engine.pools.pages.num_pages
    assert slots == plain.engine.pools.slots.num_slots  # same slots: the pages pay for the head
    assert pages == ((1 << 23) - slots * engine.model.state_bytes_per_slot()) // engine.kv_bytes_per_page
    assert pages < plain.engine.pools.pages.num_pages
    assert not hasattr(engine.spec.drafter, "pages")  # no private pool


@pytest.mark.parametrize("rollback", ["slots", "replay"])
def test_prefix_cache_and_preemption_equal_plain_greedy(ckpt, rollback):
    """Prefix cache on and a budget of a few pages: requests are preempted and recomputed (their
    head views start over), others hit cached prefixes; output == plain greedy."""
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [SHARED + rand(30, 21), rand(30, 2), SHARED + rand(6, 9), [5]]
    plain = LLM(str(ckpt), dtype="float64", max_model_len=96)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, long, use_tqdm=False)]
    model = plain.engine.model
    k = 2
    spec = {"method": "mtp", "num_speculative_tokens": k, "rollback": rollback}
    # enough slots for three running requests (+ checkpoints), pages for about two of them
    slots = 3 * (1 + k if rollback == "slots" else 1) + 3
    page = (model.kv_bytes_per_token() + model.config.layer_sizes().kv_per_token * 8) * 16
    llm = LLM(str(ckpt), dtype="float64", max_model_len=96, max_num_seqs=3, enable_prefix_caching=True,
              checkpoint_interval=6, memory_budget=slots * model.state_bytes_per_slot() + 9 * page,
              speculative_config=spec)
    for _ in range(2):  # the second pass hits what the first filed
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, long, use_tqdm=False)] == want
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hit_tokens"] > 0
    assert 0 < m["spec_num_accepted_tokens"] < m["spec_num_draft_tokens"]
    assert m["kv_pages_free"] + m["cached_pages"] == m["kv_pages_total"]


def test_head_never_writes_a_page_shared_through_the_prefix_cache(ckpt):
    """A request that hits 18 cached tokens (mid-page) drafts from its first speculative step, and
    the head rows of every page the cache held before it ran are unchanged after it finished."""
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True, checkpoint_interval=6,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # SHARED + 17 tokens: files checkpoints every 6
    engine, drafter = llm.engine, llm.engine.spec.drafter
    cached = [p for p, refs in enumerate(engine.pools.pages.refs) if refs > 0]
    assert cached and engine.get_metrics()["cached_pages"] == len(cached)
    before = [t[cached].clone() for t in drafter.kv.tensors()]
    seen = _record(llm)
    out = llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)  # SHARED + 9 tokens
    assert engine.get_metrics()["prefix_cache_hit_tokens"] == 18
    assert seen[0][2] == 18 and len(seen[0][3]) == 3  # the view starts at the hit; the first step drafts
    for t, b in zip(drafter.kv.tensors(), before):
        torch.testing.assert_close(t[cached], b, rtol=0, atol=0)
    want = LLM(str(ckpt), dtype="float64").generate([PROMPTS[3]], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids
