"""Kimi-Linear over 2 ranks (gloo, fp32) == one process, token for token, through LLM.generate:
plain; with the prefix cache, n-gram speculation, preemption and chunked prefill together;
expert parallel with a draft model; 4 ranks."""

import os

import pytest
import torch.distributed as dist

from hyla import LLM
from hyla.models import load_model
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.parallel.tp_cases import assert_same, generate, prompts, rank_bytes

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("tp-kimi"), "moe")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("tp-kimi-dense"), "dense")


@pytest.fixture(scope="module")
def first():
    return prompts()


@pytest.fixture(scope="module")
def reference(ckpt, first):
    return generate(LLM(str(ckpt), dtype="float32"), first)


def _tp(ckpt, **kw) -> LLM:
    return LLM(str(ckpt), dtype="float32", tensor_parallel_size=2, **kw)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_tp2_equals_tp1_and_holds_half_the_weights(ckpt, first, reference):
    llm = _tp(ckpt)
    try:
        assert_same(generate(llm, first, [r[0] for r in reference]), reference)
        shard, full = llm.engine.model, load_model(ckpt)
        assert shard.model.embed_tokens.weight.shape[0] == full.config.vocab_size // 2
        assert shard.model.layers[0].self_attn.q_proj.weight.shape[0] * 2 == \
            full.model.layers[0].self_attn.q_proj.weight.shape[0]
        assert shard.weight_bytes() < 0.6 * full.weight_bytes()  # only the small replicated parts twice
        assert llm.engine.workers.pool_budget() == 0  # every rank answered; CPUs report no device memory
        pids = llm.engine.workers.pids
    finally:
        llm.shutdown()
    assert all(_gone(p) for p in pids) and not dist.is_initialized()


def test_tp2_prefix_cache_ngram_preemption_chunked_prefill(ckpt, first, reference):
    slot, token = rank_bytes(ckpt, 2)
    assert 16 * token < slot < 2 * 16 * token  # so the budget below is 10 slots + 12 pages per rank
    # 10 slots (2 requests x (1 + 3) + 2 checkpoints), the other half 12 pages: the two long
    # prompts start together and outgrow them
    llm = _tp(ckpt, enable_prefix_caching=True, speculative_config=NGRAM, max_num_seqs=2, max_model_len=128,
              memory_budget=20 * slot, max_num_batched_tokens=64)  # and the long prompts prefill in chunks
    try:
        assert_same(generate(llm, first, [r[0] for r in reference]), reference)
        m = llm.get_metrics()
    finally:
        llm.shutdown()
    assert m["prefix_cache_hit_tokens"] > 0 and m["spec_num_draft_tokens"] > 0 and m["num_preemptions"] > 0


def test_tp2_host_tier_and_int8_checkpoints(ckpt, first, reference):
    """The prefix cache's host tier and int8 checkpoints under tensor parallelism: every rank
    moves its own shard of the same entries. The budget keeps 2 slots for checkpoints beside the
    running requests (the int8 tier takes them but 1) and 12 pages: the second turn's hits come
    back from the host. int8 restores may move a logprob by more than LOGPROB_TOL, so tokens only."""
    slot, token = rank_bytes(ckpt, 2)
    llm = _tp(ckpt, enable_prefix_caching=True, max_num_seqs=2, max_model_len=128,
              memory_budget=4 * slot + 12 * 16 * token, host_cache_bytes=40 * slot, checkpoint_dtype="int8")
    try:
        got = generate(llm, first, [r[0] for r in reference])
        m = llm.get_metrics()
    finally:
        llm.shutdown()
    assert [g[0] for g in got] == [r[0] for r in reference]
    assert m["hits_host"] > 0 and m["bytes_from_host"] > 0 and m["checkpoints_to_int8"] > 0


def test_expert_parallel_with_a_draft_model(ckpt, first, reference, dense):
    """Whole experts per rank == tensor-sharded experts (both == TP = 1); the draft model (the
    dense checkpoint, unsharded) runs on rank 0 beside the scheduler."""
    llm = _tp(ckpt, enable_expert_parallel=True,
              speculative_config={"method": "draft_model", "model": str(dense), "num_speculative_tokens": 2})
    try:
        assert_same(generate(llm, first, [r[0] for r in reference]), reference)
        moe = llm.engine.model.model.layers[1].block_sparse_moe
        assert moe.experts.num_experts == 8 and moe.experts.gate_up_proj.shape[1] == 2 * 32  # whole experts
        assert llm.get_metrics()["spec_num_draft_tokens"] > 0
    finally:
        llm.shutdown()


def test_tp4(dense):
    """4 ranks (3 workers) on the dense variant (4 KDA / 4 MLA heads)."""
    first = prompts(seed=3, lengths=(17, 1))
    reference = generate(LLM(str(dense), dtype="float32"), first)
    llm = LLM(str(dense), dtype="float32", tensor_parallel_size=4)
    try:
        assert_same(generate(llm, first, [r[0] for r in reference]), reference)
        assert len(llm.engine.workers.pids) == 3
    finally:
        llm.shutdown()
