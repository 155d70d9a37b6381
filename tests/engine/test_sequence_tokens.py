"""Sequence.token_range / token_at (and the step plan's tokens, the tensor-parallel views' same
calls) equal slicing and indexing token_ids, across the prompt / output boundary."""

from hyla.engine.sampling_params import SamplingParams
from hyla.engine.sequence import Sequence
from hyla.engine.step_plan import StepPlan
from hyla.parallel.views import DraftView


def test_token_range_and_token_at_equal_token_ids():
    seq = Sequence("r", None, [5, 6, 7, 8], SamplingParams(max_tokens=8), 8, None)
    for t in (9, 10, 11):
        seq.output_token_ids.append(t)
    ids = seq.token_ids
    n = len(ids)
    for a in range(n + 1):
        for b in range(a, n + 1):
            assert seq.token_range(a, b) == ids[a:b]
    assert [seq.token_at(i) for i in range(n)] == ids
    seq.num_computed_tokens = 2
    plan = StepPlan.plain([seq], [3], [[2]])  # what a step sends the tensor-parallel ranks
    assert plan.token_ids == ids[2:5] and plan.token_ids[4 - 2] == ids[4]
    draft = DraftView.of(seq, 3)
    assert draft.num_tokens == n and draft.token_range(3, n) == ids[3:] and draft.token_range(4, 6) == ids[4:6]
    assert DraftView.of(seq).num_tokens == n


def test_stop_ids_are_the_ids_check_stop_ends_on():
    """stop_ids (the overlapped MTP chain's device-side stop rule) lists exactly the ids on which
    check_stop finishes a request past min_tokens: every EOS id unless ignore_eos, and stop_token_ids."""
    cases = [(SamplingParams(max_tokens=8), 2), (SamplingParams(max_tokens=8, ignore_eos=True), 2),
             (SamplingParams(max_tokens=8, stop_token_ids=[9, 2]), 2), (SamplingParams(max_tokens=8), None),
             (SamplingParams(max_tokens=8), (2, 7, 11)), (SamplingParams(max_tokens=8, ignore_eos=True), (2, 7)),
             (SamplingParams(max_tokens=8, stop_token_ids=[7, 3]), [2, 7, 11])]
    for params, eos in cases:
        ids = Sequence("r", None, [5], params, 8, eos).stop_ids()
        assert len(ids) == len(set(ids))
        for token in range(12):
            seq = Sequence("r", None, [5], params, 8, eos)
            seq.append_token(token, None)
            seq.check_stop(None)
            assert seq.is_finished == (token in ids), (params, eos, token)
