"""GLM-5-Next full-sequence logits vs transformers' Glm5NextForConditionalGeneration (text only),
fp32, on tiny random checkpoints: prompts from 1 token to well past index_topk * index_kpool, so
the DSA selection drops positions; hc_mult 2 and 4; a shared indexer layer; kpool 1; with and
without tail selection."""

import pytest
import torch

from hyla.models import load_model
from tests.oracles.glm5_next_checkpoint import one_thread, glm5_next_checkpoint, load_reference  # noqa: F401

LENGTHS = (1, 6, 33, 90)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(glm5_next_checkpoint):  # noqa: F811
    cache = {}

    def get(variant):
        if variant not in cache:
            path = glm5_next_checkpoint(variant)
            cache[variant] = (load_model(path), load_reference(path))
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", ["hc2", "hc4", "kpool1"])
def test_logits_match_transformers(models, variant):
    model, ref = models(variant)
    gen = torch.Generator().manual_seed(7)
    for T in LENGTHS:
        ids = torch.randint(3, 256, (1, T), generator=gen)
        with torch.no_grad():
            want = ref(input_ids=ids).logits
            got = model(ids)
        assert got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err <= 1e-4, (variant, T, err)


def test_batch_rows_are_independent(models):
    model, ref = models("hc2")
    ids = torch.randint(3, 256, (2, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        both = model(ids)
        assert (both - ref(input_ids=ids).logits).abs().max() <= 1e-4
        assert torch.allclose(both[1], model(ids[1:])[0], atol=1e-5)


def test_selection_drops_positions(models):
    """At 90 tokens the hc2 indexer (top-8 of 4-token pools + tail) keeps at most 11 positions per
    query: the sparse model must differ from the same weights attending densely."""
    model, _ = models("hc2")
    ids = torch.randint(3, 256, (1, 90), generator=torch.Generator().manual_seed(5))
    layer = model.model.layers[1].self_attn
    x = torch.randn(1, 90, 64)
    with torch.no_grad():
        _, sel = layer(x)
    counts = sel[0].sum(-1)
    assert counts.max() <= 8 + 3 and counts[-1] < 90 and counts[0] == 1
    with torch.no_grad():
        sparse = model(ids)
        topk = [m.self_attn.indexer for m in model.model.layers if getattr(m.self_attn, "indexer", None)]
        for idx in topk:
            idx.topk = 10 ** 6
        dense = model(ids)
        for idx in topk:
            idx.topk = 8
    assert (sparse - dense)[0, 40:].abs().max() > 1e-3
