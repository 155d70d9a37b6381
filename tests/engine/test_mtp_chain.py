"""MTP's greedy fast path, on the CPU (on a CUDA machine too: the fp64 model forced onto a graph
runner could not be captured there): the draft steps chained on the device (HeadStepGraphs.run_chain,
run eagerly with capture off: the same buffers and padding as the graph) draft exactly the
tokens of the per-step path, write the same head KV rows, and write nothing outside the requests'
pages but the scratch page; the engine takes it whenever every drafting request is greedy and
keeps the per-step path for a batch with a sampling request."""

import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.engine import model_runner
from hyla.engine.spec.mtp.drafter import MTPDrafter
from tests.engine.test_mtp_graph import build_leaky_head
from tests.oracles.variants import rand_tokens as rand

PROMPTS = [rand(12, 1) * 3, [7], rand(5, 3) * 4, rand(20, 4), rand(40, 5)]  # the last: across pages
# requests finish at different steps: near its end a request drafts fewer (mixed ks in one batch)
PARAMS = [SamplingParams(temperature=0.0, max_tokens=5 + 4 * i, ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # the MoE checkpoint's target repeats itself now and then: partial acceptance
    return build_leaky_head(tmp_path_factory.mktemp("mtp-chain"), variant=("moe", "multimodal"))


@pytest.fixture(scope="module")
def plain(ckpt):
    llm = LLM(str(ckpt), dtype="float64", device="cpu")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _engine(ckpt, k: int, rollback: str, prefix_cache: bool, monkeypatch, graphs: bool = True) -> LLM:
    with monkeypatch.context() as m:
        if graphs:  # a CUDAGraphRunner with capture off: HeadStepGraphs run eagerly
            m.setattr(model_runner, "use_cuda_graphs", lambda model, eager: True)
        llm = LLM(str(ckpt), dtype="float64", device="cpu", max_num_seqs=len(PROMPTS), enable_prefix_caching=prefix_cache,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k, "rollback": rollback})
    llm.engine.spec.drafter.fused = None  # the unfused step (the fused one: test_mtp_fused.py)
    return llm


def _record(drafter) -> list:
    """Wrap drafter's propose and its two drafting paths -> a list that collects, per propose
    call with requests drafting, (path, [(request, k asked, drafts)])."""
    calls, path = [], []
    for name in ("_chained_drafts", "_stepped_drafts"):
        inner = getattr(drafter, name)

        def counted(*a, _inner=inner, _name=name, **kw):
            path.append(_name)
            return _inner(*a, **kw)
        setattr(drafter, name, counted)
    propose = drafter.propose

    def record(seqs, ks, generator=None):
        path.clear()
        out = propose(seqs, ks, generator)
        if path:
            calls.append((path[0], [(s.request_id, k, d) for s, k, (d, _) in zip(seqs, ks, out)]))
        return out
    drafter.propose = record
    return calls


def _generate(llm, prompts=PROMPTS, params=PARAMS, passes: int = 1) -> list:
    outs = []
    for _ in range(passes):  # a second pass hits the prefix cache (a head view starting past 0)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    return outs


@pytest.mark.parametrize("k,rollback,prefix_cache", [
    (1, "replay", False), (1, "slots", True), (2, "slots", False), (2, "replay", True), (3, "slots", True),
    (3, "replay", False),
])
def test_chained_drafts_equal_stepped_drafts(ckpt, plain, k, rollback, prefix_cache, monkeypatch):
    """Greedy requests with mixed ks: the chained path is taken at every propose, drafts the
    per-step path's tokens exactly, and the output is plain greedy."""
    passes = 2 if prefix_cache else 1
    chained = _engine(ckpt, k, rollback, prefix_cache, monkeypatch)
    chained_calls = _record(chained.engine.spec.drafter)
    with monkeypatch.context() as m:
        m.setattr(MTPDrafter, "_chains", lambda self, seqs, k: False)  # the per-step path, same graphs
        stepped = _engine(ckpt, k, rollback, prefix_cache, monkeypatch)
        stepped_calls = _record(stepped.engine.spec.drafter)
        want = _generate(stepped, passes=passes)
    got = _generate(chained, passes=passes)
    assert got == want == [plain] * passes
    assert chained_calls and {p for p, _ in chained_calls} == {"_chained_drafts"}  # the fast path, every time
    assert {p for p, _ in stepped_calls} == {"_stepped_drafts"}
    assert [c for _, c in chained_calls] == [c for _, c in stepped_calls]
    assert all(len(d) == min(ks, len(d)) for _, c in chained_calls for _, ks, d in c)
    if k > 1:  # a batch whose requests asked for different numbers of drafts took the fast path
        assert any(len({ks for _, ks, d in c if d}) > 1 for _, c in chained_calls)
        assert {key[1] for key in chained.engine.spec.drafter.step_graphs.chains} == set(range(2, k + 1))
    if prefix_cache:
        assert chained.get_metrics()["prefix_cache_hit_tokens"] > 0
    m = chained.get_metrics()
    assert 0 < m["spec_num_accepted_tokens"] < m["spec_num_draft_tokens"]


def test_sampling_in_the_batch_keeps_the_per_step_path(ckpt, plain, monkeypatch):
    """Seeded sampling requests beside greedy ones: a propose with a sampling request drafts one
    step at a time (once the sampling requests finished, the greedy rest chains); the greedy
    requests give plain greedy, the sampling ones what the engine without head graphs (eager
    head steps, the per-step path throughout) gives."""
    params = [p if i % 2 else SamplingParams(temperature=0.8, seed=i, max_tokens=4 + i, ignore_eos=True)
              for i, p in enumerate(PARAMS)]
    want = _generate(_engine(ckpt, 3, "slots", False, monkeypatch, graphs=False), params=params)[0]
    llm = _engine(ckpt, 3, "slots", False, monkeypatch)
    calls = _record(llm.engine.spec.drafter)
    sampled = {f"offline-{i}" for i, p in enumerate(params) if not p.greedy}
    got = _generate(llm, params=params)[0]
    assert got == want
    assert [got[i] for i in range(1, len(PROMPTS), 2)] == [plain[i] for i in range(1, len(PROMPTS), 2)]
    with_sampling = [p for p, c in calls if any(r in sampled and d for r, _, d in c)]
    assert with_sampling and set(with_sampling) == {"_stepped_drafts"}
    assert "_chained_drafts" in {p for p, _ in calls}


def test_no_chain_under_tensor_parallelism_or_without_graphs(ckpt, monkeypatch):
    """The fast path needs head-step graphs and no model group (each step's tokens are broadcast)."""
    llm = _engine(ckpt, 2, "slots", False, monkeypatch)
    drafter = llm.engine.spec.drafter
    seqs = [type("S", (), {"params": PARAMS[0]})()] * 2
    assert drafter._chains(seqs, 2)
    assert not drafter._chains(seqs + [type("S", (), {"params": SamplingParams(temperature=1.0)})()], 2)
    drafter.group = object()
    assert not drafter._chains(seqs, 2)
    eager = _engine(ckpt, 2, "slots", False, monkeypatch, graphs=False).engine.spec.drafter
    assert eager.step_graphs is None and not eager._chains(seqs, 2)


def test_run_chain_equals_head_steps_and_writes_only_its_pages(ckpt, monkeypatch):
    """run_chain (3 drafts, the ops in their capture paths, host syncs failing inside) gives the
    drafts of one-row head steps run one by one (HeadStepGraphs.run) for what each request asked
    (3, 3, 1, 2) and their head KV rows; the row of the request that asked for 1 draft past its
    block table lands in the scratch page, and every page outside the four tables is untouched."""
    from hyla.engine.cuda_graph import SCRATCH
    from hyla.engine.cuda_graph_verify import CUDAGraphRunner, HeadStepGraphs
    from hyla.models import load_model
    from hyla.models.qwen3_5_mtp import load_mtp_head
    from tests.engine.test_cuda_graph import _capture_mode

    model = load_model(ckpt, dtype=torch.float64)
    head = load_mtp_head(ckpt, model)
    gen = torch.Generator().manual_seed(7)
    pages, page = 10, 16  # page index `pages`: the scratch page
    kv_chain, kv_steps = head.allocate_kv(pages + SCRATCH, page), head.allocate_kv(pages + SCRATCH, page)
    for a, b in zip(kv_chain.tensors(), kv_steps.tensors()):
        a.copy_(torch.randn(a.shape, generator=gen, dtype=a.dtype))  # garbage, never zeros
        b.copy_(a)
    before = [t.clone() for t in kv_chain.tensors()]
    runner = CUDAGraphRunner(model, model.allocate_cache(4 + SCRATCH, pages + SCRATCH, page_size=page), max_batch=4,
                             capture=False)
    chain = HeadStepGraphs(runner, head, model, kv_chain, max_width=4)
    steps = HeadStepGraphs(runner, head, model, kv_steps, max_width=4)
    _capture_mode(monkeypatch, chain, "_chain_forward", "fused_recurrent_gated_delta_rule")
    # head rows already in each table; four requests: no padding row writes the scratch page.
    # The third's two steps write rows 31 (in its last page) and 32 (past its table: scratch);
    # the fourth's second step writes row 41, in its own page.
    ks, context, tables = [3, 3, 1, 2], [5, 16, 31, 40], [[1], [3, 2], [6, 5], [7, 4, 0]]
    y = torch.randn(4, model.config.hidden_size, generator=gen, dtype=torch.float64)
    logits = model.compute_logits(y)
    got = chain.run_chain(y, logits, 3, context, tables).tolist()
    want = [[d] for d in logits.argmax(-1).tolist()]
    live = [0, 1, 2, 3]
    for j in range(1, 3):  # the per-step path: only the requests asking for more drafts step
        prev, live = live, [n for n in live if ks[n] > j]
        y, step_logits = steps.run(y[[prev.index(n) for n in live]], [want[n][-1] for n in live], [1] * len(live),
                                   [context[n] + j - 1 for n in live], [tables[n] for n in live])
        for n, d in zip(live, step_logits.argmax(-1).tolist()):
            want[n].append(d)
    assert [d[:k] for d, k in zip(got, ks)] == want
    assert all(len(d) == 3 for d in got)  # every request's 3 drafts come back (the caller drops extras)
    for table, c, k in zip(tables, context, ks):  # the rows the kept drafts' steps wrote
        for pos in range(c, c + k - 1):
            for a, b in zip(kv_chain.tensors(), kv_steps.tensors()):
                torch.testing.assert_close(a[table[pos // page], pos % page], b[table[pos // page], pos % page],
                                           rtol=1e-10, atol=1e-10)
    owned = {p for t in tables for p in t}
    for a, b in zip(kv_chain.tensors(), before):
        for p in set(range(pages)) - owned:
            assert torch.equal(a[p], b[p]), f"page {p}, owned by no request, was written"
        assert not torch.equal(a[pages, 0], b[pages, 0])  # row 32 of the third request (offset 0)
        assert torch.equal(a[pages, 1:], b[pages, 1:])
