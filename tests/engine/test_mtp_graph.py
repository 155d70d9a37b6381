"""MTP speculation through the CUDA-graph verify path (hyla.engine.cuda_graph_verify), on the CPU:
the engine's runner gets a CUDAGraphRunner(capture=False), so verify steps run the graph's padded,
fixed-shape inputs and hand the drafter the hidden states from the graph's output buffer.
Greedy output equals eager MTP and plain greedy for k = 1..3, both rollbacks, and the hidden
states the drafter is handed equal the eager ones row for row."""

import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.engine import model_runner
from tests.engine.test_mtp_spec import _repeat_head
from tests.oracles.qwen3_5_checkpoint import add_mtp_shard, build_qwen3_5_checkpoint
from tests.oracles.variants import rand_tokens as rand

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [rand(12, 1) * 3, [7], rand(5, 3) * 4, rand(20, 4)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = build_qwen3_5_checkpoint(tmp_path_factory.mktemp("mtp-graph"), "dense", "text")
    add_mtp_shard(path)
    _repeat_head(path)
    return path


@pytest.fixture(scope="module")
def plain(ckpt):
    return [o.outputs[0].token_ids for o in LLM(str(ckpt), dtype="float64", device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)]


def _run(ckpt, k: int, rollback: str, graphs: bool, monkeypatch):
    """-> (outputs, [(positions, counts, hidden)] of every observe call, the engine)."""
    with monkeypatch.context() as m:
        if graphs:  # the runner then allocates scratch rows and a CUDAGraphRunner (capture off on the CPU)
            m.setattr(model_runner, "use_cuda_graphs", lambda model, eager: True)
        llm = LLM(str(ckpt), dtype="float64", device="cpu", max_num_seqs=4,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k, "rollback": rollback})
    drafter, seen = llm.engine.spec.drafter, []
    drafter.fused = None  # the unfused verify, which hands the rows over (fused: test_mtp_fused.py)
    observe = drafter.observe

    def record(seqs, positions, counts, hidden):
        seen.append((list(positions), list(counts), hidden.clone()))
        observe(seqs, positions, counts, hidden)

    drafter.observe = record
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return outs, seen, llm.engine


@pytest.mark.parametrize("rollback", ["slots", "replay"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_in_the_graph_path_equals_eager_and_plain_greedy(ckpt, plain, k, rollback, monkeypatch):
    eager_outs, eager_seen, _ = _run(ckpt, k, rollback, False, monkeypatch)
    graph_outs, graph_seen, engine = _run(ckpt, k, rollback, True, monkeypatch)
    assert engine.runner.graphs is not None and engine.runner.graphs.verify_graphs, "no verify ran padded"
    assert not engine.config.enforce_eager  # MTP no longer forces eager verifies
    assert graph_outs == eager_outs == plain
    m = engine.get_metrics()
    assert 0 < m["spec_num_accepted_tokens"] < m["spec_num_draft_tokens"]
    # The graph hands over the same rows (padding dropped) as the eager verify, in the same steps.
    assert graph_seen and [(p, c) for p, c, _ in graph_seen] == [(p, c) for p, c, _ in eager_seen]
    for (_, _, got), (_, _, want) in zip(graph_seen, eager_seen):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module")
def leaky_head(tmp_path_factory):
    return build_leaky_head(tmp_path_factory.mktemp("mtp-graph-leaky"))


def build_leaky_head(tmp, scale: float = 0.5, variant: tuple[str, str] = ("dense", "text")):
    """The repeat head (it drafts the last token) with its attention output let back in (o_proj
    random, `scale` times a standard normal): the drafts depend on the head's KV. variant: the
    checkpoint's (MLP, modality) as build_qwen3_5_checkpoint takes them."""
    from safetensors.torch import load_file, save_file

    path = build_qwen3_5_checkpoint(tmp, *variant)
    add_mtp_shard(path)
    _repeat_head(path)
    file = path / "model-mtp.safetensors"
    t = load_file(file)
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in t if n.endswith("o_proj.weight")]:
        t[name] = scale * torch.randn(t[name].shape, generator=gen)
    save_file(t, file, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("rollback", ["slots", "replay"])
def test_head_draft_steps_in_graphs_equal_eager(leaky_head, rollback, monkeypatch):
    """The head's steps replay HeadStepGraphs (padded to a batch bucket and a page width, with
    every host sync failing inside): catch-ups on a verify's kept rows (4 rows per request) and
    the chained draft steps (greedy: HeadStepGraphs.run_chain) give the same proposals as eager
    head steps; output stays plain greedy."""
    prompts = PROMPTS + [rand(40, 5)]  # a context across page boundaries
    # requests finish at different steps: the batch shrinks through the buckets
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in LLM(str(leaky_head), dtype="float64", device="cpu").generate(
        prompts, params, use_tqdm=False)]
    eager_outs, eager_proposals, _ = _proposals(leaky_head, prompts, params, rollback, False, monkeypatch)
    graph_outs, graph_proposals, drafter = _proposals(leaky_head, prompts, params, rollback, True, monkeypatch)
    assert graph_outs == eager_outs == want
    used = drafter.step_graphs.steps  # (batch bucket, rows per request, page width)
    assert 1 in {W for _, W, _ in used}, used  # (W = 1 + k: test_head_steps_padded_equal_eager_cpu)
    assert len({bs for bs, _, _ in used}) >= 2 and len({w for _, _, w in used}) >= 2, used
    assert {k for _, k, _ in drafter.step_graphs.chains} >= {2, 3}  # greedy: the draft steps chained
    assert graph_proposals == eager_proposals
    assert sum(len(d) for step in graph_proposals for _, d in step) > 0


def _proposals(path, prompts, params, rollback: str, graphs: bool, monkeypatch):
    """-> (outputs, every propose call's [(request, drafts)], the drafter) of an MTP engine, k = 3,
    whose head steps run in HeadStepGraphs with host syncs failing inside (graphs) or eagerly."""
    from tests.engine.test_cuda_graph import _NoSync

    with monkeypatch.context() as m:
        if graphs:
            m.setattr(model_runner, "use_cuda_graphs", lambda model, eager: True)
        llm = LLM(str(path), dtype="float64", device="cpu", max_num_seqs=5,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3, "rollback": rollback})
    drafter, seen = llm.engine.spec.drafter, []
    assert (drafter.step_graphs is not None) == graphs
    drafter.fused = None  # the head's own steps (fused into the verify: test_mtp_fused.py)
    propose = drafter.propose

    def record(seqs, ks, generator=None):
        out = propose(seqs, ks, generator)
        seen.append([(s.request_id, d) for s, (d, _) in zip(seqs, out)])
        return out

    drafter.propose = record
    with monkeypatch.context() as m:
        if graphs:  # the head steps and the chained draft steps, as a capture runs them
            nosync = _NoSync(m)
            for name in ("_forward", "_chain_forward"):
                m.setattr(drafter.step_graphs, name, _guarded(nosync, getattr(drafter.step_graphs, name)))
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return outs, seen, drafter


def _guarded(nosync, forward):
    """forward with every host sync failing inside it."""
    def guarded(*a):
        nosync.on = True
        try:
            return forward(*a)
        finally:
            nosync.on = False
    return guarded


def test_head_steps_padded_equal_eager_cpu(leaky_head, monkeypatch):
    """HeadStepGraphs' padded inputs (chunks of 3, 1 and 4 rows padded to W = 4, 3 requests to
    bucket 4, ops in their capture paths, host syncs failing) give the eager head's last-row
    states and logits and the same head KV rows at every committed position; then a one-row
    draft step (W = 1) on top agrees too."""
    from hyla.contract import ForwardBatch
    from hyla.engine.cuda_graph import SCRATCH
    from hyla.engine.cuda_graph_verify import CUDAGraphRunner, HeadStepGraphs
    from hyla.models import load_model
    from hyla.models.qwen3_5_mtp import load_mtp_head
    from tests.engine.test_cuda_graph import _capture_mode

    model = load_model(leaky_head, dtype=torch.float64)
    head = load_mtp_head(leaky_head, model)
    gen = torch.Generator().manual_seed(6)
    pages, page = 8, 16
    eager, graph = head.allocate_kv(pages, page), head.allocate_kv(pages + SCRATCH, page)
    for a, b in zip(eager.tensors(), graph.tensors()):
        b.copy_(torch.randn(b.shape, generator=gen, dtype=b.dtype))  # garbage, never zeros
        a.copy_(b[:pages])
    runner = CUDAGraphRunner(model, model.allocate_cache(4 + SCRATCH, pages + SCRATCH, page_size=page), max_batch=4,
                             capture=False)
    steps = HeadStepGraphs(runner, head, model, graph, max_width=4)
    _capture_mode(monkeypatch, steps, "_forward", "fused_recurrent_gated_delta_rule")
    counts, context, tables = [3, 1, 4], [5, 16, 29], [[1, 0], [3, 2], [6, 5, 4]]  # across page boundaries
    for _ in range(2):  # a catch-up (W = 4), then a draft step (W = 1) after it
        hidden = torch.randn(sum(counts), model.config.hidden_size, generator=gen, dtype=torch.float64)
        ids = torch.randint(3, model.config.vocab_size, (sum(counts),), generator=gen).tolist()
        batch = ForwardBatch.build(counts, context, tables, [0] * 3)
        with torch.inference_mode():
            y = head.forward_batch(hidden, torch.tensor(ids), model, batch, eager)
            y = y[torch.tensor(counts).cumsum(0) - 1]
            want = model.compute_logits(y)
        got_y, got = steps.run(hidden, ids, counts, context, tables)
        assert next(iter(steps.steps))[0] == 4  # three requests padded to the bucket of 4
        torch.testing.assert_close(got_y, y, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        for table, c, n in zip(tables, context, counts):  # every committed head row, old and new
            for pos in range(c + n):
                for a, b in zip(eager.tensors(), graph.tensors()):
                    torch.testing.assert_close(b[table[pos // page], pos % page], a[table[pos // page], pos % page])
        context = [c + n for c, n in zip(context, counts)]
        counts = [1, 1, 1]
    assert {W for _, W, _ in steps.steps} == {1, 4}
