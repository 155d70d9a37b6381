"""A greedy verify in a graph keeps its logits on the device (ModelRunner.execute device_logits):
the acceptance is one argmax there and a copy of ids; a batch with a sampling request brings the
logits to the host (its acceptance reads them row by row). On the CPU with a CUDAGraphRunner
(capture off): which form each verify took, and plain greedy / the eager engine's output."""

import pytest

from hyla import LLM, SamplingParams
from hyla.engine import model_runner
from hyla.engine.model_runner import ModelRunner
from hyla.engine.spec.decoder import SpecDecoder
from hyla.bench.spec import REPETITIVE as PROMPTS


@pytest.fixture(scope="module")
def ckpt():
    from hyla.models.hub import resolve_model

    return resolve_model("qwen3.5-mtp")  # trained: prompt lookup's drafts are accepted on code


@pytest.mark.parametrize("rollback", ["slots", "replay"])
def test_greedy_verify_keeps_logits_on_the_device(ckpt, rollback, monkeypatch):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)
    params = [greedy, sampled, greedy]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "rollback": rollback}
    plain = [o.outputs[0].token_ids for o in LLM(str(ckpt), dtype="float64", device="cpu").generate(PROMPTS, greedy, use_tqdm=False)]
    eager = LLM(str(ckpt), dtype="float64", device="cpu", speculative_config=spec).generate(PROMPTS, params, use_tqdm=False)
    seen, greedy = [], []
    inner, step = ModelRunner._verify_in_graph, SpecDecoder.step

    def verifying(self, seqs, *a):  # the batch the next verify runs (its plan holds no Sequence)
        greedy[:] = [all(s.params.greedy for s in seqs)]
        return step(self, seqs, *a)

    def record(self, plan, *a):
        seen.append((greedy[0], a[-1]))  # (greedy batch, device_logits)
        return inner(self, plan, *a)
    monkeypatch.setattr(SpecDecoder, "step", verifying)
    monkeypatch.setattr(ModelRunner, "_verify_in_graph", record)
    with monkeypatch.context() as m:
        m.setattr(model_runner, "use_cuda_graphs", lambda model, e: True)
        llm = LLM(str(ckpt), dtype="float64", device="cpu", speculative_config=spec)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in eager]
    assert [got[i].outputs[0].token_ids for i in (0, 2)] == [plain[i] for i in (0, 2)]
    assert seen and {g for g, _ in seen} == {True, False}
    assert all(g == d for g, d in seen)  # on the device exactly when the batch is greedy
    m = llm.get_metrics()
    assert m["spec_num_accepted_tokens"] > 0
