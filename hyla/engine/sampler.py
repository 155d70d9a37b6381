"""Sampler: logits -> next tokens, with penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Rows are processed together where the math allows; drawing uses each request's own generator
when it has a seed, so a seeded request gives the same tokens whatever else is in the batch.
Logprobs are the log-softmax of the model's raw logits (before penalties and temperature), as
vLLM returns by default.
"""

from __future__ import annotations

import torch

from hyla.engine.sequence import Sequence


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
            ids, counts = torch.tensor(seq.output_token_ids, device=logits.device).unique(return_counts=True)
            logits[row, ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
    return logits


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


def sample(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator) -> tuple[list[int], list]:
    """logits: [M, V] fp32 for M sequences -> (token ids, per-row logprob dicts or None)."""
    raw = logits
    logits = logits.float().cpu() if logits.device.type != "cpu" else logits.float().clone()
    logits = _apply_penalties(logits, seqs)
    tokens: list[int] = []
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            tokens.append(int(logits[row].argmax()))
            continue
        scaled = _filter(logits[row] / p.temperature, p)
        probs = scaled.softmax(-1)
        gen = seq.generator if seq.generator is not None else generator
        tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    logprobs: list = [None] * len(seqs)
    wanted = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if wanted:
        lp = torch.log_softmax(raw[wanted].float(), dim=-1).cpu()
        for i, row in enumerate(wanted):
            n = seqs[row].params.logprobs
            entry = {tokens[row]: float(lp[i, tokens[row]])}
            if n:
                top = torch.topk(lp[i], n)
                entry.update({int(t): float(v) for t, v in zip(top.indices, top.values)})
            logprobs[row] = entry
    return tokens, logprobs
