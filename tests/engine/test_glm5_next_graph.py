"""GLM-5-Next through the CUDA-graph runner's fixed-shape inputs (CUDAGraphRunner(capture=False),
on the CPU): decode and speculative verify steps, whose DSA indexer runs a fixed-size top-k over
every pooled key the padded block tables reach and whose sparse attention gathers the selected
latents by index, equal the eager steps with every host sync failing (tests.engine.test_cuda_graph's
guard, plus nonzero / boolean-mask indexing / unique, whose shapes depend on values), at contexts past index_topk * index_kpool (the selection drops pools), with a "shared"
indexer layer (hc2) and with kpool 2 / no tail selection (hc4)."""

import pytest
import torch

from hyla.contract import ForwardBatch, KDALayerCache
from hyla.engine.cuda_graph import SCRATCH, graph_safe, use_cuda_graphs, width_bucket
from hyla.engine.cuda_graph_verify import CUDAGraphRunner
from hyla.models import load_model
from tests.engine.test_cuda_graph import _capture_mode
from tests.oracles.glm5_next_checkpoint import build_glm5_next_checkpoint, one_thread  # noqa: F401

PAGE = 16
TOL = dict(rtol=1e-10, atol=1e-10)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("glm5-graph")


def _model(root, variant: str):
    model = load_model(build_glm5_next_checkpoint(root, variant), dtype=torch.float64)
    c = model.config
    assert graph_safe(model) and not use_cuda_graphs(model, enforce_eager=False)  # allowed; CPU: off
    return model, c.index_topk // c.index_kpool * c.index_kpool  # the positions a selection keeps at most


def _shape_guard(monkeypatch, nosync) -> None:
    """Beyond reads of values (the shared guard), fail on what gives a data-dependent shape while
    `nosync.on`: nonzero, masked_select, unique, and indexing with a boolean mask (all sync on
    CUDA and cannot be captured)."""
    def fail(name):
        raise AssertionError(f"data-dependent shape ({name}) inside the captured region")

    for owner, name in ((torch, "nonzero"), (torch.Tensor, "nonzero"), (torch, "masked_select"),
                        (torch.Tensor, "masked_select"), (torch, "unique"), (torch.Tensor, "unique"),
                        (torch, "argwhere")):
        original = getattr(owner, name)

        def guarded(*a, _original=original, _name=name, **kw):
            if nosync.on:
                fail(_name)
            return _original(*a, **kw)
        monkeypatch.setattr(owner, name, guarded)

    def boolean(index) -> bool:
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)

    get, put = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def getitem(t, index):
        if nosync.on and boolean(index):
            fail("boolean-mask indexing")
        return get(t, index)

    def setitem(t, index, value):
        if nosync.on and boolean(index):
            fail("boolean-mask assignment")
        return put(t, index, value)
    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)
    monkeypatch.setattr(torch.Tensor, "__setitem__", setitem)


def _caches(model, slots: int, pages: int, gen: torch.Generator):
    """(eager pools, graph pools with one scratch slot and page more), the same garbage in both."""
    eager = model.allocate_cache(slots, pages, page_size=PAGE)
    graph = model.allocate_cache(slots + SCRATCH, pages + SCRATCH, page_size=PAGE)
    for a, b in zip(eager.layers, graph.layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            tb.copy_(torch.randn(tb.shape, generator=gen, dtype=tb.dtype))  # garbage, never zeros
            ta.copy_(tb[:ta.shape[0]])
    return eager, graph


def _sync(eager, graph) -> None:
    """Copy eager's pools into graph's (after an eager prefill of both)."""
    for a, b in zip(eager.layers, graph.layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            tb[:ta.shape[0]] = ta


def _tables(lens: list[int], extra: list[int]) -> tuple[list[list[int]], int]:
    """Page tables (out of order on purpose) for n + e tokens per sequence -> (tables, pages)."""
    tables, first = [], 0
    for n, e in zip(lens, extra):
        need = -(-(n + e) // PAGE)
        tables.append(list(range(first, first + need))[::-1])
        first += need
    return tables, first


@pytest.mark.parametrize("variant", ["hc2", "hc4"])
def test_padded_decode_equals_eager_without_syncs(root, variant, monkeypatch):
    """Prefilled sequences (short, at a page boundary, well past the selection budget) and a
    one-token prompt whose slot holds garbage decode 4 greedy steps: the padded inputs (5 rows ->
    bucket 8, slots -1, pages -1) give eager's logits and leave every pool row the requests own
    (KDA states, latents, indexer rows and pooled keys) exactly as eager does."""
    model, budget = _model(root, variant)
    steps, gen = 4, torch.Generator().manual_seed(0)
    lens = [5, 16, 2 * budget + 3, 3 * budget + 7]
    assert max(lens) + steps > 2 * budget  # decode selects from more pools than it keeps
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    seq_slots = [3, 0, 5, 1, 4]
    tables, pages = _tables(lens + [1], [steps] * 5)
    eager, graph = _caches(model, 8, pages, gen)
    batch = ForwardBatch.build(lens, [0] * 4, tables[:4], seq_slots[:4])
    with torch.inference_mode():
        hidden = model.forward_batch(torch.tensor([t for p in prompts for t in p]), batch, eager)
    _sync(eager, graph)
    cu = batch.cu_seqlens_list
    tokens = [int(model.compute_logits(hidden[cu[i + 1] - 1]).argmax()) for i in range(4)] + [7]
    ctx = lens + [0]

    runner = CUDAGraphRunner(model, graph, max_batch=8, capture=False)
    _shape_guard(monkeypatch, _capture_mode(monkeypatch, runner, "_forward", "fused_recurrent_kda"))
    for _ in range(steps):
        step = ForwardBatch.build([1] * 5, ctx, tables, seq_slots)
        with torch.inference_mode():
            want = model.compute_logits(model.forward_batch(torch.tensor(tokens), step, eager))
            got = runner.run_decode(tokens, ctx, seq_slots, tables)
        assert runner._key == (8, width_bucket(max(-(-(c + 1) // PAGE) for c in ctx)))
        torch.testing.assert_close(got, want, **TOL)
        for a, b in zip(eager.layers, graph.layers):
            for ta, tb in zip(a.tensors(), b.tensors()):
                torch.testing.assert_close(tb[:ta.shape[0]], ta, **TOL)
        tokens = want.argmax(-1).tolist()  # greedy: the next step's inputs
        ctx = [c + 1 for c in ctx]


@pytest.mark.parametrize("rollback", ["slots", "replay"])
def test_padded_verify_equals_eager_without_syncs(root, rollback, monkeypatch):
    """A verify step padded to W = 1 + k (drafts of 0..k tokens, 3 rows -> bucket 4) gives the
    eager verify's logits at every real position; after accepting a different count per row, the
    KDA state each row continues from, the latents and indexer rows of kept positions and the
    pooled keys of complete pools equal eager's, and the next decode step gives eager's logits
    (the padding positions' writes are never selected)."""
    model, budget = _model(root, "hc2")
    P = model.config.index_kpool
    k, gen = 3, torch.Generator().manual_seed(2)
    W = 1 + k
    lens = [14, 2 * budget + 1, 3 * budget + 2]  # drafts complete a pool in row 0 (14 + 3 > 16)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    drafts = [[5, 9, 11], [], [4]]
    accepted = [3, 1, 2]
    spec_slots = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    start = [1, 0, 3]
    tables, pages = _tables(lens, [1 + len(d) for d in drafts])  # real tokens only: padding may fall off
    eager, graph = _caches(model, 12, pages + 2, gen)
    cur = [sl[i] for sl, i in zip(spec_slots, start)]
    batch = ForwardBatch.build([n - 1 for n in lens], [0] * 3, tables, cur)
    with torch.inference_mode():
        model.forward_batch(torch.tensor([t for p in prompts for t in p[:-1]]), batch, eager)
    _sync(eager, graph)
    ctx = [n - 1 for n in lens]
    rows = spec_slots if rollback == "slots" else [[s] for s in cur]
    acc = [i + 1 for i in start] if rollback == "slots" else [1] * 3
    step = ForwardBatch.build([1 + len(d) for d in drafts], ctx, tables, rows, num_accepted_tokens=acc,
                              rollback=rollback)
    ids = [t for p, d in zip(prompts, drafts) for t in [p[-1], *d]]
    with torch.inference_mode():
        want = model.compute_logits(model.forward_batch(torch.tensor(ids), step, eager))

    runner = CUDAGraphRunner(model, graph, max_batch=12, capture=False)
    nosync = _capture_mode(monkeypatch, runner, "_verify_forward", "fused_recurrent_kda")
    _shape_guard(monkeypatch, nosync)
    tokens = [[p[-1], *d] + [0] * (k - len(d)) for p, d in zip(prompts, drafts)]
    got = runner.run_verify(tokens, ctx, rows, acc, tables, rollback)  # [3, W, V]
    assert got.shape[:2] == (3, W) and runner.verify_key[0] == 4
    torch.testing.assert_close(torch.cat([got[n, :1 + len(d)] for n, d in enumerate(drafts)]), want, **TOL)

    if rollback == "replay":
        model.commit_replay(eager, accepted)
        nosync.on = True  # the commit has a fixed shape too (captured with the verify)
        runner.commit_replay(accepted)
        nosync.on = False
        nxt = cur
    else:
        nxt = [sl[a - 1] for sl, a in zip(spec_slots, accepted)]
    for a, b in zip(eager.layers, graph.layers):
        pools = list(zip(a.tensors(), b.tensors()))
        if isinstance(a, KDALayerCache):  # the slots requests continue from
            for ta, tb in pools:
                torch.testing.assert_close(tb[nxt], ta[nxt], **TOL)
            continue
        for n, (c, m) in enumerate(zip(ctx, accepted)):
            kept = c + m
            for pos in range(kept):
                page, off = tables[n][pos // PAGE], pos % PAGE
                for ta, tb in pools[:2]:  # latents, indexer rows
                    torch.testing.assert_close(tb[page, off], ta[page, off], **TOL)
                if len(pools) == 3 and pos % P == P - 1:  # the pooled key of a complete pool
                    torch.testing.assert_close(pools[2][1][page, off // P], pools[2][0][page, off // P], **TOL)
    last = [ids[sum(1 + len(d) for d in drafts[:n]) + m - 1] for n, m in enumerate(accepted)]
    step = ForwardBatch.build([1] * 3, [c + m for c, m in zip(ctx, accepted)], tables, nxt)
    with torch.inference_mode():
        want = model.compute_logits(model.forward_batch(torch.tensor(last), step, eager))
        got = model.compute_logits(model.forward_batch(torch.tensor(last), step, graph))
    torch.testing.assert_close(got, want, **TOL)
