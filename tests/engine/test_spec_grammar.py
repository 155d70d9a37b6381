"""Speculative decoding with structured outputs: drafts are cut where the request's grammar
rejects one, the verify step applies each position's grammar mask before acceptance, and the
matcher ends where the emitted tokens put it. Greedy guided output with speculation equals it
without; sampled guided output always follows the grammar and is distributed as without."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

import hyla.engine.spec.decoder as spec_decode  # noqa: E402
from hyla import LLM, SamplingParams  # noqa: E402
from hyla.engine.sampler import guide_drafts, unpack_bitmask  # noqa: E402
from hyla.engine.spec.decoder import accept  # noqa: E402
from hyla.models import default_model_path  # noqa: E402
from hyla.server.structured import Grammars, GuideSpec  # noqa: E402
from tests.engine.test_spec_decode import _chi2_pvalue  # noqa: E402

REGEX = "(ab ){2,8}c"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]},
                                                    "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}
CHOICES = ["alpha beta gamma", "alpha beta delta"]
# Prompts whose repetitions give prompt lookup drafts, some of which the grammar must cut
# (after eight "ab " it wants "c"; the JSON prompt's spacing differs from the compact grammar's).
CASES = [("ab ab ab ab ab ab ab ab ab", GuideSpec("regex", REGEX)),
         ('{"name": "Ada", "tags": ["x", "y"]}\n{"name": "Ada", "tags": ["x", "y"]}\n', GuideSpec("json", SCHEMA)),
         ("alpha beta gamma alpha beta gamma alpha beta", GuideSpec("choice", CHOICES))]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the test machine's cores are shared: one thread is several times faster
    yield
    torch.set_num_threads(threads)


def _llm(spec: dict | None) -> LLM:
    return LLM(default_model_path(), dtype="float64", max_model_len=256, speculative_config=spec)


def _params(llm: LLM, temperature: float = 0.0, seed: int | None = None) -> list[SamplingParams]:
    grammars = Grammars(llm.engine)
    return [SamplingParams(temperature=temperature, seed=seed, max_tokens=40,
                           guide=grammars.compile(spec, any_whitespace=False)) for _, spec in CASES]


def _follows(text: str, spec: GuideSpec) -> bool:
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    if spec.kind == "choice":
        return text in spec.value
    obj = json.loads(text)
    return set(obj) == {"name", "tags"} and set(obj["tags"]) <= {"x", "y", "z"} and len(obj["tags"]) <= 3


class _Cuts:
    """Counts the drafts guide_drafts was given and kept (the test must see both happen)."""

    def __init__(self, monkeypatch):
        self.given = self.kept = 0
        monkeypatch.setattr(spec_decode, "guide_drafts", self)

    def __call__(self, guide, drafts, keep_rejected, V):
        kept, words = guide_drafts(guide, drafts, keep_rejected, V)
        self.given, self.kept = self.given + len(drafts), self.kept + len(kept)
        return kept, words


@pytest.fixture(scope="module")
def plain_greedy():
    llm = _llm(None)
    outs = llm.generate([p for p, _ in CASES], _params(llm), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("rollback", ["slots", "replay"])
def test_greedy_guided_speculation_equals_plain(plain_greedy, rollback, monkeypatch):
    cuts = _Cuts(monkeypatch)
    llm = _llm({"method": "ngram", "num_speculative_tokens": 4, "rollback": rollback})
    outs = llm.generate([p for p, _ in CASES], _params(llm), use_tqdm=False)
    got = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    assert got == plain_greedy
    assert all(_follows(text, spec) for (_, text, _), (_, spec) in zip(got, CASES)), got
    m = llm.get_metrics()
    assert m["spec_num_accepted_tokens"] > 0  # guided requests did speculate (all three are guided)
    assert 0 < cuts.kept < cuts.given  # ...and the grammar cut some drafts
    assert m["state_slots_free"] == m["state_slots_total"] and m["kv_pages_free"] == m["kv_pages_total"]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4, "rollback": "slots"},
                                  {"method": "draft_model", "model": str(default_model_path()),
                                   "num_speculative_tokens": 3, "rollback": "replay"}], ids=["ngram", "draft"])
def test_sampled_guided_speculation_follows_the_grammar(spec, monkeypatch):
    """The draft model (the bundled model drafting for itself, unmasked) proposes from q, so a
    draft the grammar rejects is kept for the acceptance rule to reject (keep_rejected)."""
    cuts = _Cuts(monkeypatch)
    llm = _llm(spec)
    for seed in range(3):
        outs = llm.generate([p for p, _ in CASES], _params(llm, temperature=1.0, seed=seed), use_tqdm=False)
        for o, (_, s) in zip(outs, CASES):
            assert o.outputs[0].finish_reason == "stop" and _follows(o.outputs[0].text, s), o.outputs[0].text
    assert llm.get_metrics()["spec_num_draft_tokens"] > 0 and cuts.given > 0


class _FirstFour:
    """A grammar that allows tokens 0..3 at every step."""

    def fill_next_token_bitmask(self, bitmask, index):
        bitmask[index] = 0
        bitmask[index, 0] = 0b1111

    def accept_token(self, token):
        return token < 4

    def is_terminated(self):
        return False

    def rollback(self, n):
        pass


@pytest.mark.parametrize("keep_rejected", [True, False])
def test_grammar_cut_with_a_q_drafter_samples_the_masked_target(keep_rejected):
    """Drafts from q, which puts mass on the two tokens the grammar forbids: the first emitted
    token must follow the grammar-masked target p. Keeping the rejected draft (its residual
    max(p - q, 0) is drawn) does; cutting before it (drawing from p instead) does not."""
    V, n = 6, 12000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=gen) * 1.5
    q = torch.softmax(torch.randn(1, V, generator=gen), -1)
    seq = type("S", (), {"params": SamplingParams(temperature=1.0), "token_ids": [1], "output_token_ids": []})()
    p0 = torch.softmax(logits[0].masked_fill(torch.arange(V) >= 4, float("-inf")), -1)
    first = torch.zeros(V)
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        kept, words = guide_drafts(_FirstFour(), [d], keep_rejected, V)
        out = accept(logits[: 1 + len(kept)], kept, q, seq, gen, unpack_bitmask(words, V, "cpu"))
        first[out[0]] += 1
    assert first[4:].sum() == 0
    if keep_rejected:
        assert _chi2_pvalue(first, p0) > 1e-3
    else:
        assert _chi2_pvalue(first, p0) < 1e-6  # the test has the power to reject the wrong cut


def test_guide_drafts_cuts_at_the_first_rejection_and_rolls_back():
    llm = _llm(None)
    tok, V = llm.engine.tokenizer, llm.engine.vocab_size
    guide = Grammars(llm.engine).compile(GuideSpec("regex", REGEX))
    m = guide.matcher()
    ab = tok.encode("ab ab ab", add_special_tokens=False)
    bad = tok.encode("c c", add_special_tokens=False)
    for t in ab:
        assert m.accept_token(t)
    fresh = guide.matcher()
    for t in ab:
        fresh.accept_token(t)
    # after "ab ab ab": "ab ..." and "c" are allowed, "c c" is not (the regex ends at "c")
    drafts = tok.encode(" ab c", add_special_tokens=False) + bad
    kept, words = guide_drafts(m, drafts, keep_rejected=False, V=V)
    assert 0 < len(kept) < len(drafts) and words.shape[0] == 1 + len(kept)
    # the matcher is where it was: its mask equals the fresh one's, and it accepts the kept drafts
    want = torch.full((1, (V + 31) // 32), -1, dtype=torch.int32)
    got = want.clone()
    fresh.fill_next_token_bitmask(want, 0)
    m.fill_next_token_bitmask(got, 0)
    assert torch.equal(got, want) and torch.equal(words[:1], want)
    for i, t in enumerate(kept):
        fresh.fill_next_token_bitmask(want, 0)
        assert torch.equal(words[i : i + 1], want)  # row i: the mask after kept[:i]
        assert fresh.accept_token(t)
    fresh.fill_next_token_bitmask(want, 0)
    assert torch.equal(words[len(kept) :], want)
    assert not fresh.accept_token(drafts[len(kept)])  # the cut token is the grammar's first refusal


class _Broken(_FirstFour):
    """Allows tokens 4..7 (not EOS, 0) for its first mask and fails from its second on: the
    first token comes from the prefill's sampler, the failure from a verify step's guide_drafts."""

    fills = 0

    def matcher(self):
        return self

    def fill_next_token_bitmask(self, bitmask, index):
        self.fills += 1
        if self.fills > 1:
            raise RuntimeError("matcher fell over")
        bitmask[index] = 0
        bitmask[index, 0] = 0b11110000

    def accept_token(self, token):
        return 4 <= token < 8


def test_a_failing_matcher_under_speculation_fails_its_request_alone():
    llm = _llm({"method": "ngram", "num_speculative_tokens": 3})
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = "ab ab ab ab ab ab"
    alone = llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].text
    outs = llm.generate([prompt, prompt], [plain, SamplingParams(max_tokens=8, guide=_Broken())], use_tqdm=False)
    assert outs[0].outputs[0].text == alone and outs[0].error is None
    # (the failed verify step preempts both; recomputed alone, its sampler fails the row)
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].error
    assert len(outs[1].outputs[0].token_ids) == 1
    m = llm.get_metrics()
    assert m["state_slots_free"] == m["state_slots_total"] and m["kv_pages_free"] == m["kv_pages_total"]
