"""The MTP head consumes the prompt: prefill forwards (chunked or not) hand the prompt's final-norm
hidden states to the drafter, so the head's KV covers the whole context and a request's first
speculative step already drafts. With a prefix-cache hit of L tokens the cached positions were
not recomputed: the head's attention for that request starts at L (its first recomputed
position). Checked against the head run by hand over the target's whole-sequence hidden states
(a random head, whose attention matters), and against plain greedy decoding."""

import pytest

from hyla import LLM, SamplingParams
from hyla.models import load_model
from hyla.models.qwen3_5_mtp import load_mtp_head
from tests.engine.test_mtp_spec import _repeat_head, head_drafts_by_hand
from tests.oracles.qwen3_5_checkpoint import add_mtp_shard, build_qwen3_5_checkpoint
from tests.oracles.variants import rand_tokens as rand

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHARED = rand(20, 11)
PROMPTS = [SHARED + rand(17, 12), [7], rand(5, 3) * 4, SHARED + rand(9, 13)]  # 37, 1, 20, 29 tokens


def _checkpoint(root, repeat: bool):
    path = build_qwen3_5_checkpoint(root, "dense", "text")
    add_mtp_shard(path)
    if repeat:
        _repeat_head(path)
    return path


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("mtp-random"), repeat=False)


@pytest.fixture(scope="module")
def repeat_head(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("mtp-repeat"), repeat=True)


def _record(llm) -> list[tuple[str, list[int], int, list[int], int, int]]:
    """Wrap the drafter's propose: -> a list that fills with (request, its tokens, the head's view
    start, drafts, drafts asked for, pairs pending before the call) for every request of every call."""
    drafter, seen = llm.engine.spec.drafter, []
    propose = drafter.propose

    def record(seqs, ks, generator=None):
        pending = [getattr(drafter.views.get(s.request_id), "num_pending", None) for s in seqs]
        out = propose(seqs, ks, generator)
        for s, k, (d, _), n in zip(seqs, ks, out, pending):
            view = drafter.views.get(s.request_id)
            seen.append((s.request_id, list(s.token_ids), None if view is None else view.start, d, k, n))
        return out

    drafter.propose = record
    return seen


def _llm(path, k: int, prefix_cache: bool, **kw) -> LLM:
    return LLM(str(path), dtype="float64", enable_prefix_caching=prefix_cache, max_num_batched_tokens=16,
               checkpoint_interval=6 if prefix_cache else None,  # hits mid-page (18 of SHARED's 20 tokens)
               speculative_config={"method": "mtp", "num_speculative_tokens": k, **kw})


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_first_speculative_step_drafts_and_output_is_plain_greedy(repeat_head, prefix_cache):
    """Chunked prefill (16 tokens a step): every request's first speculative step drafts k tokens;
    greedy output equals plain greedy, the cache on (a second pass hits) and off."""
    want = [o.outputs[0].token_ids for o in LLM(str(repeat_head), dtype="float64").generate(
        PROMPTS, GREEDY, use_tqdm=False)]
    llm = _llm(repeat_head, 3, prefix_cache, rollback="replay")
    seen = _record(llm)
    for _ in range(2 if prefix_cache else 1):
        seen.clear()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
        first = {}
        for rid, _, _, d, k, n in seen:
            first.setdefault(rid, (d, k, n))
        assert len(first) == len(PROMPTS) and all(len(d) == k == 3 for d, k, _ in first.values()), first
        # the prompt's pairs ran during prefill, chunk by chunk: only the newest waits for propose
        assert all(n == 1 for _, _, n in first.values()), first
    m = llm.get_metrics()
    assert m["spec_num_accepted_tokens"] > 0
    assert (m["prefix_cache_hit_tokens"] > 0) == prefix_cache


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_proposals_are_the_heads_over_the_whole_context(random_head, prefix_cache):
    """Every proposal equals the head run by hand over the target's hidden states of positions
    start .. p - 1 (p: x0's position) paired with the tokens at start + 1 .. p: start = 0 without
    a hit (the prompt included), start = the hit length with one (the rule for cached prefixes)."""
    llm = _llm(random_head, 2, prefix_cache)
    seen = _record(llm)
    if prefix_cache:  # file SHARED's checkpoints (every 6 tokens) first
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        seen.clear()
    llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
    starts = {rid: start for rid, _, start, d, _, _ in seen if d}
    assert len(starts) == 3
    if prefix_cache:
        assert sorted(starts.values()) == [0, 0, 18]  # the last prompt hits SHARED's checkpoint at 18
    else:
        assert set(starts.values()) == {0}
    model = load_model(random_head, dtype="float64")
    head = load_mtp_head(random_head, model)
    for _, tokens, start, drafts, _, _ in seen:
        if drafts:
            assert drafts == head_drafts_by_hand(model, head, tokens, start, len(drafts))
