"""A prefill step as spans and cores (hyla.models.prefill_program) equals model.forward_batch, and
so do the spans run over padded static buffers (hyla.engine.prefill_graphs, no graphs on the CPU)."""

import copy

import pytest
import torch

from hyla.engine.prefill_graphs import PrefillGraphs, token_buckets
from hyla.models import load_model
from hyla.models.prefill_program import PrefillProgram, supports
from tests.oracles.paged import ToyPool

VARIANTS = ["moe", "dense", "safe_gate", "full_rank_gate"]


def _steps(pool: ToyPool):
    """Three prefill steps over four requests, as (chunks, checkpoints): fresh prompts of odd
    lengths; a continuation after 37 cached tokens with checkpoints at 1, 6 and 16 beside a fresh
    prompt and a one-token row; a 2-token prompt beside a one-token row."""
    g = torch.Generator().manual_seed(3)
    toks = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    a, b, c, d = (pool.add() for _ in range(4))
    yield [(a, toks(37)), (b, toks(9))], None
    dests = [pool.take_slot() for _ in range(3)]
    yield [(a, toks(16)), (c, toks(5)), (b, toks(1))], [[(1, dests[0]), (6, dests[1]), (16, dests[2])], [], []]
    yield [(d, toks(2)), (c, toks(1))], None


def _run(pool: ToyPool, chunks, checkpoints, forward):
    batch = pool.batch(chunks, checkpoints)
    ids = torch.tensor([t for _, ts in chunks for t in ts], dtype=torch.long, device=pool.device)
    with torch.no_grad():
        hidden = forward(ids, batch, pool.cache).clone()
    for rid, ts in chunks:
        pool.lens[rid] += len(ts)
    return hidden


def step_pairs(model, forward):
    """Run _steps through model.forward_batch on one pool and through `forward` on a copy of it ->
    per step (got, want, the copy's pool, the reference pool)."""
    ref_pool = ToyPool(model, num_slots=10, num_pages=64, page_size=4)
    pool = copy.deepcopy(ref_pool)
    for (chunks, ck), (chunks2, ck2) in zip(_steps(ref_pool), _steps(pool)):
        want = _run(ref_pool, chunks, ck, model.forward_batch)
        yield _run(pool, chunks2, ck2, forward), want, pool, ref_pool


def pool_pairs(a: ToyPool, b: ToyPool):
    """Every pool tensor of a beside b's."""
    for la, lb in zip(a.cache.layers, b.cache.layers):
        yield from zip(la.tensors(), lb.tensors())


def with_garbage(graphs: PrefillGraphs):
    """graphs.run, with every static buffer refilled with garbage first (NaN, ids past any
    vocabulary): a step must not read what an earlier one left."""
    state = graphs.state

    def forward(ids, batch, cache):
        bufs = [state.ids_buffer, state.residual_buffer, state.hidden_buffer, *state.core_buffers]
        bufs += [b for _, leaves, _ in state.layer_layout for b in leaves if b is not None]
        for b in bufs:
            b.fill_(10**9) if b.dtype == torch.long else b.fill_(float("nan"))
        return graphs.run(ids, batch, cache)

    return forward


def _compare(model, forward, exact: bool):
    for got, want, pool, ref_pool in step_pairs(model, forward):
        if exact:
            assert torch.equal(got, want)
            assert all(torch.equal(ta, tb) for ta, tb in pool_pairs(pool, ref_pool))
        else:
            # the padded spans multiply more rows: a GEMM's blocking may change with the row count
            # (fp32: the same sums in another order, a few ulps each, carried through the layers)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_program_is_forward_batch_bit_for_bit(kimi_checkpoint, variant):
    model = load_model(kimi_checkpoint(variant))
    assert supports(model)
    _compare(model, PrefillProgram(model).run, exact=True)


@pytest.mark.parametrize("variant", ["moe", "dense"])
def test_padded_static_spans_equal_forward_batch(kimi_checkpoint, variant):
    """Buckets of 16 / 48 / 64 tokens: every step pads (46 -> 48, 22 -> 48, 1 -> 16). Between steps
    every static buffer is refilled with garbage (NaN, ids past the vocabulary): the next step
    must not read any of it."""
    model = load_model(kimi_checkpoint(variant))
    graphs = PrefillGraphs(model, 64, buckets=[16, 48, 64])
    for got, want, pool, ref_pool in step_pairs(model, with_garbage(graphs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for ta, tb in pool_pairs(pool, ref_pool):
            torch.testing.assert_close(ta, tb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_qwen_families(qwen3_next_checkpoint, family, tmp_path):
    """Gated attention (its core norms and rotates q and k) and Gated DeltaNet: the program bit for
    bit, the padded static spans within fp32 rounding."""
    if family == "qwen3_next":
        model = load_model(qwen3_next_checkpoint())
    else:
        from tests.oracles.qwen3_5_checkpoint import build_qwen3_5_checkpoint

        model = load_model(build_qwen3_5_checkpoint(tmp_path))
    assert supports(model)
    _compare(model, PrefillProgram(model).run, exact=True)
    _compare(model, PrefillGraphs(model, 64, buckets=[16, 48, 64]).run, exact=False)


def test_buckets_and_refusals(tmp_path):
    assert token_buckets(64) == [16, 24, 32, 48, 64]
    assert token_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(1200) == [16, 24, 32, 48, 64, 96, 128, 192, *range(256, 1200, 128), 1200]
    assert token_buckets(2560)[-4:] == [1920, 2048, 2304, 2560]
    assert token_buckets(8) == [8]
    with pytest.raises(ValueError, match="max_tokens"):
        token_buckets(0)
    from hyla.bench.random_models import random_model

    model = random_model("tiny-glm5-next")
    assert not supports(model)
    with pytest.raises(ValueError, match="does not run its prefill steps in spans"):
        PrefillProgram(model)
