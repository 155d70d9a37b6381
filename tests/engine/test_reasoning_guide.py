"""A grammar that waits for the reasoning's end (SamplingParams.reasoning_end_token_ids): no mask
and nothing accepted until the output ends with the marker, the grammar from the next token on;
speculative decoding cuts and masks drafts the same way (drafts after the marker walk the grammar)."""

from __future__ import annotations

import pytest
import torch

import hyla.engine.spec.decoder as spec_decode
from hyla import LLM, SamplingParams
from hyla.engine.sampler import guide_mask, pending_guide_drafts
from hyla.engine.sequence import Sequence
from hyla.engine.spec.acceptance import argmax_accepts
from hyla.models import default_model_path

V = 40


class _Evens:
    """A grammar of even tokens (and a stop after 30): records what it accepted."""

    def __init__(self):
        self.accepted: list[int] = []

    def matcher(self):
        return self

    def fill_next_token_bitmask(self, bitmask, index):
        bitmask[index] = 0x55555555  # bits 0, 2, 4, ...

    def accept_token(self, token):
        if token % 2:
            return False
        self.accepted.append(token)
        return True

    def is_terminated(self):
        return bool(self.accepted) and self.accepted[-1] >= 30

    def rollback(self, n):
        del self.accepted[len(self.accepted) - n:]


def _seq(end: list[int] | None, guide=None) -> Sequence:
    guide = guide or _Evens()
    params = SamplingParams(max_tokens=20, guide=guide, reasoning_end_token_ids=end)
    return Sequence("r", None, [1, 2], params, 20, None)


@pytest.mark.parametrize("ids", [[], [1, -2], [True], "12", 7])
def test_reasoning_end_token_ids_must_be_token_ids(ids):
    with pytest.raises(ValueError, match="reasoning_end_token_ids"):
        SamplingParams(reasoning_end_token_ids=ids)


def test_the_grammar_applies_from_the_token_after_the_marker():
    guide = _Evens()
    seq = _seq([7, 9], guide)
    assert seq.guide is None and seq.guide_pending is guide
    logits = torch.zeros(1, V)
    for t in [3, 7, 5, 7]:  # 7 alone, or 7 then 5, is not the marker
        assert torch.equal(guide_mask(logits, [seq]), logits)  # unmasked while pending
        seq.append_token(t, None)
        assert seq.guide is None and seq.error is None
    seq.append_token(9, None)  # 7, 9: the reasoning ended
    assert seq.guide is guide and seq.guide_pending is None and guide.accepted == []
    assert torch.isinf(guide_mask(logits, [seq])[0, 1::2]).all()  # odd tokens masked from now on
    seq.append_token(4, None)
    seq.append_token(3, None)  # the grammar refuses it now
    assert guide.accepted == [4] and "not allowed" in seq.error
    assert _seq(None).guide is not None and _seq(None).guide_pending is None  # no marker: from the start


def test_pending_grammar_cuts_and_masks_drafts_after_the_marker():
    seq = _seq([7, 9])
    seq.append_token(7, None)
    assert seq.guide_waits_for([9, 4]) == 1 and seq.guide_waits_for([8, 7, 9]) == 3
    assert seq.guide_waits_for([5, 9]) is None
    # the marker is not completed: every draft kept, no mask
    assert pending_guide_drafts(seq, [5, 3, 7], False, V) == ([5, 3, 7], None)
    # completed by the first draft: 4 and 6 walk the grammar, 3 is its first refusal
    kept, words = pending_guide_drafts(seq, [9, 4, 6, 3, 8], keep_rejected=False, V=V)
    assert kept == [9, 4, 6] and words.shape == (4, 2)
    assert (words[0] == -1).all() and (words[1:] == 0x55555555).all()  # row 0 unmasked (before the marker)
    assert seq.guide_pending.accepted == []  # rolled back: the engine accepts what the verify emits
    kept, _ = pending_guide_drafts(seq, [9, 4, 6, 3, 8], keep_rejected=True, V=V)
    assert kept == [9, 4, 6, 3]
    assert not argmax_accepts(seq)  # a pending grammar takes the masked acceptance, as an active one


def _spy(monkeypatch) -> list[int | None]:
    """Where pending_guide_drafts found the marker in each draft list it was given."""
    found: list[int | None] = []

    def spy(seq, drafts, keep_rejected, V):
        found.append(seq.guide_waits_for(drafts))
        return pending_guide_drafts(seq, drafts, keep_rejected, V)

    monkeypatch.setattr(spec_decode, "pending_guide_drafts", spy)
    return found


def test_greedy_output_follows_the_grammar_after_the_marker_with_and_without_speculation(monkeypatch):
    pytest.importorskip("xgrammar")
    from hyla.server.structured import Grammars, GuideSpec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the test machine's cores are shared: one thread is several times faster
    try:
        # the prompt repeats what the model goes on to write, so prompt lookup drafts across ".\n"
        prompt = "The answer is a shebang line.\n\nimport re\nimport sys\nThe answer is"
        found = _spy(monkeypatch)
        outs = []
        for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}):
            llm = LLM(default_model_path(), dtype="float64", max_model_len=256, speculative_config=spec)
            end = llm.engine.tokenizer.encode(".\n", add_special_tokens=False)
            guide = Grammars(llm.engine).compile(GuideSpec("regex", "(\nimport [a-z]+)+"))
            free, guided = llm.generate([prompt, prompt], [
                SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=16, guide=guide, reasoning_end_token_ids=end)],
                use_tqdm=False)
            outs.append((free.outputs[0], guided.outputs[0]))
        (free, guided), (_, spec_guided) = outs
        assert spec_guided.token_ids == guided.token_ids  # speculation changes nothing
        assert any(n is not None for n in found)  # drafts did cross the marker
        ids = guided.token_ids
        n = next(i for i in range(len(end), len(ids) + 1) if ids[i - len(end):i] == end)  # after the marker
        assert 0 < n < len(ids) and ids[:n] == free.token_ids[:n]  # unconstrained up to the marker
        follows = guide.matcher()
        assert all(follows.accept_token(t) for t in ids[n:])  # the grammar's from there
        refuses = guide.matcher()
        assert not all(refuses.accept_token(t) for t in free.token_ids[n:])  # (which the free output is not)
    finally:
        torch.set_num_threads(threads)
