"""allowed_token_ids and bad_words: the batched mask equals a row-wise reference, bad words are
tokenised by vLLM's rule, the engine honours both (greedy and sampled), refuses what it cannot
honour, and greedy output with speculation (n-gram, a draft model, an MTP head) equals the plain
greedy output under the masks."""

import itertools
from types import SimpleNamespace

import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.engine import sampler
from hyla.engine.sampler import banned_tokens, restrict_batch, sample
from hyla.engine.spec.acceptance import argmax_accepts
from tests.oracles.kimi_checkpoint import WORDS, build_kimi_checkpoint
from tests.oracles.qwen3_5_checkpoint import add_mtp_shard, build_qwen3_5_checkpoint
from tests.oracles.variants import noisy_lm_head_copy
from tests.oracles.variants import rand_tokens as rand

V = 50


def params(allowed=None, words=None, **kw) -> SamplingParams:
    p = SamplingParams(allowed_token_ids=allowed, **kw)
    p.bad_words_token_ids = words  # as LLMEngine.validate leaves it (resolve_bad_words)
    return p


def ref_restrict(row: torch.Tensor, p, output: list[int]) -> torch.Tensor:
    """One row at a time, the rule as vLLM states it."""
    row = row.clone()
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        row[~keep] = float("-inf")
    for word in p.bad_words_token_ids or []:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            row[word[-1]] = float("-inf")
    return row


CASES = [  # (params, output so far)
    (params(), [1, 2]),
    (params(allowed=[3, 7, 9]), []),
    (params(words=[[5]]), []),  # a one-token word: always banned
    (params(words=[[4, 5], [6, 7, 8], [4, 9]]), [1, 6, 7]),  # [6, 7] ends the output: 8 banned
    (params(words=[[4, 5], [6, 7, 8], [4, 9]]), [1, 4]),  # two words share the prefix 4: 5 and 9
    (params(words=[[2, 3, 4]]), [3]),  # the output is shorter than the prefix: nothing
    (params(allowed=[1, 2, 5], words=[[2], [1, 5]]), [9, 1]),  # both rules in one row
    (params(allowed=list(range(V))), [0]),
]


def test_the_batched_mask_equals_the_row_wise_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(CASES), V, generator=g)
    got = restrict_batch(x, [p for p, _ in CASES], [o for _, o in CASES])
    for i, (p, out) in enumerate(CASES):
        assert torch.equal(got[i], ref_restrict(x[i], p, out)), i
    assert torch.equal(x, torch.randn(len(CASES), V, generator=torch.Generator().manual_seed(0)))  # out of place
    y = x[:3]
    assert restrict_batch(y, [params()] * 3, [[], [], []]) is y  # nothing to mask: the logits as they are


def test_banned_tokens_follow_the_output_tail():
    p = params(words=[[4, 5], [6, 7, 8], [11]])
    assert banned_tokens(p, []) == [11]
    assert banned_tokens(p, [4]) == [5, 11]
    assert banned_tokens(p, [6, 7]) == [8, 11]
    assert banned_tokens(p, [7, 6]) == [11]


def _seq(p, output=()):
    return SimpleNamespace(params=p, token_ids=[1, 2] + list(output), output_token_ids=list(output), generator=None)


def test_sample_honours_the_masks_greedy_and_sampled():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g)
    logits[:, 0] = 50.0  # the unmasked choice would always be 0
    rows = [_seq(params(allowed=[3, 4], temperature=0.0)), _seq(params(words=[[0]], temperature=0.0)),
            _seq(params(allowed=[7, 8, 9], temperature=1.0)), _seq(params(words=[[2, 0]], temperature=0.0), [2])]
    for _ in range(20):
        tokens, _ = sample(logits, rows, g)
        assert tokens[0] == 3 + int(logits[0, 4] > logits[0, 3])
        assert tokens[1] == int(logits[1, 1:].argmax()) + 1
        assert tokens[2] in (7, 8, 9)
        assert tokens[3] != 0


def test_masks_keep_one_device_to_host_copy_per_step(monkeypatch):
    calls = []
    real = sampler._to_host
    monkeypatch.setattr(sampler, "_to_host", lambda packed: calls.append(1) or real(packed))
    logits = torch.randn(2, V)
    sample(logits, [_seq(params(allowed=[1, 2], words=[[3]])), _seq(params(words=[[4, 5]]), [4])],
           torch.Generator().manual_seed(0))
    assert calls == [1]


class _Words:
    """A tokenizer stand-in: one id per character, a leading space merged into the first."""

    def encode(self, text: str) -> list[int]:
        ids = [ord(c) for c in text]
        if text.startswith(" ") and len(text) > 1:
            ids = [1000 + ids[1]] + ids[2:]
        return ids


def test_bad_words_tokenise_by_vllms_rule():
    p = SamplingParams(bad_words=["ab", "  cd", "ab"])  # duplicates dropped, leading spaces stripped
    p.resolve_bad_words(_Words().encode)
    assert p.bad_words_token_ids == [[97, 98], [1097, 98], [99, 100], [1099, 100]]
    # the spaced form is kept only when it differs in its first token and not in length
    p = SamplingParams(bad_words=["x"])
    p.resolve_bad_words(lambda t: [7] if t.strip() == t else [7, 8])
    assert p.bad_words_token_ids == [[7]]
    with pytest.raises(ValueError, match="bad_words entry"):
        SamplingParams(bad_words=["x"]).resolve_bad_words(lambda t: [])
    with pytest.raises(ValueError, match="at most 128"):
        SamplingParams(bad_words=[f"w{i}" for i in range(70)]).resolve_bad_words(_Words().encode)
    for bad in ([""], "word", [3]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)
    for bad in ([], [-1], [True], "1"):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)


def test_the_argmax_shortcuts_leave_masked_requests_to_the_acceptance_rule():
    seq = SimpleNamespace(params=SamplingParams(temperature=0.0), guide=None, guide_pending=None)
    assert argmax_accepts(seq)
    for p in (SamplingParams(temperature=0.0, allowed_token_ids=[1]), SamplingParams(temperature=0.0, bad_words=["a"])):
        assert not argmax_accepts(SimpleNamespace(params=p, guide=None, guide_pending=None))


# ---- the engine ------------------------------------------------------------------------------
WORD_IDS = list(range(7, 7 + len(WORDS)))  # the tiny tokenizer's words (7 specials first)
PROMPTS = [rand(8, 1) * 3, [7, 8, 9] * 4 + [10]]


def masked(**kw) -> SamplingParams:
    """Words only, "cat" and "sat on" banned: the greedy output is all masks' work."""
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 10, "ignore_eos": True, "allowed_token_ids": WORD_IDS,
                             "bad_words": ["cat", "sat on"], **kw})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("masks"), "moe", with_tokenizer=True)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float64")


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, masked(), use_tqdm=False)]


def _words(llm, ids: list[int]) -> list[str]:
    return [llm.tokenizer.decode([t]) for t in ids]


def test_the_engine_honours_both(llm, reference):
    cat, sat, on = (llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("cat", "sat", "on"))
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)]
    assert any(t not in WORD_IDS for out in plain for t in out)  # unmasked, the model writes other ids
    sampled = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, masked(temperature=1.0, seed=3),
                                                            use_tqdm=False)]
    for out in reference + sampled:
        assert set(out) <= set(WORD_IDS) and cat not in out
        assert all(pair != (sat, on) for pair in itertools.pairwise(out)), _words(llm, out)
    allowed_one = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True,
                                                            allowed_token_ids=[11]), use_tqdm=False)
    assert allowed_one[0].outputs[0].token_ids == [11] * 5


def test_the_engine_refuses_what_it_cannot_honour(llm):
    with pytest.raises(ValueError, match="allowed_token_ids token id 256 is outside"):
        llm.generate([[7]], SamplingParams(allowed_token_ids=[3, 256]))
    with pytest.raises(ValueError, match="bad_words entry"):
        llm.generate([[7]], SamplingParams(bad_words=["   "]))
    with pytest.raises(ValueError, match="priority 2 needs the priority scheduling policy"):
        llm.generate([[7]], SamplingParams(priority=2))


@pytest.mark.parametrize("method,rollback", [("ngram", "slots"), ("draft", "replay")])
def test_speculation_gives_the_plain_greedy_output_under_the_masks(ckpt, reference, tmp_path, method, rollback):
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "rollback": rollback}
    if method == "draft":
        draft = noisy_lm_head_copy(ckpt, tmp_path / "near")
        cfg = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "rollback": rollback}
    llm = LLM(str(ckpt), dtype="float64", speculative_config=cfg, max_num_seqs=3)
    outs = llm.generate(PROMPTS, masked(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.get_metrics()["spec_num_draft_tokens"] > 0


def test_mtp_speculation_gives_the_plain_greedy_output_under_the_masks(tmp_path):
    path = build_qwen3_5_checkpoint(tmp_path, "moe", "multimodal", with_tokenizer=True)
    add_mtp_shard(path)
    plain = LLM(str(path), dtype="float64")
    vocab = plain.engine.vocab_size
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, allowed_token_ids=list(range(3, vocab, 2)))
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:2], p, use_tqdm=False)]
    assert all(t % 2 == 1 for out in want for t in out)
    spec = LLM(str(path), dtype="float64", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:2], p, use_tqdm=False)] == want
    assert spec.get_metrics()["spec_num_draft_tokens"] > 0
