"""Kimi K3 over 2 ranks (gloo, fp32) == one process, token for token, through LLM.generate: KDA
with the full-rank gate and A_log [K], gated NoPE MLA, attention residuals, latent SiTU MoE with
the latent norm (experts split along their width, or whole per rank with expert parallelism),
with the prefix cache, n-gram speculation, preemption and chunked prefill; the latent MoE
variants without the norm and without the latent width; the per-rank memory report; MXFP4
experts cut per rank; and the fields a degree does not divide."""

import dataclasses

import pytest
import torch

from hyla import LLM
from hyla.models import load_config, load_model
from hyla.parallel.plans import check_parallel, make_plan
from hyla.parallel.tp_memory import rank_memory_report
from tests.models.test_kimi_k3_mxfp4 import checkpoints as mxfp4_checkpoints  # noqa: F401 (a fixture)
from tests.oracles.kimi_k3_checkpoint import (
    build_kimi_k3_checkpoint,
    config_dict,
    per_expert,
    random_state,
    write_checkpoint,
)
from tests.parallel.tp_cases import assert_same, generate, prompts, rank_bytes

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_kimi_k3_checkpoint(tmp_path_factory.mktemp("tp-k3"))


@pytest.fixture(scope="module")
def first():
    return prompts(seed=4)


@pytest.fixture(scope="module")
def reference(ckpt, first):
    return generate(LLM(str(ckpt), dtype="float32"), first)


def _tp(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", tensor_parallel_size=2, **kw)


def test_tp2_prefix_cache_ngram_preemption_chunked_prefill(ckpt, first, reference):
    slot, token = rank_bytes(ckpt, 2)
    # 10 slots (2 requests x (1 + 3) + 2 checkpoints) and 12 pages per rank: the two long
    # prompts (95 + 94 tokens, 7 pages each with their outputs) start together and outgrow them
    llm = _tp(ckpt, enable_prefix_caching=True, speculative_config=NGRAM, max_num_seqs=2, max_model_len=128,
              memory_budget=10 * slot + 12 * 16 * token + 8 * token, max_num_batched_tokens=64)
    try:
        assert_same(generate(llm, first, [r[0] for r in reference]), reference)
        m = llm.get_metrics()
        shard = llm.engine.model
        moe = shard.model.layers[1].block_sparse_moe
        assert moe.experts.gate_up_proj.shape == (8, 2 * 16, 32)  # 8 experts, half their width
        assert moe.routed_expert_up_proj.weight.shape == (64, 16)  # row-parallel over the latent 32
        assert moe.routed_expert_down_proj.weight.shape == (32, 64)  # replicated
        assert shard.weight_bytes() == rank_memory_report(load_config(ckpt), 2, torch.float32).weight_bytes
    finally:
        llm.shutdown()
    assert m["prefix_cache_hit_tokens"] > 0 and m["spec_num_draft_tokens"] > 0 and m["num_preemptions"] > 0


def test_expert_parallel_equals_tp1(ckpt, first, reference):
    """Whole experts per rank == tensor-sharded experts (both == TP = 1)."""
    llm = _tp(ckpt, enable_expert_parallel=True, enable_prefix_caching=True, speculative_config=NGRAM)
    try:
        assert_same(generate(llm, first, [r[0] for r in reference]), reference)
        moe = llm.engine.model.model.layers[1].block_sparse_moe
        assert moe.experts.num_experts == 4 and moe.experts.gate_up_proj.shape[1] == 2 * 32  # whole experts
        assert moe.shared_experts.gate_proj.weight.shape[0] == 16  # the shared expert split in 2
        m = llm.get_metrics()
        assert m["prefix_cache_hit_tokens"] > 0 and m["spec_num_draft_tokens"] > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("overrides", [dict(latent_moe_use_norm=False), dict(routed_expert_hidden_size=None)],
                         ids=["latent-no-norm", "norm-no-latent"])
def test_latent_moe_variants(tmp_path, overrides):
    """y kept partial through a replicated up_proj (no norm); the normalised full-width y split
    by columns (no latent projections)."""
    config = config_dict(**overrides)
    path = write_checkpoint(tmp_path / "k3", config, per_expert(random_state(config, 1)))
    first = prompts(seed=5, lengths=(30, 1))
    reference = generate(LLM(str(path), dtype="float32"), first)
    llm = _tp(path)
    try:
        assert_same(generate(llm, first, [r[0] for r in reference]), reference)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_memory_report_equals_loaded_shards(ckpt, expert_parallel):
    """Each rank's shard as the loader builds it (bf16, the short convs kept fp32) == the report;
    A_log holds this rank's head first, zero-padded to K."""
    config = load_config(ckpt)
    full = load_model(ckpt, dtype=torch.bfloat16)
    report = rank_memory_report(config, 2, torch.bfloat16, torch.float32, expert_parallel)
    for rank in range(2):
        shard = load_model(ckpt, dtype=torch.bfloat16, shard=make_plan(config.model_type, rank, 2, None,
                                                                         expert_parallel))
        assert report.weight_bytes == shard.weight_bytes() < 0.7 * full.weight_bytes()
        assert report.state_bytes_per_request == shard.state_bytes_per_slot(torch.float32)
        assert report.kv_bytes_per_token == shard.kv_bytes_per_token()
        a_log, ref = shard.model.layers[0].self_attn.A_log, full.model.layers[0].self_attn.A_log
        assert a_log.shape == ref.shape and a_log[0] == ref[rank] and not a_log[1:].any()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mxfp4_experts_shard_as_their_dequantised_weights(mxfp4_checkpoints, expert_parallel):
    """A rank's part of the released MXFP4 experts (dequantised one expert at a time, then cut)
    == its part of the same weights stored dequantised."""
    mx, _, plain = mxfp4_checkpoints
    model_type = load_config(mx).model_type
    for rank in range(2):
        got, want = (load_model(p, dtype=torch.float32, shard=make_plan(model_type, rank, 2, None, expert_parallel))
                     for p in (mx, plain))
        want = want.state_dict()
        assert all(torch.equal(t, want[name]) for name, t in got.state_dict().items())


@pytest.mark.parametrize("world,expert_parallel,overrides,field", [
    (4, False, {}, "linear_num_heads"),
    (2, False, dict(num_attention_heads=3), "num_attention_heads"),
    (2, False, dict(moe_intermediate_size=33), "moe_intermediate_size"),
    (2, False, dict(routed_expert_hidden_size=33), "routed_expert_hidden_size"),
    (2, True, dict(num_experts=7, num_expert_group=1), "num_experts"),
])
def test_not_divisible_names_the_field(ckpt, world, expert_parallel, overrides, field):
    config = dataclasses.replace(load_config(ckpt), **overrides)
    with pytest.raises(ValueError, match=f"`{field}`"):
        check_parallel(config, world, expert_parallel)
