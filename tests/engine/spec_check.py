"""The check both families' speculative-decoding tests run: speculation (n-gram or a draft
model, either rollback, prefix cache on or off) gives the plain greedy tokens, drafts something,
and hands back every slot and page."""

from hyla import LLM


def assert_spec_equals_greedy(ckpt, near_draft, prompts, params, reference, rollback, method, prefix_cache):
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "rollback": rollback}
    if method == "draft":
        cfg = {"method": "draft_model", "model": str(near_draft), "num_speculative_tokens": 3, "rollback": rollback}
    llm = LLM(str(ckpt), dtype="float64", speculative_config=cfg, enable_prefix_caching=prefix_cache, max_num_seqs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    m = llm.get_metrics()
    assert m["spec_num_draft_tokens"] > 0
    if method == "draft":
        assert 0 < m["spec_num_accepted_tokens"] < m["spec_num_draft_tokens"]  # partial acceptance
    assert m["state_slots_free"] + m.get("cached_checkpoints", 0) == m["state_slots_total"]
    assert m["kv_pages_free"] + m.get("cached_pages", 0) == m["kv_pages_total"]
