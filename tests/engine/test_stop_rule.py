"""The stop rule and the greedy acceptance rule (hyla.engine.spec.acceptance): each rule's device
form decides as its host form does, on random inputs.

Stop rule: random requests (EOS ids in every form the engine takes, stop_token_ids, ignore_eos,
min_tokens, max_tokens, the output so far) and a verify step's tokens, stop ids planted among
the kept ones, past them, or none. Where device_stop_ids admits a request, the device form
(kept_through_stop, and derive_step_rows, which evaluates it for the overlapped MTP step) keeps
exactly the tokens Sequence.check_stop keeps as the engine appends them one by one, and ends the
request where it does. Where it does not admit one, the plain device rule would disagree in some
cases (min_tokens, max_tokens): the gate is what makes the forms agree.

Acceptance: accepted_drafts (padded rows, -1 past a request's drafts) against accept_argmax
(packed rows of the target's logits)."""

from __future__ import annotations

import random

import torch

from hyla.engine.sampling_params import SamplingParams
from hyla.engine.sequence import Sequence
from hyla.engine.spec.acceptance import (
    accept_argmax,
    accepted_drafts,
    device_stop_ids,
    kept_through_stop,
    stop_ids,
    stopping_token,
)
from hyla.ops.step_rows import derive_step_rows

V = 12  # a small vocabulary: stop ids come up often
S = 6  # stop ids per row on the device (-1: none)


def _request(rnd: random.Random) -> Sequence:
    """A running request with a random output so far and random stop settings."""
    eos = rnd.choice([None, rnd.randrange(V), tuple(rnd.sample(range(V), rnd.randint(0, 3))),
                      rnd.sample(range(V), rnd.randint(1, 2))])
    max_tokens = rnd.randint(1, 14)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=rnd.randint(0, min(max_tokens, 6)),
                            ignore_eos=rnd.random() < 0.3, stop_token_ids=rnd.sample(range(V), rnd.randint(0, 2)))
    seq = Sequence("r", None, [rnd.randrange(V)], params, max_tokens, eos)
    seq.output_token_ids += [rnd.randrange(V) for _ in range(rnd.randint(0, max_tokens - 1))]  # still running
    return seq


def _step(rnd: random.Random, seq: Sequence) -> tuple[list[int], int]:
    """A verify step's tokens [W] and the drafts accepted: the first acc + 1 tokens are kept."""
    W = rnd.randint(1, 4)
    acc = rnd.randint(0, W - 1)
    top = [rnd.randrange(V) for _ in range(W)]
    ids = stop_ids(seq.params, seq.eos_token_ids)
    if ids and rnd.random() < 0.6:  # a stop id among the kept tokens, or past them
        top[rnd.randrange(W)] = rnd.choice(ids)
    return top, acc


def _host(seq: Sequence, tokens: list[int]) -> tuple[int, bool]:
    """LLMEngine.append_tokens: the tokens appended one by one, each checked -> (kept, stopped
    by a token: finish reason "stop")."""
    kept = 0
    for token in tokens:
        seq.append_token(token, None)
        seq.check_stop(None)
        kept += 1
        if seq.is_finished:
            break
    return kept, seq.is_finished and seq.finish_reason == "stop"


def _device(top: list[int], acc: int, ids: list[int]) -> tuple[int, bool]:
    stops = torch.tensor([ids + [-1] * (S - len(ids))])
    stopped, kept = kept_through_stop(torch.tensor([top]), torch.tensor([[acc]]), stops)
    return int(kept), bool(stopped)


def test_the_device_stop_rule_keeps_what_the_host_keeps():
    rnd = random.Random(0)
    admitted = refused_differently = 0
    for _ in range(3000):
        seq = _request(rnd)
        top, acc = _step(rnd, seq)
        ids = device_stop_ids(seq, horizon=len(top))
        plain = stop_ids(seq.params, seq.eos_token_ids)
        host = _host(seq, top[:acc + 1])
        if ids is None:
            refused_differently += _device(top, acc, plain) != host
            continue
        admitted += 1
        assert ids == plain and len(ids) <= S
        assert _device(top, acc, ids) == host, (seq.params, seq.eos_token_ids, top, acc)
    assert admitted > 500 and refused_differently > 50  # both sides of the gate were exercised


def test_derive_step_rows_applies_the_device_stop_rule():
    """derive_step_rows (torch; its Triton kernel is checked against it in tests/ops/
    test_step_rows.py): a request whose kept tokens hold a stop id gets padding rows and the
    host's kept count, the others their next rows."""
    rnd = random.Random(1)
    for _ in range(200):
        n, W = rnd.randint(1, 5), rnd.randint(1, 4)
        k = W - 1
        seqs = [_request(rnd) for _ in range(n)]
        steps = [(top + [rnd.randrange(V)] * (W - len(top)), acc) for top, acc in (_step(rnd, s) for s in seqs)]
        steps = [(top[:W], min(acc, k)) for top, acc in steps]
        ids = [stop_ids(s.params, s.eos_token_ids)[:S] for s in seqs]
        base = torch.tensor([[100, 200] + i + [-1] * (S - len(i)) for i in ids])
        prev = torch.tensor([top + [acc] + [rnd.randrange(V) for _ in range(k)] for top, acc in steps])
        vmeta, emeta = torch.zeros(n, 2 + 2 * W, dtype=torch.long), torch.zeros(n, W, dtype=torch.long)
        vpad, epad = torch.full((2 + 2 * W,), -7), torch.full((W,), -7)
        kept = torch.zeros(n, dtype=torch.long)
        derive_step_rows(base, prev, vmeta, emeta, vpad, epad, kept)
        for i, (top, acc) in enumerate(steps):
            want_kept, want_stopped = _device(top, acc, ids[i])
            assert int(kept[i]) == want_kept
            assert bool((vmeta[i] == -7).all()) == want_stopped and bool((emeta[i] == -7).all()) == want_stopped


def test_stopping_token_is_membership_in_stop_ids_past_min_tokens():
    rnd = random.Random(2)
    for _ in range(500):
        seq = _request(rnd)
        p, n = seq.params, rnd.randint(1, 14)
        ids = stop_ids(p, seq.eos_token_ids)
        for token in range(V):
            assert (stopping_token(p, seq.eos_token_ids, token, n) is not None) == (n >= p.min_tokens and token in ids)


def test_the_device_acceptance_accepts_what_the_host_accepts():
    """accepted_drafts on padded rows (drafts -1 past a request's k_n) against accept_argmax on
    the packed rows: the same tokens kept, for drafts that match the argmax for a while."""
    rnd = random.Random(3)
    for _ in range(200):
        bs, W = rnd.randint(1, 6), rnd.randint(1, 5)
        k = W - 1
        top = [[rnd.randrange(V) for _ in range(W)] for _ in range(bs)]
        drafts = []
        for row in top:
            kn = rnd.randint(0, k)
            good = rnd.randint(0, kn)  # drafts equal to the argmax before the first that differs
            drafts.append([row[j] if j < good else rnd.randrange(V) for j in range(kn)])
        logits = torch.cat([torch.nn.functional.one_hot(torch.tensor(row[:1 + len(d)]), V).double()
                            for row, d in zip(top, drafts)])
        host = accept_argmax(logits, drafts)
        padded = torch.tensor([d + [-1] * (k - len(d)) for d in drafts], dtype=torch.long).view(bs, k)
        n = accepted_drafts(torch.tensor(top), padded).tolist()
        assert [row[:a + 1] for row, a in zip(top, n)] == host
