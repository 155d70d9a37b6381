"""The engine runs GLM-5-Next (KDA + DSA-indexed MLA with its paged indexer cache, mHC, MoE) with
no family-specific code: batching, chunked prefill, preemption, the prefix cache and speculation
(n-gram, a draft model) leave greedy output unchanged, and it equals the full-sequence model's
greedy and transformers' generate."""

import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.models import load_model
from tests.engine.spec_check import assert_spec_equals_greedy
from tests.oracles.glm5_next_checkpoint import one_thread, build_glm5_next_checkpoint, load_reference  # noqa: F401
from tests.oracles.variants import noisy_lm_head_copy
from tests.oracles.variants import rand_tokens as rand

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_glm5_next_checkpoint(tmp_path_factory.mktemp("glm5-engine"), "hc2", with_tokenizer=True)


@pytest.fixture(scope="module")
def prompts():
    # past index_topk * index_kpool = 32 tokens, so decode steps select from the cached pools
    return [rand(n, 2000 + n) for n in (1, 3, 45, 16, 17, 33, 70)]


@pytest.fixture(scope="module")
def alone(ckpt, prompts):
    llm = LLM(str(ckpt), dtype="float64", max_num_seqs=1)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_engine_greedy_equals_full_sequence_greedy(ckpt, prompts, alone):
    model = load_model(ckpt, dtype=torch.float64)
    for p, got in zip(prompts[:3], alone):
        ids = list(p)
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert got == ids[len(p):]


def test_equals_transformers_generate(ckpt, prompts):
    """fp32 greedy through hyla.LLM equals transformers' generate (its own indexer cache)."""
    ref = load_reference(ckpt)
    chosen = [prompts[i] for i in (0, 2, 6)]  # 1, 45 and 70 tokens
    llm = LLM(str(ckpt), dtype="float32")
    outs = llm.generate(chosen, GREEDY, use_tqdm=False)
    for p, o in zip(chosen, outs):
        ids = torch.tensor([p])
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                                do_sample=False, eos_token_id=None)
        assert o.outputs[0].token_ids == want[0, len(p):].tolist()


@pytest.mark.parametrize("kw", [
    dict(),
    dict(max_num_seqs=3, max_num_batched_tokens=24),
    "preemption",
], ids=["default", "chunked_prefill", "preemption"])
def test_batched_greedy_equals_alone(ckpt, prompts, alone, kw):
    if kw == "preemption":
        probe = load_model(ckpt, dtype=torch.float64)
        slot, page = probe.state_bytes_per_slot(), probe.kv_bytes_per_token() * 16
        kw = dict(max_num_seqs=4, max_model_len=112, memory_budget=4 * slot + 12 * page)
    llm = LLM(str(ckpt), dtype="float64", **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    m = llm.get_metrics()
    if "memory_budget" in kw:
        assert m["num_preemptions"] > 0
    assert m["kv_pages_free"] == m["kv_pages_total"] and m["state_slots_free"] == m["state_slots_total"]


def test_prefix_cache_restores_indexer_pages(ckpt):
    system = rand(50, 1)
    # identical retries hit all but the last token: 56 tokens (whole pools of the partial page)
    # and 57 (a partial pool: its token rows are copied with the page, its pooled key recomputed)
    prompts = [system + rand(5, 2), system + rand(11, 3), system + rand(7, 4), system + rand(7, 4),
               system + rand(8, 5), system + rand(8, 5)]
    plain = LLM(str(ckpt), dtype="float64")
    want = [plain.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(str(ckpt), dtype="float64", enable_prefix_caching=True)
    outs, hits = [], []
    for p in prompts:
        before = llm.get_metrics()["prefix_cache_hit_tokens"]
        outs.append(llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        hits.append(llm.get_metrics()["prefix_cache_hit_tokens"] - before)
    assert outs == want
    assert hits[0] == 0 and hits[2] >= 48 and hits[3] == len(prompts[3]) - 1 and hits[5] == len(prompts[5]) - 1


SPEC_PROMPTS = [rand(12, 1) * 3, rand(5, 3) * 4 + [9], [7], rand(40, 4)]
SPEC_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def spec_reference(ckpt):
    return [o.outputs[0].token_ids
            for o in LLM(str(ckpt), dtype="float64").generate(SPEC_PROMPTS, SPEC_GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method,rollback,prefix_cache", [
    ("ngram", "slots", False), ("ngram", "replay", True), ("draft", "slots", True),
])
def test_speculation_equals_plain_greedy(ckpt, spec_reference, tmp_path, method, rollback, prefix_cache):
    draft = noisy_lm_head_copy(ckpt, tmp_path / "draft", scale=0.05) if method == "draft" else None
    assert_spec_equals_greedy(ckpt, draft, SPEC_PROMPTS, SPEC_GREEDY, spec_reference, rollback, method, prefix_cache)


def test_decode_graphs_are_allowed(ckpt):
    """Decode / verify steps of the DSA layers read nothing back, so the CUDA-graph runner may
    capture them (the prefill walk is never captured)."""
    from hyla.engine.cuda_graph import graph_safe

    assert graph_safe(load_model(ckpt))
