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
    return [o.outputs[0].token_ids for o in LLM(str(ckpt), dtype="float64").generate(PROMPTS, GREEDY, use_tqdm=False)]


def _run(ckpt, k: int, rollback: str, graphs: bool, monkeypatch):
    """-> (outputs, [(positions, counts, hidden)] of every observe call, the engine)."""
    with monkeypatch.context() as m:
        if graphs:  # the runner then allocates scratch rows and a CUDAGraphRunner (capture off on the CPU)
            m.setattr(model_runner, "use_cuda_graphs", lambda model, eager: True)
        llm = LLM(str(ckpt), dtype="float64", max_num_seqs=4,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k, "rollback": rollback})
    drafter, seen = llm.engine.spec.drafter, []
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
def random_head(tmp_path_factory):
    path = build_qwen3_5_checkpoint(tmp_path_factory.mktemp("mtp-graph-random"), "dense", "text")
    add_mtp_shard(path)  # a random head: its attention over the head's KV matters
    return path


@pytest.mark.parametrize("rollback", ["slots", "replay"])
def test_head_draft_steps_in_graphs_equal_eager(random_head, rollback, monkeypatch):
    """The head's draft steps after the first replay HeadStepGraphs (padded to a batch bucket and
    a page width, with every host sync failing inside): the same proposals as eager head steps,
    and the output stays plain greedy."""
    from tests.engine.test_cuda_graph import _NoSync

    prompts = PROMPTS + [rand(40, 5)]  # a context across page boundaries
    # requests finish at different steps: the batch shrinks through the buckets
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in LLM(str(random_head), dtype="float64").generate(
        prompts, params, use_tqdm=False)]
    proposals = {}
    for graphs in (False, True):
        with monkeypatch.context() as m:
            if graphs:
                m.setattr(model_runner, "use_cuda_graphs", lambda model, eager: True)
            llm = LLM(str(random_head), dtype="float64", max_num_seqs=5,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 3, "rollback": rollback})
        drafter, seen = llm.engine.spec.drafter, []
        assert (drafter.step_graphs is not None) == graphs
        propose = drafter.propose

        def record(seqs, ks, generator=None):
            out = propose(seqs, ks, generator)
            seen.append([(s.request_id, d) for s, (d, _) in zip(seqs, out)])
            return out

        drafter.propose = record
        if graphs:
            nosync, forward = _NoSync(monkeypatch), drafter.step_graphs._forward

            def guarded(*a):
                nosync.on = True
                try:
                    return forward(*a)
                finally:
                    nosync.on = False
            monkeypatch.setattr(drafter.step_graphs, "_forward", guarded)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        proposals[graphs] = seen
        if graphs:
            monkeypatch.undo()
            used = drafter.step_graphs.steps
            assert len({bs for bs, _ in used}) >= 2 and len({w for _, w in used}) >= 2, used
    assert proposals[True] == proposals[False]
    assert sum(len(d) for step in proposals[True] for _, d in step) > 0
