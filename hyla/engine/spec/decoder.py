"""SpecDecoder, which runs speculative decode steps, and make_drafter, which builds the drafter a
SpecConfig names (the config is parsed and validated with EngineConfig in hyla.engine.config).

Each decode step of a request feeds [x0, d1..dk] (x0 = its last token, d = drafts) through the
target in one verify forward. Rejected drafts never reach a state anything starts from: with
rollback "slots" the state after every position has its own slot and the accepted one is picked
by index; with "replay" the state is only advanced by the accepted tokens (see the KDA layer).
"""

from __future__ import annotations

from itertools import pairwise

import torch

from hyla.engine.config import SpecConfig
from hyla.engine.sampler import (
    guide_drafts,
    pending_guide_drafts,
    unpack_bitmask,
)
from hyla.engine.spec.acceptance import Verified, accept, accept_argmax, argmax_accepts
from hyla.engine.spec.ngram import NgramDrafter
from hyla.engine.spec.protocol import Proposer
from hyla.engine.step_plan import StepPlan


def make_drafter(cfg: SpecConfig, *, vocab_size: int, max_num_seqs: int, max_model_len: int, page_size: int,
                 state_dtype, dtype, device, enforce_eager: bool = False):
    """The drafter `cfg` asks for: prompt lookup, a draft model with its own pools, or the
    target's MTP head (bound to the target's runner by SpecDecoder; its KV in the engine's pages)."""
    if cfg.method == "ngram":
        return NgramDrafter(cfg)
    if cfg.method == "mtp":
        from hyla.engine.spec.mtp.drafter import MTPDrafter

        return MTPDrafter(cfg, page_size=page_size)
    from hyla.engine.spec.draft_model import DraftModelDrafter

    return DraftModelDrafter(cfg, vocab_size=vocab_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             page_size=page_size, state_dtype=state_dtype, dtype=dtype, device=device,
                             enforce_eager=enforce_eager)


class SpecDecoder:
    """The decode steps of speculating requests: propose -> one verify forward (the decoder runs
    the target: plain, or with the proposer's graph extension) -> accept, then (commit, once the
    engine knows how many tokens it kept) advance the state: pick the accepted slot, or replay.
    It allocates nothing (the Scheduler reserved the draft positions' pages) and touches no
    engine state: the engine appends the tokens, finishes requests, rolls back pages and
    recovers from a failed step."""

    def __init__(self, cfg: SpecConfig, drafter: Proposer, runner):
        """drafter: the proposer, bound here to the target's runner (under tensor parallelism the
        engine passes the runner's stand-in for it: hyla.parallel.runner.TPRunner.shard_drafter)."""
        self.cfg = cfg
        self.drafter = drafter
        self.runner = runner
        drafter.bind(runner)

    def step(self, seqs, max_drafts: list[int], generator: torch.Generator, chain=None) -> list[Verified]:
        """Draft up to max_drafts[i] tokens for seqs[i], verify them all in one forward and
        accept. generator: where unseeded requests draw (seeded ones use their own); chain: the
        engine's overlap chain (hyla.engine.spec.mtp.overlap) or None. Raises what the verify
        forward raises (the engine isolates the failing request)."""
        proposals = self.drafter.propose(seqs, max_drafts, generator)
        drafts = [d for d, _ in proposals]
        masks: list[torch.Tensor | None] = [None] * len(seqs)
        for j, (seq, (d, q)) in enumerate(zip(seqs, proposals)):
            if seq.guide is not None:  # drafts past the grammar's first rejection are never verified
                drafts[j], masks[j] = guide_drafts(seq.guide, d, q is not None, self.runner.model.config.vocab_size)
            elif seq.guide_pending is not None:  # the grammar applies after the reasoning
                drafts[j], masks[j] = pending_guide_drafts(seq, d, q is not None, self.runner.model.config.vocab_size)
        # Every row may be padded to 1 + k tokens (a fixed shape: a CUDA graph), also when a
        # request near its token limits drafts fewer: padding positions are never accepted, and
        # where their KV has no page it lands in the runner's scratch page.
        pad_to = 1 + self.cfg.num_speculative_tokens
        if self.drafter.graph_extension is not None:
            verified = self._verify_extended(seqs, drafts, pad_to, chain)
            if verified is not None:
                return verified
        # every request argmax-accepting: the acceptance is one argmax on the device (accept_argmax)
        on_device = all(argmax_accepts(seq) for seq in seqs)
        needs_hidden = self.drafter.needs_hidden  # the rows' hidden states feed the drafter's next proposal
        result = self.runner.execute(StepPlan.verify(seqs, drafts, self.cfg.rollback, pad_to),
                                     return_hidden=needs_hidden, device_logits=on_device)
        if needs_hidden:
            self.drafter.observe(seqs, [seq.num_computed_tokens for seq in seqs], [1 + len(d) for d in drafts],
                                 result.hidden)
        return self._accept(seqs, drafts, [q for _, q in proposals], masks, result.logits.float(), generator,
                            result.in_graph)

    def _verify_extended(self, seqs, drafts: list[list[int]], pad_to: int, chain=None) -> list[Verified] | None:
        """The verify with the proposer's graph extension (one graph: the target's forward, the
        acceptance on the device, the proposer's next proposal; one readback) -> the Verified
        results, or None (nothing ran) when it does not apply. With an overlap chain the step
        after this one may be launched before this one's readback is read (it is then in flight
        when this returns)."""
        ext = self.drafter.graph_extension
        part = ext.extend(seqs, drafts, pad_to)
        if part is None:
            return None
        result = self.runner.execute(StepPlan.verify(seqs, drafts, self.cfg.rollback, pad_to), extension=part)
        if result is None:
            return None
        flight = ext.launched(seqs, drafts, (result.logits, result.hidden, *result.extension), pad_to)
        try:
            if chain is not None:
                chain.launch_after(flight)
            return ext.collect(flight)
        except BaseException:
            if chain is not None:
                chain.abandon()
            raise

    @staticmethod
    def _accept(seqs, drafts: list[list[int]], qs: list, masks: list, logits: torch.Tensor, generator,
                in_graph: bool = False) -> list[Verified]:
        """The acceptance rule per request over logits [sum(1 + len(drafts[n])), V] (the verify
        rows, packed): the requests for which `argmax_accepts` holds together, in one copy to the
        host (accept_argmax), the rest one by one (accept). in_graph: the verify's (Verified)."""
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
        return [Verified(t, r, len(d), in_graph) for t, r, d in zip(tokens, rows, drafts)]

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
        a finished prompt with the token just sampled), and the drafter may work on them now."""
        self.drafter.commit(seqs, list(num_new_tokens), prefill=True)

    def commit(self, seqs, kept: list[int], in_graph: bool, state_committed: bool = False,
               row_kept: list[int] | None = None) -> None:
        """The engine kept kept[i] tokens of seqs[i]'s verify step (fewer than accepted when the
        request finished early): make the state after exactly those tokens the current one.
        in_graph: the verify ran in a CUDA graph (Verified.in_graph): a "replay" commit replays
        the commit graph captured with it. state_committed: "replay" rollback whose commit
        already ran on the device with these counts (hyla.engine.spec.mtp.overlap, before the
        step launched behind this one). row_kept: the counts per row of the verify as it ran,
        when it also ran padding rows for requests that finished before it (a step in flight:
        1 for those, whose slot was the scratch slot); default kept."""
        self.drafter.commit(seqs, kept)
        if self.cfg.rollback == "replay":
            if not state_committed:
                self.runner.commit_replay(kept if row_kept is None else row_kept, in_graph)
        else:
            for seq, n in zip(seqs, kept):
                seq.slot = seq.spec_slots[n - 1]

    def release(self, seq) -> None:
        self.drafter.release(seq)
