"""Speculative decoding never changes greedy output and samples the target distribution exactly."""

import json

import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.engine.spec.decoder import SpecConfig, SpecDecoder
from hyla.engine.spec.acceptance import accept, accept_argmax, argmax_accepts
from tests.engine.spec_check import assert_spec_equals_greedy
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.oracles.variants import noisy_lm_head_copy
from tests.oracles.variants import rand_tokens as rand

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("spec"), "moe", with_tokenizer=True)


@pytest.fixture(scope="module")
def near_draft(ckpt, tmp_path_factory):
    """The target with noise on its LM head: agrees often, not always (partial acceptance)."""
    return noisy_lm_head_copy(ckpt, tmp_path_factory.mktemp("draft") / "near")


PROMPTS = [rand(12, 1) * 3, rand(30, 2), rand(5, 3) * 4 + [9], [7], rand(70, 4)]


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(str(ckpt), dtype="float64")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("rollback", ["slots", "replay"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_greedy_equals_plain_greedy(ckpt, near_draft, reference, rollback, method, prefix_cache):
    assert_spec_equals_greedy(ckpt, near_draft, PROMPTS, GREEDY, reference, rollback, method, prefix_cache)


@pytest.mark.parametrize("rollback", ["slots", "replay"])
def test_a_b_a_with_prefix_cache_is_never_poisoned(ckpt, near_draft, rollback):
    """Request A, then B sharing A's prefix, then A again (the pattern that poisoned vLLM's
    cache, #43559): with speculation and the cache on, all equal the plain outputs."""
    shared = rand(40, 11)
    a, b = shared + rand(6, 12), shared + rand(9, 13)
    plain = LLM(str(ckpt), dtype="float64")
    want = [plain.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in (a, b, a)]
    cfg = {"method": "draft_model", "model": str(near_draft), "num_speculative_tokens": 4, "rollback": rollback}
    llm = LLM(str(ckpt), dtype="float64", speculative_config=cfg, enable_prefix_caching=True)
    got = []
    for p in (a, b, a, a + want[0]):
        got.append(llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    assert got[:3] == want
    assert got[3] == plain.generate([a + want[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.get_metrics()["prefix_cache_hit_tokens"] >= len(a) - 1


@pytest.mark.parametrize("rollback,k", [("slots", 1), ("replay", 3)])
def test_spec_with_preemption(ckpt, near_draft, rollback, k):
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain = LLM(str(ckpt), dtype="float64", max_model_len=160)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, long, use_tqdm=False)]
    cfg = {"method": "draft_model", "model": str(near_draft), "num_speculative_tokens": k, "rollback": rollback}
    slot, page = plain.engine.model.state_bytes_per_slot(), plain.engine.model.kv_bytes_per_token() * 16
    # Slots take at most half the budget: ~3 running requests and fewer pages than they need.
    llm = LLM(str(ckpt), dtype="float64", speculative_config=cfg, max_model_len=160,
              memory_budget=10 * slot + 8 * page)
    outs = llm.generate(PROMPTS, long, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.get_metrics()["num_preemptions"] > 0


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def test_acceptance_rule_samples_the_target_distribution():
    V, k, n = 6, 2, 12000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, V, generator=gen) * 1.5
    q = torch.softmax(torch.randn(k, V, generator=gen), -1)
    seq = type("S", (), {"params": SamplingParams(temperature=1.0), "token_ids": [1], "output_token_ids": []})()
    p0 = torch.softmax(logits[0], -1)
    first = torch.zeros(V)
    naive = torch.zeros(V)
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        first[accept(logits, drafts, q, seq, gen)[0]] += 1
        naive[drafts[0]] += 1  # a wrong rule: always take the draft
    assert _chi2_pvalue(first, p0) > 1e-3
    assert _chi2_pvalue(naive, p0) < 1e-6  # the test has the power to reject a wrong rule


@pytest.mark.parametrize("dtype", ["float64", "float32"])  # float32 on CUDA: the verify CUDA graphs
def test_end_to_end_sampling_distribution_tiny_vocab(tmp_path, dtype):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from hyla.models import load_model
    from tests.oracles.kimi_checkpoint import TINY, VARIANTS

    cfg = KimiLinearConfig(**{**TINY, "vocab_size": 8, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
                           **VARIANTS["dense"])
    torch.manual_seed(3)
    model = KimiLinearForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # sharper, structured next-token distributions
    model.save_pretrained(tmp_path / "tiny8")
    path = tmp_path / "tiny8"
    prompt = [3, 4, 5, 6, 7, 1, 0, 2, 3, 4, 5]  # every token occurs: prompt lookup always drafts
    ref = load_model(path, dtype=torch.float64)
    with torch.no_grad():
        p1 = torch.softmax(ref(torch.tensor([prompt]))[0, -1], -1)
        p2 = torch.stack([torch.softmax(ref(torch.tensor([prompt + [t]]))[0, -1], -1) for t in range(8)])
    marginal = (p1[:, None] * p2).sum(0)  # distribution of the second generated token
    llm = LLM(str(path), dtype=dtype, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              max_num_seqs=64)
    n = 1500
    # max_tokens=3: after the first token one draft fits, so the second token goes through accept().
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True)
                                       for s in range(n)], use_tqdm=False)
    counts = torch.zeros(8)
    for o in outs:
        counts[o.outputs[0].token_ids[1]] += 1
    assert llm.get_metrics()["spec_num_accepted_tokens"] > 0
    assert _chi2_pvalue(counts, marginal) > 1e-3


def test_spec_config_validation():
    with pytest.raises(ValueError, match="method"):
        SpecConfig.parse({"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="rollback"):
        SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "rollback": "copy"})
    with pytest.raises(ValueError, match="model"):
        SpecConfig.parse({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown keys"):
        SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "foo": 1})
    assert json.dumps(SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).__dict__)


def test_ngram_drafts_are_accepted_on_repetitive_code():
    """The n-gram drafter must actually work: on the bundled code model and a repetitive prompt,
    drafts are accepted and the output equals plain greedy decoding."""
    from hyla.bench.spec import REPETITIVE
    from hyla.models import default_model_path

    model = str(default_model_path())
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model).generate(REPETITIVE, sp, use_tqdm=False)]
    for rollback in ("slots", "replay"):
        llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "rollback": rollback})
        assert [o.outputs[0].token_ids for o in llm.generate(REPETITIVE, sp, use_tqdm=False)] == want
        m = llm.get_metrics()
        assert m["spec_num_accepted_tokens"] > 0.15 * m["spec_num_draft_tokens"] > 0
        assert m["spec_mean_accepted_length"] > 1.3


def test_seeded_speculative_sampling_is_reproducible(ckpt, near_draft):
    """Unseeded requests with temperature > 0: two engines with the same EngineConfig.seed give
    the same tokens (the draft model and the acceptance rule draw from the engine's generator,
    not from torch's global RNG, which is moved between the two runs on purpose)."""
    cfg = {"method": "draft_model", "model": str(near_draft), "num_speculative_tokens": 3}
    sp = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    runs = []
    for global_seed in (1, 2):
        llm = LLM(str(ckpt), dtype="float64", speculative_config=cfg, seed=5)
        torch.manual_seed(global_seed)
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], sp, use_tqdm=False)])
        assert llm.get_metrics()["spec_num_draft_tokens"] > 0
    assert runs[0] == runs[1]


def _stand_in(params, tokens=(1, 2), guide=None):
    """A request as the acceptance rule reads it."""
    return type("S", (), {"params": params, "token_ids": list(tokens), "output_token_ids": [tokens[-1]],
                          "guide": guide, "generator": None})()


def test_batched_argmax_acceptance_equals_accept():
    """accept_argmax (one argmax over every request's rows, one copy) gives accept's tokens for
    greedy requests: every draft accepted (+ the bonus token), the first or a middle one
    rejected, no drafts, ties (the first maximum, as argmax)."""
    V = 7
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(14, V, generator=gen, dtype=torch.float64)
    logits[10, :] = 0.5  # a tie everywhere: the request without drafts emits token 0
    top = logits.argmax(-1).tolist()
    # rows 0-3: 3 drafts, all accepted; 4-7: the second of 3 rejected; 8-9: the only one
    # rejected; 10: no drafts; 11-13: 2 drafts, all accepted
    drafts = [top[0:3], [top[4], (top[5] + 1) % V, top[6]], [(top[8] + 1) % V], [], top[11:13]]
    seqs = [_stand_in(SamplingParams(temperature=0.0)) for _ in drafts]
    start, want = 0, []
    for seq, d in zip(seqs, drafts):
        want.append(accept(logits[start:start + 1 + len(d)], d, None, seq, gen))
        start += 1 + len(d)
    assert start == 14
    assert accept_argmax(logits, drafts) == want
    assert [len(t) for t in want] == [4, 2, 1, 1, 3]


def test_argmax_acceptance_only_where_it_is_accept():
    greedy = SamplingParams(temperature=0.0)
    assert argmax_accepts(_stand_in(greedy))
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, repetition_penalty=1.2),
                   SamplingParams(temperature=0.0, presence_penalty=0.5),
                   SamplingParams(temperature=0.0, frequency_penalty=0.5),
                   SamplingParams(temperature=0.0, logit_bias={3: 5.0})):
        assert not argmax_accepts(_stand_in(params)), params
    assert not argmax_accepts(_stand_in(greedy, guide=object()))


def test_spec_decoder_accepts_a_mixed_batch_as_accept_does():
    """SpecDecoder._accept: plain greedy requests batched, a penalised greedy one and a sampling
    one by accept, each with its own rows; the same tokens and rows as accept request by request."""
    V = 9
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(10, V, generator=gen, dtype=torch.float64) * 3
    top = logits.argmax(-1).tolist()  # rows 0-2, 3-5, 6-7 and 8-9 are the four requests'
    seqs = [_stand_in(SamplingParams(temperature=0.0)),
            _stand_in(SamplingParams(temperature=0.0, repetition_penalty=1.5), tokens=tuple(range(V))),
            _stand_in(SamplingParams(temperature=1.0)), _stand_in(SamplingParams(temperature=0.0))]
    drafts = [top[0:2], [top[3], top[4]], [1], [(top[8] + 1) % V]]
    got = SpecDecoder._accept(seqs, drafts, [None] * 4, [None] * 4, logits, torch.Generator().manual_seed(3))
    start, want, ref_gen = 0, [], torch.Generator().manual_seed(3)
    for seq, d in zip(seqs, drafts):
        rows = logits[start:start + 1 + len(d)]
        want.append((accept(rows, d, None, seq, ref_gen), rows))
        start += 1 + len(d)
    assert start == 10
    assert [r.tokens for r in got] == [t for t, _ in want]
    assert len(want[0][0]) == 3 and len(want[3][0]) == 1  # all accepted + the bonus; the first rejected
    assert [r.num_drafted for r in got] == [len(d) for d in drafts]
    for r, (_, rows) in zip(got, want):
        assert torch.equal(r.logits, rows)


def test_profile_splits_a_speculative_step(ckpt):
    """hyla bench spec --profile: a speculative step's mean time by part (propose, verify,
    accept, commit, bookkeeping) adds up to the whole speculative step."""
    from hyla.bench.spec import StepProfile

    llm = LLM(str(ckpt), dtype="float64", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    prof = StepProfile(llm)
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    split = prof.split()
    assert list(split) == ["propose", "verify", "accept", "commit", "bookkeeping"]
    steps = prof.times["spec step (all)"]
    assert sum(split.values()) == pytest.approx(sum(steps) / len(steps))
    assert all(t >= 0 for t in split.values()) and "per speculative step" in prof.report()
    prof.unwrap()
    assert "step" not in vars(llm.engine.spec)  # the methods are back


def test_a_greedy_batch_accepts_without_the_per_request_rule(ckpt, reference, monkeypatch):
    """Plain greedy requests never go through `accept` (one batched argmax instead); a request
    with a repetition penalty does. Output stays plain greedy."""
    from hyla.engine.spec import decoder as spec_decode

    calls = []
    monkeypatch.setattr(spec_decode, "accept", lambda *a, **k: calls.append(1) or accept(*a, **k))
    llm = LLM(str(ckpt), dtype="float64", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert llm.get_metrics()["spec_num_verify_steps"] > 0 and not calls
    penalised = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    llm.generate(PROMPTS[:1], penalised, use_tqdm=False)
    assert calls
