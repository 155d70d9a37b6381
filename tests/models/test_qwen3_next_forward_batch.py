"""Qwen3-Next's cache-driven forward (paged KV + GDN state slots) equals its full forward."""

import pytest
import torch

from hyla.models import load_model
from tests.oracles.paged import ToyPool


def _seqs():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (37, 70, 9, 1)]


def _full_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0]


@pytest.mark.parametrize("variant", ["moe", "dense"])
def test_chunked_prefill_then_batched_decode(qwen3_next_checkpoint, variant):
    """Four sequences: prefill in pieces of 16 (several sequences per step, varlen, one-token
    pieces among them), then 6 batched decode steps; every token's logits equal the full forward."""
    model = load_model(qwen3_next_checkpoint(variant))
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
        ours = torch.cat(got[i])
        assert ours.shape[0] == len(toks)
        assert (ours - _full_logits(model, toks)).abs().max().item() <= 1e-4


def test_checkpoints_equal_a_run_stopped_there(qwen3_next_checkpoint):
    """State + conv-window checkpoints exported mid-step (p = 1, 7, 16 after 21 cached tokens)
    equal a run stopped after 21 + p tokens; a request resumed from one continues exactly."""
    model = load_model(qwen3_next_checkpoint("moe"))
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
    resumed = pool.add()
    pool.cache.copy_slot(dests[7], pool.slots[resumed])
    pool.tables[resumed] = pool.tables[rid][:7]  # pages 0..6 hold positions 0..27
    pool.lens[resumed] = 28
    logits = pool.step(model, [(resumed, seq[28:45])])
    assert (logits - _full_logits(model, seq[:45])[28:]).abs().max().item() <= 1e-4


def test_one_token_prompts_reuse_dirty_slots(qwen3_next_checkpoint):
    model = load_model(qwen3_next_checkpoint("moe"))
    pool = ToyPool(model, num_slots=2, num_pages=16, page_size=4)
    a = pool.add()
    pool.step(model, [(a, [5, 6, 7, 8, 9])])
    pool.free_slots.append(pool.slots.pop(a))  # request a finishes; its slot is dirty
    b, c = pool.add(), pool.add()
    logits = pool.step(model, [(b, [11]), (c, [12])])
    assert (logits[0] - _full_logits(model, [11])[0]).abs().max() <= 1e-4
    assert (logits[1] - _full_logits(model, [12])[0]).abs().max() <= 1e-4


def test_allocate_cache_shapes_and_bytes(qwen3_next_checkpoint):
    model = load_model(qwen3_next_checkpoint("moe"))  # GDN: HV 4, K 16, V 24, conv 160; attn: 2 KV heads x 32
    cache = model.allocate_cache(num_slots=3, num_pages=5, page_size=16)
    assert [type(c).__name__ for c in cache.layers] == ["GDNLayerCache"] * 3 + ["KVLayerCache"]
    assert len(cache.linear_layers) == 3 and len(cache.attention_layers) == 1
    gdn, attn = cache.layers[0], cache.layers[3]
    assert gdn.state.stride() == (4 * 24 * 16, 24 * 16, 1, 16), "K-last (hyla.contract.state_pool)"
    assert gdn.state.shape == (3, 4, 16, 24) and gdn.state.dtype == torch.float32
    assert [t.shape for t in gdn.conv] == [(3, 160, 3)]
    assert attn.k.shape == attn.v.shape == (5, 16, 2, 32)
    assert model.state_bytes_per_slot() == 3 * (4 * 16 * 24 * 4 + 160 * 3 * 4)
    assert model.kv_bytes_per_token() == 2 * 2 * 32 * 4
    assert cache.nbytes() == 3 * model.state_bytes_per_slot() + 5 * 16 * model.kv_bytes_per_token()
    cache.layers[3].k[2, :5] = 1.0
    cache.copy_page_rows(2, 4, 5)
    assert (cache.layers[3].k[4, :5] == 1).all() and (cache.layers[3].k[4, 5:] == 0).all()
    cache.layers[0].conv[0][1] = 2.0
    cache.copy_slot(1, 0)
    assert (cache.layers[0].conv[0][0] == 2).all()
    cache.zero_slot(0)
    assert (cache.layers[0].conv[0][0] == 0).all()
