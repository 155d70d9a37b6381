"""Sampler: logits -> next tokens, with penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Drawing uses each request's own generator when it has a seed, so a seeded request gives the same
tokens whatever else is batched. Logprobs are the log-softmax of the model's raw logits (before
penalties and temperature), as vLLM returns by default. `distribution` is also what speculative
decoding's acceptance rule compares drafts against.
"""

from __future__ import annotations

import torch

from hyla.engine.sequence import Sequence


def penalize(row: torch.Tensor, params, token_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """Apply repetition (prompt + output) and presence / frequency (output) penalties to one
    row of logits [V] (out of place)."""
    if params.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row = row.clone()
        row[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        ids, counts = torch.tensor(output_ids, device=row.device).unique(return_counts=True)
        row = row.clone()
        row[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(row.dtype)
    return row


def _filter(logits: torch.Tensor, p) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p exclude from one row of temperature-scaled logits."""
    if p.top_k not in (0, -1) and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= p.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def distribution(row: torch.Tensor, params) -> torch.Tensor:
    """The distribution a (non-greedy) request samples from: penalised logits [V] -> probs [V]."""
    return _filter(row.float() / params.temperature, params).softmax(-1)


def choose(row: torch.Tensor, params, generator: torch.Generator) -> int:
    """One token from penalised logits [V]: argmax when greedy, else a draw from `distribution`."""
    if params.greedy:
        return int(row.argmax())
    return int(torch.multinomial(distribution(row, params), 1, generator=generator))


def token_logprobs(raw_row: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """{token: logprob} for the emitted token and the top-n of one raw logits row [V]."""
    lp = torch.log_softmax(raw_row.float(), dim=-1)
    entry = {token: float(lp[token])}
    if n:
        top = torch.topk(lp, n)
        entry.update({int(t): float(v) for t, v in zip(top.indices, top.values)})
    return entry


def sample(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator) -> tuple[list[int], list]:
    """logits: [M, V] fp32 for M sequences -> (token ids, per-row logprob dicts or None). A row
    whose draw fails gets token None and the exception in place of its logprobs."""
    logits = logits.float().cpu()
    tokens, logprobs = [], []
    for row, seq in zip(logits, seqs):
        p = seq.params
        gen = seq.generator if seq.generator is not None else generator
        try:
            token = choose(penalize(row, p, seq.token_ids, seq.output_token_ids), p, gen)
        except RuntimeError as err:  # e.g. non-finite logits: fail this request only
            tokens.append(None)
            logprobs.append(err)
            continue
        tokens.append(token)
        logprobs.append(None if p.logprobs is None else token_logprobs(row, token, p.logprobs))
    return tokens, logprobs
