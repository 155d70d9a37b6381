"""The batched on-device sampler against a row-wise reference (the sampler as it was, one row at a
time on the host): masks, penalties, distributions (chi-square), seeds, logprobs, failures, and
exactly one device->host copy per step."""

from types import SimpleNamespace

import pytest
import torch

from hyla.engine import sampler
from hyla.engine.sampler import distribution, penalize_batch, probs_batch, sample
from hyla.engine.sampling_params import SamplingParams

V = 40


# ---- the row-wise reference ------------------------------------------------------------------
def ref_penalize(row, p, token_ids, output_ids):
    if p.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(sorted(set(token_ids)))
        vals = row[seen]
        row = row.clone()
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        ids, counts = torch.tensor(output_ids).unique(return_counts=True)
        row = row.clone()
        row[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(row.dtype)
    return row


def ref_distribution(row, p):
    logits = row.float() / p.temperature
    if p.top_k not in (0, -1) and p.top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits.softmax(-1)


def seq(params, prompt=(1, 2, 3), output=(), seed=None):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SimpleNamespace(params=params, token_ids=list(prompt) + list(output), output_token_ids=list(output),
                           generator=gen)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2.0, dtype=torch.float64), stat / 2))


SETTINGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(top_p=0.8),
    SamplingParams(min_p=0.15),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
    SamplingParams(top_k=1),
    SamplingParams(top_k=V + 5, top_p=0.5),  # k beyond the vocabulary: no top-k
]


# ---- batched == row-wise ---------------------------------------------------------------------
def test_filters_equal_the_rowwise_reference():
    gen = torch.Generator().manual_seed(0)
    params = SETTINGS * 3
    logits = torch.randn(len(params), V, generator=gen) * 2
    got = probs_batch(logits, params)
    for row, p, g in zip(logits, params, got):
        want = ref_distribution(row, p)
        assert torch.equal(g == 0, want == 0)  # the same tokens masked
        torch.testing.assert_close(g, want)
        torch.testing.assert_close(distribution(row, p), want)


def test_penalties_equal_the_rowwise_reference():
    gen = torch.Generator().manual_seed(1)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.7),
              SamplingParams(frequency_penalty=-0.4), SamplingParams(),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=1.5),
              SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5)]
    hist = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (5, 9, 30, 4, 12, 0)]
    outs = [h[len(h) // 2 :] for h in hist]
    logits = torch.randn(len(params), V, generator=gen) * 3
    got = penalize_batch(logits, params, hist, outs)
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i], ref_penalize(logits[i], p, hist[i], outs[i]))
    assert not torch.equal(got, logits)  # penalties were applied, out of place


def test_greedy_rows_are_the_argmax_of_the_penalised_logits():
    gen = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=3.0),
              SamplingParams(temperature=0.0, frequency_penalty=2.0), SamplingParams(temperature=0.0, top_k=5)]
    seqs = [seq(p, prompt=[7, 8], output=[9, 9]) for p in params]
    logits = torch.randn(len(seqs), V, generator=gen)
    logits[:, 9] = logits[:, 7] = 6.0  # the penalised tokens lead before the penalties
    tokens, _ = sample(logits, seqs, torch.Generator().manual_seed(0))
    for t, s, row in zip(tokens, seqs, logits):
        assert t == int(ref_penalize(row, s.params, s.token_ids, s.output_token_ids).argmax())
    assert tokens[0] in (7, 9) and tokens[1] not in (7, 8, 9) and tokens[2] != 9


# ---- distributions ---------------------------------------------------------------------------
def test_chi_square_every_setting_in_one_mixed_batch():
    """Rows of all settings interleaved in each batch; each setting's counts against its own
    reference distribution (and never a token that its filters exclude)."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(V, generator=gen) * 1.5
    reps, steps = 1000, 6
    seqs = [seq(p) for _ in range(reps) for p in SETTINGS]
    counts = torch.zeros(len(SETTINGS), V, dtype=torch.float64)
    engine_gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        tokens, _ = sample(base.expand(len(seqs), V), seqs, engine_gen)
        t = torch.tensor(tokens).view(reps, len(SETTINGS))
        for j in range(len(SETTINGS)):
            counts[j] += torch.bincount(t[:, j], minlength=V)
    for j, p in enumerate(SETTINGS):
        want = ref_distribution(base, p)
        assert counts[j][want == 0].sum() == 0, p
        if (want > 0).sum() > 1:
            assert chi2_pvalue(counts[j], want) > 1e-3, p
    # The test has the power to tell a filtered distribution from the unfiltered one.
    assert chi2_pvalue(counts[0], torch.softmax(base, -1)) < 1e-6


# ---- seeds -----------------------------------------------------------------------------------
def test_a_seeded_request_samples_the_same_tokens_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(5)
    mine = SamplingParams(temperature=1.5, top_p=0.95, seed=11)
    logits = torch.randn(8, 500, generator=gen)

    def run(position, others):
        s = seq(mine, seed=11)
        batch = others[:position] + [s] + others[position:]
        out = []
        for step in range(10):
            rows = [logits[(step + i) % 8] for i in range(len(batch))]
            rows[position] = logits[step % 8]  # this request's logits do not depend on the batch
            tokens, _ = sample(torch.stack(rows), batch, torch.Generator().manual_seed(100 + position))
            out.append(tokens[position])
        return out

    alone = run(0, [])
    assert len(set(alone)) > 3  # it does sample
    for position in (0, 1, 3):
        others = [seq(SamplingParams(temperature=1.0)), seq(SamplingParams(temperature=0.8, seed=12), seed=12),
                  seq(SamplingParams(temperature=0.0)), seq(SamplingParams(top_k=5))]
        assert run(position, others) == alone
    other_seed = seq(SamplingParams(temperature=1.5, top_p=0.95, seed=13), seed=13)
    assert [sample(logits[i % 8][None], [other_seed], None)[0][0] for i in range(10)] != alone


# ---- logprobs --------------------------------------------------------------------------------
def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    gen = torch.Generator().manual_seed(6)
    params = [SamplingParams(logprobs=3, repetition_penalty=2.0), SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(), SamplingParams(temperature=0.5, logprobs=5, presence_penalty=1.0),
              SamplingParams(temperature=0.0)]
    seqs = [seq(p, output=[4, 5]) for p in params]
    logits = torch.randn(len(seqs), V, generator=gen, dtype=torch.float64)
    tokens, logprobs = sample(logits, seqs, torch.Generator().manual_seed(0))
    for t, lp, s, row in zip(tokens, logprobs, seqs, logits):
        n = s.params.logprobs
        if n is None:
            assert lp is None
            continue
        full = torch.log_softmax(row.float(), -1)
        top = torch.topk(full, n)
        assert set(lp) == {t} | set(top.indices.tolist())
        for tok, v in lp.items():
            assert v == pytest.approx(float(full[tok]), abs=1e-6)
        assert sampler.token_logprobs(row, t, n) == pytest.approx(lp)


# ---- failures --------------------------------------------------------------------------------
def test_a_non_finite_row_fails_only_that_request():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, V, generator=gen)
    logits[1, 3] = float("nan")
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")
    logits[4, :10] = float("-inf")  # some masked tokens are fine
    params = [SamplingParams(logprobs=2), SamplingParams(logprobs=2), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.9), SamplingParams(logprobs=1), SamplingParams(temperature=0.0)]
    seqs = [seq(p) for p in params]
    tokens, logprobs = sample(logits, seqs, torch.Generator().manual_seed(0))
    assert [t is None for t in tokens] == [False, True, True, True, False, False]
    for i in (1, 2, 3):
        assert isinstance(logprobs[i], RuntimeError)
    assert tokens[4] >= 10 and tokens[5] == int(logits[5].argmax())
    assert set(logprobs[0]) >= {tokens[0]} and len(logprobs[4]) <= 2


def test_a_temperature_near_zero_or_huge_logits_never_overflow():
    """Logits near fp32's largest divided by a small temperature used to overflow to inf (a
    failed request); the rows are shifted to their largest first, so the distribution is the
    right one: all of it on the largest logit."""
    logits = torch.full((2, V), 1e37)
    logits[:, 0] = 3e38
    seqs = [seq(SamplingParams(temperature=1e-3)), seq(SamplingParams(temperature=0.0))]
    tokens, logprobs = sample(logits, seqs, torch.Generator().manual_seed(0))
    assert tokens == [0, 0]


@pytest.mark.parametrize("value", [1e-300, 5e-324, 2.2e-313])
def test_extreme_top_p_and_repetition_penalty_give_their_limits(value):
    """top_p below fp32's smallest value keeps the first token (greedy); a repetition penalty
    that small makes the seen positive tokens win, the largest of them first (the limit), and
    one that large makes them lose; never a non-finite distribution."""
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(V, generator=gen) * 3
    seen = [int(i) for i in torch.randperm(V, generator=gen)[:5]]
    top_p = probs_batch(row[None], [SamplingParams(top_p=value)])[0]
    assert torch.isfinite(top_p).all() and int(top_p.argmax()) == int(row.argmax()) and top_p.max() == 1.0
    low = SamplingParams(repetition_penalty=value)
    x = penalize_batch(row[None], [low], [seen], [[]])[0]
    assert torch.isfinite(x).all()
    positive = [t for t in seen if row[t] > 0]
    if positive:
        assert int(x.argmax()) == max(positive, key=lambda t: float(row[t]))
        probs = probs_batch(x[None], [low])[0]
        assert torch.isfinite(probs).all() and set(torch.nonzero(probs).flatten().tolist()) <= set(positive)
    high = penalize_batch(row[None], [SamplingParams(repetition_penalty=1e300)], [seen], [[]])[0]
    assert torch.isfinite(high).all() and int(high.argmax()) not in positive
    tokens, logprobs = sample(row[None].repeat(2, 1), [seq(low, prompt=seen), seq(SamplingParams(top_p=value))],
                              torch.Generator().manual_seed(0))
    assert None not in tokens


# ---- one device->host copy per step ----------------------------------------------------------
def test_argmax_draws_equal_greedy_sampling_ties_and_non_finite_rows_included():
    """A decode graph's argmax (sampler.argmax_ids) handed to PendingSample gives what the
    sampler's own pass gives a greedy batch: the first of equal maxima, and a failed draw
    (None and the error) for a row with nan, +inf or no finite logit."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(9, V, generator=gen)
    logits[0, [4, 9, 30]] = 50.0  # a three-way tie: the first wins
    logits[1, [V - 1, 0]] = 50.0
    logits[2, 3] = float("nan")
    logits[3, 5] = float("inf")
    logits[4] = float("-inf")
    logits[5, :10] = float("-inf")  # some masked tokens are fine
    logits[6] = 7.0  # all equal
    seqs = [seq(SamplingParams(temperature=0.0)) for _ in range(len(logits))]
    want = sample(logits, seqs, torch.Generator().manual_seed(0))
    got = sampler.PendingSample(logits, seqs, torch.Generator().manual_seed(0), sampler.argmax_ids(logits)).result()
    assert got[0] == want[0] == [4, 0, None, None, None, got[0][5], 0, got[0][7], got[0][8]]
    assert [type(e) for e in got[1]] == [type(e) for e in want[1]]
    assert all(isinstance(got[1][i], RuntimeError) for i in (2, 3, 4))


def test_one_device_to_host_copy_per_step(monkeypatch):
    """Everything before `_to_host` stays a tensor: every way to pull a tensor to the host
    raises until then, and `_to_host` runs once per call."""
    orig_tolist = torch.Tensor.tolist
    calls = []

    def forbidden(*args, **kwargs):
        raise AssertionError("a device->host copy outside _to_host")

    def to_host(packed):
        calls.append(packed.numel())
        return orig_tolist(packed)

    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    monkeypatch.setattr(sampler, "_to_host", to_host)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(seed=1, top_k=4, repetition_penalty=1.2),
              SamplingParams(top_p=0.7, min_p=0.1, frequency_penalty=0.5, logprobs=0), SamplingParams(seed=2),
              SamplingParams(presence_penalty=1.0)]
    seqs = [seq(p, output=[1, 2, 2], seed=p.seed) for p in params]
    logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(8))
    logits[3, 0] = float("nan")
    for step in range(3):
        tokens, logprobs = sample(logits, seqs, torch.Generator().manual_seed(0))
        assert len(calls) == step + 1
    assert tokens[3] is None and all(t is not None for i, t in enumerate(tokens) if i != 3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(logit_bias={1: 200}), "-100..100"), (dict(logit_bias={-1: 1.0}), "non-negative token ids"),
    (dict(temperature=float("nan")), "finite"), (dict(seed=1 << 64), "seed"),
])
def test_bad_sampling_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_logit_bias_moves_the_greedy_token():
    x = torch.zeros(2, 5)
    x[:, 0] = 1.0
    params = [SamplingParams(temperature=0, logit_bias={3: 5.0}), SamplingParams(temperature=0)]
    out = penalize_batch(x, params, [[], []], [[], []])
    assert out.argmax(-1).tolist() == [3, 0] and x[0, 3] == 0  # out of place
