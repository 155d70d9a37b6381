"""The acceptance rule of speculative decoding, greedy and sampled (`accept`), its batched greedy
form for requests whose acceptance is a plain argmax comparison (`argmax_accepts`,
`accept_argmax`), and what one verify step yields (`Verified`). The fused MTP step applies the
same greedy rule on the device (hyla.engine.spec.mtp.fused)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.engine.sampler import choose, distribution, penalize, restrict


def accept(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, seq, generator,
           allowed: torch.Tensor | None = None) -> list[int]:
    """The tokens a verify step appends: accepted drafts, then one token from the target.

    logits: [1 + k, V] raw target logits at x0, d1..dk; q: [k, V] draft probabilities (None: the
    drafts were certain, as from prompt lookup); allowed: [1 + k, V] bool, a guided request's
    grammar mask at each position (guide_drafts), applied where the sampler applies it, as are
    allowed_token_ids and bad_words (over the output with the drafts accepted before position i).
    Greedy: accept the longest prefix of drafts equal to the target's argmax, then emit the
    target's own token. Sampling (the standard rule, Leviathan et al. / Chen et al.):
      accept d_i with probability min(1, p(d_i) / q(d_i));
      at the first rejection emit a token drawn from normalise(max(p - q, 0)) and stop;
      if every draft is accepted, emit a bonus token drawn from p at the last position.
    p is the target's sampling distribution given the tokens so far (penalties, temperature,
    top-k / top-p / min-p), so the output is distributed exactly as non-speculative sampling.
    """
    params = seq.params
    history, out_hist = list(seq.token_ids), list(seq.output_token_ids)
    out: list[int] = []
    for i in range(len(drafts) + 1):
        row = restrict(penalize(logits[i].float(), params, history, out_hist), params, out_hist)
        if allowed is not None:  # p is the grammar-masked distribution the plain sampler draws from
            row = row.masked_fill(~allowed[i], float("-inf"))
        if i == len(drafts):
            out.append(choose(row, params, generator))
            return out
        d = drafts[i]
        if params.greedy:
            t = int(row.argmax())
            out.append(t)
            if t != d:
                return out
        else:
            p = distribution(row, params)
            if q is None:
                q_i = torch.zeros_like(p).index_fill_(0, torch.tensor([d], device=p.device), 1.0)
            else:
                q_i = q[i].to(p)
            u = torch.rand((), generator=generator, device=p.device)  # the generators live on the logits' device
            if u * q_i[d] < p[d]:  # u < p/q without dividing by a possibly tiny q
                out.append(d)
            else:
                residual = (p - q_i).clamp_min(0)
                total = residual.sum()
                residual = residual / total if total > 0 else p
                out.append(int(torch.multinomial(residual, 1, generator=generator)))
                return out
        history.append(out[-1])
        out_hist.append(out[-1])
    return out


def argmax_accepts(seq) -> bool:
    """Whether `accept` reduces to comparing drafts with the target's argmax for seq: greedy,
    no grammar (active or pending: a pending one applies from the reasoning's end, which may
    come inside the drafts), and nothing that `penalize` or `restrict` would change (no logit
    bias, no repetition, presence or frequency penalty, no allowed_token_ids or bad_words). The
    fused MTP step and its overlap take only such requests too."""
    p = seq.params
    return (p.greedy and getattr(seq, "guide", None) is None and getattr(seq, "guide_pending", None) is None
            and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and not p.logit_bias
            and p.allowed_token_ids is None and not p.bad_words)


def accept_argmax(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """`accept` for a batch of requests for which `argmax_accepts` holds: logits [sum(1 + k_n),
    V] the verify rows of every request, packed in order; drafts[n] its k_n drafts -> the tokens
    each appends: its drafts up to the first that differs from the target's argmax, then the
    argmax there (after k_n accepted drafts: the bonus token, the argmax at the last row). One
    argmax over all rows and one copy of it to the host, for the whole batch."""
    top = logits.argmax(-1).tolist()
    out, start = [], 0
    for d in drafts:
        row = top[start : start + 1 + len(d)]
        n = next((i for i, (t, x) in enumerate(zip(row, d)) if t != x), len(d))  # drafts accepted
        out.append(row[: n + 1])
        start += 1 + len(d)
    return out


@dataclass
class Verified:
    """One request's verify step: the tokens to append (accepted drafts + one from the target),
    the raw target logits each was chosen from, and how many tokens were drafted."""

    tokens: list[int]
    logits: torch.Tensor
    num_drafted: int

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1
