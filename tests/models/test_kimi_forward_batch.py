"""The cache-driven forward (forward_batch over paged KV + state slots) equals the full forward."""

import pytest
import torch

from hyla.models import load_model
from tests.oracles.paged import ToyPool

VARIANTS = ["moe", "dense", "safe_gate"]


def _seqs():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (37, 70, 9, 1)]


def _full_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_then_batched_decode(kimi_checkpoint, variant):
    """Four sequences of different lengths: prefill in pieces of 16 (several sequences per step,
    varlen), then 6 batched decode steps; every token's logits equal the full-sequence forward."""
    model = load_model(kimi_checkpoint(variant))
    prompts = _seqs()
    pool = ToyPool(model, num_slots=6, num_pages=64, page_size=4)
    rids = [pool.add() for _ in prompts]
    tokens = [list(p) for p in prompts]
    got = [[] for _ in prompts]
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        chunks = [(i, prompts[i][done[i]:done[i] + 16]) for i in range(len(prompts)) if done[i] < len(prompts[i])]
        logits = pool.step(model, [(rids[i], toks) for i, toks in chunks])
        start = 0
        for i, toks in chunks:
            got[i].append(logits[start:start + len(toks)])
            start += len(toks)
            done[i] += len(toks)
    for _ in range(6):
        nxt = [int(g[-1][-1].argmax()) for g in got]
        logits = pool.step(model, [(rid, [t]) for rid, t in zip(rids, nxt)])
        for i, t in enumerate(nxt):
            tokens[i].append(t)
            got[i].append(logits[i:i + 1])
    for i, toks in enumerate(tokens):
        # the last decoded token's logits were produced too; compare every position up to it
        ours = torch.cat(got[i])
        assert ours.shape[0] == len(toks)
        assert (ours - _full_logits(model, toks)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("variant", ["moe", "safe_gate"])
def test_checkpoints_equal_a_run_stopped_there(kimi_checkpoint, variant):
    """Checkpoints exported mid-step (p = 1, 7, 16 of a 16-token chunk after 21 cached tokens)
    equal the state of a run that stopped after 21 + p tokens; resuming from one continues
    exactly."""
    model = load_model(kimi_checkpoint(variant))
    seq = _seqs()[1]
    pool = ToyPool(model, num_slots=8, num_pages=64, page_size=4)
    rid = pool.add()
    pool.step(model, [(rid, seq[:21])])
    dests = {p: pool.take_slot() for p in (1, 7, 16)}
    pool.step(model, [(rid, seq[21:37])], checkpoints=[[(p, d) for p, d in dests.items()]])
    for p, dest in dests.items():
        other = ToyPool(model, num_slots=2, num_pages=64, page_size=4)
        r = other.add()
        other.step(model, [(r, seq[:21 + p])])
        for mine, theirs in zip(pool.cache.linear_layers, other.cache.linear_layers):
            for a, b in zip(mine.tensors(), theirs.tensors()):
                assert (a[dest] - b[other.slots[r]]).abs().max().item() <= 1e-5

    # Resume a new request from the p=7 checkpoint: its KV is the original's first 28 tokens.
    resumed = pool.add()
    pool.cache.copy_slot(dests[7], pool.slots[resumed])
    pool.tables[resumed] = pool.tables[rid][:7]  # pages 0..6 hold positions 0..27
    pool.lens[resumed] = 28
    logits = pool.step(model, [(resumed, seq[28:45])])
    assert (logits - _full_logits(model, seq[:45])[28:]).abs().max().item() <= 1e-4


def test_one_token_prompts_reuse_dirty_slots(kimi_checkpoint):
    """A decode-shaped step can also start requests (context 0): their slots must not leak
    the state a previous request left behind."""
    model = load_model(kimi_checkpoint("moe"))
    pool = ToyPool(model, num_slots=2, num_pages=16, page_size=4)
    a = pool.add()
    pool.step(model, [(a, [5, 6, 7, 8, 9])])
    pool.free_slots.append(pool.slots.pop(a))  # request a finishes; its slot is dirty
    b, c = pool.add(), pool.add()
    logits = pool.step(model, [(b, [11]), (c, [12])])
    assert (logits[0] - _full_logits(model, [11])[0]).abs().max() <= 1e-4
    assert (logits[1] - _full_logits(model, [12])[0]).abs().max() <= 1e-4


def test_allocate_cache_shapes_and_bytes(kimi_checkpoint):
    model = load_model(kimi_checkpoint("moe"))  # KDA: 2 heads x 32; MLA: kv_lora 48 + rope 16
    cache = model.allocate_cache(num_slots=3, num_pages=5, page_size=16)
    assert [type(c).__name__ for c in cache.layers] == ["KDALayerCache", "MLALayerCache"] * 2
    kda, mla = cache.layers[0], cache.layers[1]
    assert kda.state.shape == (3, 2, 32, 32) and kda.state.dtype == torch.float32
    assert kda.state.stride() == (2 * 32 * 32, 32 * 32, 1, 32), "K-last (hyla.contract.state_pool)"
    assert [t.shape for t in kda.conv] == [(3, 64, 3)] * 3
    assert mla.kv.shape == (5, 16, 64)
    assert model.state_bytes_per_slot() == 2 * (2 * 32 * 32 * 4 + 3 * 64 * 3 * 4)
    assert model.kv_bytes_per_token() == 2 * 64 * 4
    assert cache.nbytes() == 3 * model.state_bytes_per_slot() + 5 * 16 * model.kv_bytes_per_token()
    with pytest.raises(ValueError, match="slot"):
        cache.copy_slot(0, 3)
