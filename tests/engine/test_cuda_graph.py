"""CUDA-graph decode (hyla.engine.cuda_graph): replayed steps equal eager steps token for token.

The graph's padded, fixed-shape inputs also run on the CPU (CUDAGraphRunner(capture=False)) with
every host sync made to fail and the ops in their capture mode, so the padding / scratch logic
is checked without a GPU; the capture itself needs CUDA.
"""

import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.bench.throughput import random_checkpoint
from hyla.engine import cuda_graph
from hyla.engine.cuda_graph import SCRATCH, batch_buckets, width_bucket
from hyla.engine.cuda_graph_verify import CUDAGraphRunner
from hyla.contract import ForwardBatch
from hyla.models import load_model
from hyla.ops import dispatch, utils

PAGE = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("graph"), "tiny")


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert [width_bucket(p) for p in (1, 2, 3, 4, 5, 7, 9, 13, 17, 33)] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]


class _NoSync:
    """Makes host reads of tensors fail while `on` (a CUDA graph capture would fail there)."""

    def __init__(self, monkeypatch):
        self.on = False
        for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._guard(original, name))

    def _guard(self, original, name):
        def guarded(t, *a, **k):
            if self.on:
                raise AssertionError(f"host sync (Tensor.{name}) inside the captured region")
            return original(t, *a, **k)
        return guarded


def _capture_mode(monkeypatch, runner, method: str, recurrent_name: str) -> _NoSync:
    """Run `runner.<method>` as a capture would: the ops in their capture paths and every host
    sync failing inside it, except in the torch recurrence standing in for the (sync-free)
    Triton kernel. Returns the guard (its `on` can also be set around other calls)."""
    nosync = _NoSync(monkeypatch)
    monkeypatch.setattr(utils, "is_capturing", lambda t: True)
    recurrent = getattr(dispatch, recurrent_name)

    def torch_recurrent(*a, **kw):
        on, nosync.on = nosync.on, False
        try:
            return recurrent(*a, **kw)
        finally:
            nosync.on = on
    monkeypatch.setattr(dispatch, recurrent_name, torch_recurrent)
    inner = getattr(runner, method)

    def guarded(*a):
        nosync.on = True
        try:
            return inner(*a)
        finally:
            nosync.on = False
    monkeypatch.setattr(runner, method, guarded)
    return nosync


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    from tests.oracles.qwen3_next_checkpoint import build_qwen3_next_checkpoint

    return build_qwen3_next_checkpoint(tmp_path_factory.mktemp("graph-qwen"), "dense")


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory):
    from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
    from tests.oracles.qwen3_next_checkpoint import build_qwen3_next_checkpoint

    root = tmp_path_factory.mktemp("graph-moe")
    return {"kimi_moe": build_kimi_checkpoint(root, "moe"), "qwen3_next_moe": build_qwen3_next_checkpoint(root, "moe")}


@pytest.mark.parametrize("family", ["kimi", "qwen3_next", "kimi_moe", "qwen3_next_moe"])
def test_padded_decode_equals_eager_cpu(ckpt, qwen_ckpt, moe_ckpts, family, monkeypatch):
    """Prefilled sequences (contexts across page boundaries) and a one-token prompt whose slot
    holds garbage decode 4 steps: the padded graph inputs (5 rows -> bucket 8, slots -1, pages -1)
    give the eager logits and leave every pool row a request owns exactly as eager does. Both
    families (KDA + MLA, Gated DeltaNet + gated attention), dense and MoE (16 experts: routing
    and the sorted grouped experts run with every host sync failing)."""
    path = {"kimi": ckpt, "qwen3_next": qwen_ckpt}.get(family) or moe_ckpts[family]
    model = load_model(path, dtype=torch.float64)
    recurrent_name = "fused_recurrent_kda" if family.startswith("kimi") else "fused_recurrent_gated_delta_rule"
    steps = 4
    gen = torch.Generator().manual_seed(0)
    lens = [5, 16, 17, 40]
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    seq_slots = [3, 0, 5, 1, 4]  # the last one: a one-token prompt that starts in decode
    tables, first = [], 0
    for n in lens + [1]:
        need = -(-(n + steps) // PAGE)
        tables.append(list(range(first, first + need))[::-1])  # out of order on purpose
        first += need
    slots, pages = 8, first
    eager = model.allocate_cache(slots, pages, page_size=PAGE)
    graph = model.allocate_cache(slots + SCRATCH, pages + SCRATCH, page_size=PAGE)
    for a, b in zip(eager.layers, graph.layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            tb.copy_(torch.randn(tb.shape, generator=gen, dtype=tb.dtype))  # garbage, never zeros
            ta.copy_(tb[:ta.shape[0]])
    batch = ForwardBatch.build(lens, [0] * 4, tables[:4], seq_slots[:4])
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.inference_mode():
        hidden = model.forward_batch(ids, batch, eager)
    for a, b in zip(eager.layers, graph.layers):  # the prefilled state, in both caches
        for ta, tb in zip(a.tensors(), b.tensors()):
            tb[:ta.shape[0]] = ta
    cu = batch.cu_seqlens_list
    tokens = [int(model.compute_logits(hidden[cu[i + 1] - 1]).argmax()) for i in range(4)] + [7]
    ctx = lens + [0]

    runner = CUDAGraphRunner(model, graph, max_batch=slots, capture=False)
    nosync = _capture_mode(monkeypatch, runner, "_forward", recurrent_name)
    built = []  # the host staging buffers: two per page width, built once (pinned on CUDA)
    monkeypatch.setattr(cuda_graph._MetaStage, "__init__",
                        lambda self, *a, _init=cuda_graph._MetaStage.__init__: (built.append(a), _init(self, *a))[1])

    for _ in range(steps):
        step = ForwardBatch.build([1] * 5, ctx, tables, seq_slots)
        with torch.inference_mode():
            want = model.compute_logits(model.forward_batch(torch.tensor(tokens), step, eager))
            got = runner.run_decode(tokens, ctx, seq_slots, tables)
        assert runner._key == (8, width_bucket(max(-(-(c + 1) // PAGE) for c in ctx)))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        for a, b in zip(eager.layers, graph.layers):
            for ta, tb in zip(a.tensors(), b.tensors()):
                torch.testing.assert_close(tb[:ta.shape[0]], ta, rtol=1e-10, atol=1e-10)
        tokens = want.argmax(-1).tolist()
        ctx = [c + 1 for c in ctx]
    assert len(built) == 2 * len(runner._stages), built


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("family", ["kimi", "kimi_moe", "qwen3_next_moe"])
def test_graph_decode_equals_eager_cuda(ckpt, moe_ckpts, family):
    """The engine with graphs (default) vs enforce_eager, fp32: same tokens for a batch that
    shrinks through the buckets (different max_tokens) and grows across page widths. Dense
    Kimi and both MoE families (the fused-MoE kernels inside the graphs)."""
    ckpt = ckpt if family == "kimi" else moe_ckpts[family]
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 3, 15, 16, 17, 31, 33, 50, 64, 7, 2, 100]
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]  # both vocabularies
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = {}
    for eager in (True, False):
        llm = LLM(str(ckpt), dtype="float32", device="cuda", max_num_seqs=16, enforce_eager=eager,
                  memory_budget=256 << 20)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        graphs = llm.engine.runner.graphs
        if eager:
            assert graphs is None
        else:
            captured = [k for k, (g, _) in graphs.graphs.items() if g is not None]
            assert len({bs for bs, _ in captured}) >= 3 and len({w for _, w in captured}) >= 2, captured
        del llm, graphs
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]


@pytest.mark.parametrize("rollback", ["slots", "replay"])
@pytest.mark.parametrize("family", ["kimi", "qwen3_next"])
def test_padded_verify_equals_eager_cpu(ckpt, qwen_ckpt, family, rollback, monkeypatch):
    """A verify step whose rows are padded to W = 1 + k (drafts of 0..k tokens, 3 rows -> bucket
    4) in the graph's fixed-shape inputs gives the eager, unpadded verify's logits at every real
    position; after accepting a different count per row, the state each row continues from and
    its KV rows equal eager's, and the next decode step gives the same logits."""
    model = load_model(ckpt if family == "kimi" else qwen_ckpt, dtype=torch.float64)
    recurrent_name = "fused_recurrent_kda" if family == "kimi" else "fused_recurrent_gated_delta_rule"
    k = 3
    W = 1 + k
    gen = torch.Generator().manual_seed(2)
    lens = [14, 16, 30]  # contexts before, at and past a page boundary
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    drafts = [[5, 9, 11], [], [4]]
    accepted = [3, 1, 2]  # tokens kept per row (1 + accepted drafts)
    spec_slots = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    start = [1, 0, 3]  # index in spec_slots of the slot holding the current state
    tables, first = [], 0
    for n, d in zip(lens, drafts):  # pages for the real tokens only: padding may fall off the table
        need = -(-(n + 1 + len(d)) // PAGE)
        tables.append(list(range(first, first + need))[::-1])
        first += need
    slots, pages = 12, first + 2
    eager = model.allocate_cache(slots, pages, page_size=PAGE)
    graph = model.allocate_cache(slots + SCRATCH, pages + SCRATCH, page_size=PAGE)
    for a, b in zip(eager.layers, graph.layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            tb.copy_(torch.randn(tb.shape, generator=gen, dtype=tb.dtype))
            ta.copy_(tb[:ta.shape[0]])
    # Prefill all but the last prompt token into the start slots, in both caches.
    cur = [sl[i] for sl, i in zip(spec_slots, start)]
    batch = ForwardBatch.build([n - 1 for n in lens], [0] * 3, tables, cur)
    with torch.inference_mode():
        model.forward_batch(torch.tensor([t for p in prompts for t in p[:-1]]), batch, eager)
    for a, b in zip(eager.layers, graph.layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            tb[:ta.shape[0]] = ta
    ctx = [n - 1 for n in lens]
    rows = spec_slots if rollback == "slots" else [[s] for s in cur]
    acc = [i + 1 for i in start] if rollback == "slots" else [1] * 3

    step = ForwardBatch.build([1 + len(d) for d in drafts], ctx, tables, rows, num_accepted_tokens=acc,
                              rollback=rollback)
    ids = [t for p, d in zip(prompts, drafts) for t in [p[-1], *d]]
    with torch.inference_mode():
        want = model.compute_logits(model.forward_batch(torch.tensor(ids), step, eager))

    runner = CUDAGraphRunner(model, graph, max_batch=slots, capture=False)
    nosync = _capture_mode(monkeypatch, runner, "_verify_forward", recurrent_name)
    tokens = [[p[-1], *d] + [0] * (k - len(d)) for p, d in zip(prompts, drafts)]
    got = runner.run_verify(tokens, ctx, rows, acc, tables, rollback)  # [3, W, V]
    assert got.shape[:2] == (3, W) and runner.verify_key[0] == 4
    real = torch.cat([got[n, :1 + len(d)] for n, d in enumerate(drafts)])
    torch.testing.assert_close(real, want, rtol=1e-10, atol=1e-10)

    # Accept, then both caches must agree on everything a request continues from.
    if rollback == "replay":
        model.commit_replay(eager, accepted)
        nosync.on = True  # the commit has a fixed shape too (its graph is captured with the verify's)
        runner.commit_replay(accepted)
        nosync.on = False
        nxt = cur
    else:
        nxt = [sl[a - 1] for sl, a in zip(spec_slots, accepted)]
    for a, b in zip(eager.layers, graph.layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            if ta.shape[0] == slots:  # state / conv pools: the slots requests continue from
                torch.testing.assert_close(tb[nxt], ta[nxt], rtol=1e-10, atol=1e-10)
    for n, (c, a) in enumerate(zip(ctx, accepted)):  # KV of kept positions
        for pos in range(c + a):
            page, off = tables[n][pos // PAGE], pos % PAGE
            for ta, tb in zip(eager.layers, graph.layers):
                for xa, xb in zip(ta.tensors(), tb.tensors()):
                    if xa.shape[0] == pages:
                        torch.testing.assert_close(xb[page, off], xa[page, off], rtol=1e-10, atol=1e-10)
    nosync.on = False
    last = [ids[sum(1 + len(d) for d in drafts[:n]) + a - 1] for n, a in enumerate(accepted)]
    step = ForwardBatch.build([1] * 3, [c + a for c, a in zip(ctx, accepted)], tables, nxt)
    with torch.inference_mode():
        want = model.compute_logits(model.forward_batch(torch.tensor(last), step, eager))
        got = model.compute_logits(model.forward_batch(torch.tensor(last), step, graph))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("rollback", ["slots", "replay"])
@pytest.mark.parametrize("family", ["kimi", "qwen3_next", "kimi_moe", "qwen3_next_moe"])
def test_graph_verify_equals_plain_greedy_cuda(ckpt, qwen_ckpt, moe_ckpts, family, rollback):
    """n-gram speculation with verify graphs (default) equals plain greedy decoding, fp32, for a
    batch whose requests finish at different steps; verify graphs were captured and used. Both
    families (KDA + MLA, Gated DeltaNet + gated attention), dense and MoE."""
    ckpt = {"kimi": ckpt, "qwen3_next": qwen_ckpt}.get(family) or moe_ckpts[family]
    gen = torch.Generator().manual_seed(3)
    motif = torch.randint(3, 250, (12,), generator=gen).tolist()  # within both tiny vocabularies
    prompts = [motif * (1 + i % 3) + torch.randint(3, 250, (i,), generator=gen).tolist() for i in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "rollback": rollback}):
        # The speculating engine also caches prefixes, and runs the set twice: the second pass
        # starts from the states its first pass filed (checkpoints hold accepted tokens only).
        llm = LLM(str(ckpt), dtype="float32", device="cuda", max_num_seqs=8, speculative_config=spec,
                  enable_prefix_caching=spec is not None, memory_budget=256 << 20)
        for _ in range(1 if spec is None else 2):
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            outs.setdefault(spec is None, []).append(got)
        if spec is not None:
            used = [key for key, (g, _, _) in llm.engine.runner.graphs.verify_graphs.items() if g is not None]
            assert used, "no verify graph was captured"
            assert llm.get_metrics()["prefix_cache_hit_tokens"] > 0
        del llm
        torch.cuda.empty_cache()
    plain = outs[True][0]
    assert outs[False] == [plain, plain]


def _mtp_case(tmp_path):
    """A tiny Qwen3.5 MoE checkpoint with an MTP shard, ten greedy requests that repeat a motif
    and finish at different steps, and their plain greedy output on the GPU (fp32)
    -> (path, prompts, params, wanted token ids)."""
    from tests.oracles.qwen3_5_checkpoint import add_mtp_shard, build_qwen3_5_checkpoint

    path = build_qwen3_5_checkpoint(tmp_path, "moe", "multimodal")
    add_mtp_shard(path)
    gen = torch.Generator().manual_seed(4)
    motif = torch.randint(3, 250, (12,), generator=gen).tolist()
    prompts = [motif * (1 + i % 3) + torch.randint(3, 250, (i,), generator=gen).tolist() for i in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    plain = LLM(str(path), dtype="float32", device="cuda", max_num_seqs=8, memory_budget=256 << 20)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    return path, prompts, params, want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("rollback", ["slots", "replay"])
def test_graph_mtp_equals_plain_greedy_cuda(tmp_path, rollback):
    """MTP speculation with verify graphs and head-step graphs (default) equals plain greedy
    decoding, fp32, prefix cache on (a second pass hits); every kind of graph was captured, the
    chained greedy draft steps (HeadStepGraphs.run_chain) too, and the drafts came from them."""
    path, prompts, params, want = _mtp_case(tmp_path)
    llm = LLM(str(path), dtype="float32", device="cuda", max_num_seqs=8, memory_budget=256 << 20,
              enable_prefix_caching=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3, "rollback": rollback})
    drafter, stepped, per_step = llm.engine.spec.drafter, [], llm.engine.spec.drafter._stepped_drafts
    drafter.fused = None  # the unfused step's graphs (the fused one: test_graph_mtp_fused_equals_plain_greedy_cuda)
    drafter._stepped_drafts = lambda *a, **k: stepped.append(1) or per_step(*a, **k)  # greedy: never taken
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert any(g is not None for g, _, _ in llm.engine.runner.graphs.verify_graphs.values())
    assert any(g is not None for g, _ in drafter.step_graphs.steps.values())
    assert any(g is not None for g in drafter.step_graphs.chains.values()) and not stepped
    assert {k for _, k, _ in drafter.step_graphs.chains} >= {2, 3}  # requests near their end draft fewer
    m = llm.get_metrics()
    assert m["spec_num_draft_tokens"] > 0 and m["prefix_cache_hit_tokens"] > 0
    del llm
    torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("k,rollback", [(1, "slots"), (2, "replay"), (3, "slots"), (3, "replay")])
def test_graph_mtp_fused_equals_plain_greedy_cuda(tmp_path, k, rollback):
    """MTP's fused greedy step (hyla.engine.spec.mtp.fused: verify + acceptance + the head's catch-up
    + the next draft chain in one captured graph) equals plain greedy decoding, fp32, prefix
    cache on (a second pass hits), requests finishing at different steps; the fused graph (and
    with "replay" its commit graph) was captured and replayed, the prefetched drafts used."""
    path, prompts, params, want = _mtp_case(tmp_path)
    llm = LLM(str(path), dtype="float32", device="cuda", max_num_seqs=8, memory_budget=256 << 20,
              enable_prefix_caching=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": k, "rollback": rollback})
    drafter = llm.engine.spec.drafter
    taken, prefetched = [], drafter._prefetched
    drafter._prefetched = lambda seq: (d := prefetched(seq)) is not None and taken.append(1) or d
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    graphs = llm.engine.runner.graphs
    fused_keys = [key for key, (g, _, _) in graphs.verify_graphs.items() if len(key) > 4 and g is not None]
    assert fused_keys and drafter.fused.runs > 0 and taken
    if rollback == "replay":
        assert all(key in graphs.commit_graphs for key in fused_keys)
    m = llm.get_metrics()
    assert m["spec_num_accepted_tokens"] > 0 and m["prefix_cache_hit_tokens"] > 0
    del llm
    torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("k,rollback", [(2, "slots"), (3, "slots"), (3, "replay")])
def test_overlapped_mtp_steps_equal_plain_greedy_cuda(tmp_path, k, rollback):
    """MTP with steps launched in flight (hyla.engine.spec.mtp.overlap) on the GPU, fp32, captured
    graphs, prefix cache on: plain greedy token for token, alone and as a batch, and with
    requests stopping on a token mid-chain; steps were launched in flight."""
    path, prompts, params, want = _mtp_case(tmp_path)
    spec = {"method": "mtp", "num_speculative_tokens": k, "rollback": rollback}
    llm = LLM(str(path), dtype="float32", device="cuda", max_num_seqs=8, memory_budget=256 << 20,
              enable_prefix_caching=True, speculative_config=spec)
    assert [llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params)] == want
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    stops = [SamplingParams(temperature=0.0, max_tokens=q.max_tokens, ignore_eos=True, stop_token_ids=[t[len(t) // 2]])
             for t, q in zip(want, params)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, stops, use_tqdm=False)]
    assert got == [t[:t.index(t[len(t) // 2]) + 1] for t in want]
    assert llm.engine.chain.launched > 0 and not llm.engine.spec.drafter.views
    del llm
    torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("k", [2, 3])
def test_overlapped_mtp_steps_equal_unoverlapped_bf16_cuda(k):
    """The bundled qwen3.5-mtp in bf16: MTP with steps launched in flight gives exactly what MTP
    without them gives (the same graphs on the same inputs), alone, as a batch and with stop
    tokens mid-chain. (Against plain greedy decoding bf16 need not agree: a verify's 1 + k rows
    run other GEMM shapes than a decode's one row, so near-ties may break the other way; the
    fp32 test above checks that equality.)"""
    from hyla.bench.spec import FREE, REPETITIVE
    from hyla.models.hub import resolve_model

    path, prompts = resolve_model("qwen3.5-mtp"), REPETITIVE + FREE
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": k, "rollback": "slots"}
    runs = []
    for overlap in (False, True):
        llm = LLM(path, device="cuda", memory_budget=256 << 20, speculative_config=spec, enable_prefix_caching=True)
        if not overlap:
            llm.engine.chain = llm.engine.spec.drafter.chain = None
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stops = [SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, stop_token_ids=[t[40]]) for t in alone]
        stopped = [o.outputs[0].token_ids for o in llm.generate(prompts, stops, use_tqdm=False)]
        runs.append((alone, batch, stopped))
        if overlap:
            assert llm.engine.chain.launched > 0
        del llm
        torch.cuda.empty_cache()
    assert runs[1] == runs[0]


def test_startup_widths_and_graph_sizes():
    from hyla.engine import EngineConfig
    from hyla.engine.cuda_graph import startup_widths

    # contexts up to 100 tokens in 16-token pages need 7 pages: widths 1, 2, 3, 4, 6, 8
    assert startup_widths(100, 16, True, 4) == [1, 2, 3, 4, 6, 8]
    assert startup_widths(100, 16, True, 4, max_graphs=12) == [1, 2, 3]  # 4 batch sizes x 3 widths
    assert startup_widths(10**6, 16, False, 40) == [1]  # no attention: the width does not matter
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(model="default", cuda_graph_sizes=[0, 8])


def test_configured_sizes_share_one_logits_buffer(monkeypatch):
    """The graphs' batch sizes are the configured ones; every graph writes its logits into one
    [max_batch, V] buffer (rows :bs)."""
    from hyla.engine import model_runner

    monkeypatch.setattr(model_runner, "use_cuda_graphs", lambda model, eager: True)
    llm = LLM("default", device="cpu", dtype="float32", cuda_graph_sizes=[2, 5])
    graphs = llm.engine.runner.graphs
    assert graphs.buckets == [2, 5] and graphs.max_batch == 5
    out = llm.generate(["a b", "c", "d e f"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    assert graphs.logits.shape == (5, llm.engine.vocab_size)
    assert {key[0] for key in graphs.graphs} == {5}  # 3 rows: the bucket of 5


def test_a_failed_capture_moves_later_graphs_to_a_fresh_pool(monkeypatch):
    """A capture that raises (out of memory mid-capture) propagates, and the runner's later
    graphs go to a new memory pool: the old one may be left recording by the caching allocator,
    which failed every later capture into it (seen on an H100). CUDA's stream and graph API are
    stand-ins here; the runner's logic around them is what runs."""
    from contextlib import nullcontext

    from hyla.engine import cuda_graph

    handles = iter(range(100))
    pools_used = []

    class Graph:  # torch.cuda.graph's stand-in records the pool and runs the step
        def __init__(self, graph, pool):
            pools_used.append(pool)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Stream:
        def __init__(self, *a, **kw):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", Graph)
    runner = cuda_graph.DecodeGraphs.__new__(cuda_graph.DecodeGraphs)
    runner.device, runner.pool = torch.device("cpu"), torch.cuda.graph_pool_handle()
    calls = iter([None, MemoryError("mid-capture")])  # warm-up passes, the captured call fails

    def step():
        err = next(calls, None)
        if err is not None:
            raise err
        return "out"
    with pytest.raises(MemoryError):
        runner._capture(step)
    assert pools_used == [0] and runner.pool == 1
    _, out = runner._capture(lambda: "out")
    assert out == "out" and pools_used == [0, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_decode_graphs_are_captured_at_startup():
    """Every batch size at the widths the contexts need is captured when the engine starts:
    serving then captures nothing."""
    llm = LLM("default", device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256)
    graphs = llm.engine.runner.graphs
    before = set(graphs.graphs)
    assert {b for b, _ in before} == set(graphs.buckets) and all(g is not None for g, _ in graphs.graphs.values())
    llm.generate(["def f(x):", "import os"] * 3, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    assert set(graphs.graphs) == before


def test_meta_staging_writes_only_changed_tables():
    """The decode buffer's host copy (cuda_graph._MetaStage) keeps a row's page columns while
    its BlockTable is unchanged, rewrites them when it grows, shrinks (the columns past it back
    to -1) or is another table, and resets rows that become padding: every fill equals the rows
    built from scratch."""
    from hyla.engine.block_table import BlockTable
    from hyla.engine.cuda_graph import _MetaStage

    def scratch(tokens, ctx, slots, tables, bs, width):
        rows = [[t, c, s] + list(tb[:width]) + [-1] * (width - len(tb[:width]))
                for t, c, s, tb in zip(tokens, ctx, slots, tables)]
        return torch.tensor(rows + [[0, 0, -1] + [-1] * width] * (bs - len(rows)))

    stage, width = _MetaStage(8, 6, pinned=False), 6
    a, b, c = BlockTable([3, 4]), BlockTable([7]), [9, 10, 11]  # c: a plain list, rewritten each time
    writes = []
    real = stage._pages
    stage._pages = lambda row, pages: writes.append(row) or real(row, pages)
    steps = [([a, b, c], 4), ([a, b, c], 4), ([b, a], 2), ([b, a], 4), ([a], 1), ([a], 1)]
    for step, (tables, bs) in enumerate(steps):
        if step == 3:
            a.extend([5, 6, 8, 12, 13])  # longer than the width: its first 6 columns
            del b[:]
        writes.clear()
        n = len(tables)
        got = stage.fill([1] * n, [step] * n, list(range(n)), tables, bs)
        assert torch.equal(got, scratch([1] * n, [step] * n, list(range(n)), tables, bs, width)), step
        if step == 1:
            assert writes == [2]  # only the plain list's row
    assert writes == []  # a in row 0 again, unchanged since it was written there: nothing
