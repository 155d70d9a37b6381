"""Speculative decoding: the drafters (prompt lookup here, a draft model in draft_model.py, the
checkpoint's MTP head in mtp.py), the acceptance rule and the SpecDecoder that runs them (the
config, SpecConfig, is parsed and validated with EngineConfig in config.py).

Each decode step of a request feeds [x0, d1..dk] (x0 = its last token, d = drafts) through the
target in one verify forward. Rejected drafts never reach a state anything starts from: with
rollback "slots" the state after every position has its own slot and the accepted one is picked
by index; with "replay" the state is only advanced by the accepted tokens (see the KDA layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from hyla.engine.config import SpecConfig
from hyla.engine.sampler import (
    choose,
    distribution,
    guide_drafts,
    penalize,
    pending_guide_drafts,
    restrict,
    unpack_bitmask,
)


class Drafter:
    """What SpecDecoder asks of a drafter: `propose` (required) and `release`; the other hooks
    serve a drafter that reads the target (MTP): `bind` (the target's runner, once), `observe`
    (the final-norm hidden states of the rows of each target forward, asked for with
    needs_hidden: verify steps and prefill chunks alike) and `commit` (how many of those rows
    each request kept)."""

    needs_hidden = False

    @staticmethod
    def kv_bytes_per_token(model) -> int:
        """Bytes per token the drafter keeps in the engine's KV pages beside the target's layers
        (sized into the engine's memory budget); 0: it keeps nothing there."""
        return 0

    def bind_weight_bytes(self, model) -> int:
        """Bytes of weights `bind` will put on the device beside `model` (an upper bound), kept
        out of the automatic memory budget, which is measured before bind runs; 0: none."""
        return 0

    def bind(self, runner) -> None:
        pass

    def propose(self, seqs, ks: list[int], generator=None) -> list[tuple[list[int], torch.Tensor | None]]:
        raise NotImplementedError

    def observe(self, seqs, positions: list[int], counts: list[int], hidden: torch.Tensor) -> None:
        """hidden: [sum(counts), hidden] the target's final-norm states of seqs[i]'s rows at
        positions[i] .. positions[i] + counts[i] - 1, packed in that order."""

    def commit(self, seqs, kept: list[int]) -> None:
        pass

    def catch_up(self, seqs) -> None:
        """After a prefill step (its rows committed): work the drafter may do on them now."""

    def release(self, seq) -> None:
        pass

    def verify(self, seqs, drafts: list[list[int]], runner, rollback: str, pad_to: int) -> list[Verified] | None:
        """A drafter that folds its next proposal into the verify (MTP's fused greedy step) runs
        the verify and the acceptance here -> the Verified results; None: SpecDecoder runs them."""
        return None


class NgramDrafter(Drafter):
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it."""

    def __init__(self, cfg: SpecConfig):
        self.lo, self.hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max

    def propose(self, seqs, ks: list[int], generator=None) -> list[tuple[list[int], None]]:
        """-> per sequence (drafts, None): the drafts are certain (q is a point mass); nothing is
        drawn, so `generator` goes unused."""
        return [(self._one(seq.token_ids, k) if k else [], None) for seq, k in zip(seqs, ks)]

    def _one(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.hi, len(tokens) - 1), self.lo - 1, -1):
            suffix = tokens[-n:]
            first = suffix[0]
            for start in range(len(tokens) - n - 1, -1, -1):
                # compare the first token before slicing: most positions fail there
                if tokens[start] == first and tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []


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


def make_drafter(cfg: SpecConfig, *, vocab_size: int, max_num_seqs: int, max_model_len: int, page_size: int,
                 state_dtype, dtype, device, enforce_eager: bool = False):
    """The drafter `cfg` asks for: prompt lookup, a draft model with its own pools, or the
    target's MTP head (bound to the target's runner by SpecDecoder; its KV in the engine's pages)."""
    if cfg.method == "ngram":
        return NgramDrafter(cfg)
    if cfg.method == "mtp":
        from hyla.engine.mtp import MTPDrafter

        return MTPDrafter(cfg, page_size=page_size)
    from hyla.engine.draft_model import DraftModelDrafter

    return DraftModelDrafter(cfg, vocab_size=vocab_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             page_size=page_size, state_dtype=state_dtype, dtype=dtype, device=device,
                             enforce_eager=enforce_eager)


class SpecDecoder:
    """The decode steps of speculating requests: draft -> one verify forward -> accept, then
    (commit, once the engine knows how many tokens it kept) advance the state: pick the accepted
    slot, or replay. It allocates nothing (the Scheduler reserved the draft positions' pages) and
    touches no engine state: the engine appends the tokens, finishes requests, rolls back pages
    and recovers from a failed step."""

    def __init__(self, cfg: SpecConfig, drafter: Drafter, runner):
        self.cfg = cfg
        # A tensor-parallel runner (hyla.parallel.runner.TPRunner) may stand a drafter in for it
        # that runs on every rank (MTP: the head is sharded as the target is).
        shard = getattr(runner, "shard_drafter", None)
        self.drafter = drafter = shard(drafter) if shard is not None else drafter
        self.runner = runner
        drafter.bind(runner)

    def step(self, seqs, max_drafts: list[int], generator: torch.Generator) -> list[Verified]:
        """Draft up to max_drafts[i] tokens for seqs[i], verify them all in one forward and
        accept. generator: where unseeded requests draw (seeded ones use their own). Raises what
        the verify forward raises (the engine isolates the failing request)."""
        proposals = self.drafter.propose(seqs, max_drafts, generator)
        drafts = [d for d, _ in proposals]
        masks: list[torch.Tensor | None] = [None] * len(seqs)
        for j, (seq, (d, q)) in enumerate(zip(seqs, proposals)):
            if seq.guide is not None:  # drafts past the grammar's first rejection are never verified
                drafts[j], masks[j] = guide_drafts(seq.guide, d, q is not None, self.runner.model.config.vocab_size)
            elif getattr(seq, "guide_pending", None) is not None:  # the grammar applies after the reasoning
                drafts[j], masks[j] = pending_guide_drafts(seq, d, q is not None, self.runner.model.config.vocab_size)
        # Every row may be padded to 1 + k tokens (a fixed shape: a CUDA graph), also when a
        # request near its token limits drafts fewer: padding positions are never accepted, and
        # where their KV has no page it lands in the runner's scratch page.
        pad_to = 1 + self.cfg.num_speculative_tokens
        fused = self.drafter.verify(seqs, drafts, self.runner, self.cfg.rollback, pad_to)
        if fused is not None:
            return fused
        # every request argmax-accepting: the acceptance is one argmax on the device (accept_argmax)
        on_device = all(argmax_accepts(seq) for seq in seqs)
        if self.drafter.needs_hidden:  # the rows' hidden states feed the drafter's next proposal
            logits, hidden = self.runner.verify(seqs, drafts, self.cfg.rollback, pad_to=pad_to, return_hidden=True,
                                                device_logits=on_device)
            logits = logits.float()
            self.drafter.observe(seqs, [seq.num_computed_tokens for seq in seqs], [1 + len(d) for d in drafts],
                                 hidden)
        else:
            logits = self.runner.verify(seqs, drafts, self.cfg.rollback, pad_to=pad_to,
                                        device_logits=on_device).float()
        return self._accept(seqs, drafts, [q for _, q in proposals], masks, logits, generator)

    @staticmethod
    def _accept(seqs, drafts: list[list[int]], qs: list, masks: list, logits: torch.Tensor, generator
                ) -> list[Verified]:
        """The acceptance rule per request over logits [sum(1 + len(drafts[n])), V] (the verify
        rows, packed): the requests for which `argmax_accepts` holds together, in one copy to the
        host (accept_argmax), the rest one by one (accept)."""
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + 1 + len(d))
        rows = [logits[a:b] for a, b in pairwise(starts)]
        tokens: list[list[int] | None] = [None] * len(seqs)
        plain = [n for n, seq in enumerate(seqs) if argmax_accepts(seq)]
        if plain:
            flat = logits if len(plain) == len(seqs) else torch.cat([rows[n] for n in plain])
            for n, t in zip(plain, accept_argmax(flat, [drafts[n] for n in plain])):
                tokens[n] = t
        for n, seq in enumerate(seqs):
            if tokens[n] is None:
                gen = seq.generator if seq.generator is not None else generator
                words = masks[n]
                allowed = None if words is None else unpack_bitmask(words, rows[n].shape[-1], rows[n].device)
                tokens[n] = accept(rows[n], drafts[n], qs[n], seq, gen, allowed)
        return [Verified(t, r, len(d)) for t, r, d in zip(tokens, rows, drafts)]

    @property
    def wants_prefill_hidden(self) -> bool:
        """The drafter reads the prompt's hidden states (MTP): prefill chunks hand them over."""
        return self.drafter.needs_hidden

    def observe_prefill(self, seqs, num_new_tokens: list[int], hidden: torch.Tensor) -> None:
        """hidden: [sum(num_new_tokens), hidden] the final-norm states of a plain step's new tokens
        (before num_computed_tokens advances past them)."""
        self.drafter.observe(seqs, [seq.num_computed_tokens for seq in seqs], list(num_new_tokens), hidden)

    def commit_prefill(self, seqs, num_new_tokens: list[int]) -> None:
        """After the plain step sampled: its rows pair with the tokens after them (the last row of
        a finished prompt with the token just sampled), and the drafter catches up on them."""
        self.drafter.commit(seqs, list(num_new_tokens))
        self.drafter.catch_up(seqs)

    def commit(self, seqs, kept: list[int], state_committed: bool = False) -> None:
        """The engine kept kept[i] tokens of seqs[i]'s verify step (fewer than accepted when the
        request finished early): make the state after exactly those tokens the current one.
        state_committed: "replay" rollback whose commit already ran on the device with these
        counts (hyla.engine.mtp_overlap, before the step launched behind this one)."""
        self.drafter.commit(seqs, kept)
        if self.cfg.rollback == "replay":
            if not state_committed:
                self.runner.commit_replay(kept)
        else:
            for seq, n in zip(seqs, kept):
                seq.slot = seq.spec_slots[n - 1]

    def release(self, seq) -> None:
        self.drafter.release(seq)
