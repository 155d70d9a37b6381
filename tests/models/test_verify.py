"""Speculative verify through forward_batch, both families: per-position state slots and replay
rollback leave exactly the state of feeding the accepted tokens one by one, and the verify
logits equal plain decoding. Tolerances: logits come back in fp32 and the state pool is fp32,
which the sequential reference rounds to after every token and the verify path once per step."""

import pytest
import torch

from hyla.contract import ForwardBatch
from hyla.models import load_model
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.oracles.paged import ToyPool
from tests.oracles.qwen3_next_checkpoint import build_qwen3_next_checkpoint


@pytest.fixture(scope="module", params=["kimi", "qwen3_next"])
def model(request, tmp_path_factory):
    build = build_kimi_checkpoint if request.param == "kimi" else build_qwen3_next_checkpoint
    return load_model(build(tmp_path_factory.mktemp("verify"), "moe"), dtype=torch.float64)


def _rand(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _linear_states(pool, slot):
    return [torch.cat([t[slot].flatten() for t in c.tensors()]) for c in pool.cache.linear_layers]


@pytest.mark.parametrize("rollback", ["slots", "replay"])
def test_verify_then_accept_equals_sequential_decode(model, rollback):
    prompts = [_rand(21, 1), _rand(9, 2), _rand(14, 5)]
    drafts = [_rand(4, 3), _rand(2, 4), _rand(3, 6)]  # x0 + drafts
    accept = [2, 1, 3]  # fed tokens kept

    ref = ToyPool(model, num_slots=4, num_pages=64)
    r_ids = [ref.add() for _ in prompts]
    ref.step(model, list(zip(r_ids, prompts)))
    ref_logits = [[] for _ in prompts]
    for j in range(max(map(len, drafts))):
        live = [(i, rid) for i, rid in enumerate(r_ids) if j < len(drafts[i])]
        out = ref.step(model, [(rid, [drafts[i][j]]) for i, rid in live])
        for (i, _), row in zip(live, out):
            ref_logits[i].append(row)
    ref2 = ToyPool(model, num_slots=4, num_pages=64)
    r2 = [ref2.add() for _ in prompts]
    ref2.step(model, list(zip(r2, prompts)))
    for j in range(max(accept)):
        ref2.step(model, [(rid, [drafts[i][j]]) for i, rid in enumerate(r2) if j < accept[i]])

    pool = ToyPool(model, num_slots=16, num_pages=64)
    ids = [pool.add() for _ in prompts]
    pool.step(model, list(zip(ids, prompts)))
    rows = [[pool.slots[rid]] + [pool.take_slot() for _ in range(3)] for rid in ids]
    for rid, d in zip(ids, drafts):
        need = -(-(pool.lens[rid] + len(d)) // pool.page_size)
        while len(pool.tables[rid]) < need:
            pool.tables[rid].append(pool.free_pages.pop())
    batch = ForwardBatch.build([len(d) for d in drafts], [pool.lens[r] for r in ids], [pool.tables[r] for r in ids],
                               rows, device=model.device, num_accepted_tokens=[1] * 3, rollback=rollback)
    with torch.no_grad():
        logits = model.compute_logits(model.forward_batch(torch.tensor(sum(drafts, [])), batch, pool.cache))
    cu = batch.cu_seqlens_list
    for i in range(3):
        assert torch.allclose(logits[cu[i]:cu[i + 1]], torch.stack(ref_logits[i]), atol=2e-5, rtol=0)

    if rollback == "replay":
        model.commit_replay(pool.cache, accept)
        current = [row[0] for row in rows]
    else:
        current = [row[a - 1] for row, a in zip(rows, accept)]
    for i in range(3):
        for mine, want in zip(_linear_states(pool, current[i]), _linear_states(ref2, ref2.slots[r2[i]])):
            assert torch.allclose(mine.double(), want.double(), atol=2e-6, rtol=0)
