"""TPDrafter: the MTP drafter under tensor parallelism, as SpecDecoder sees it on rank 0.

Every rank holds an MTPDrafter (hyla.engine.spec.mtp.drafter) over its own ModelRunner: its shard of the head
(split like the target's attention layers by the rank's ShardPlan), its head KV in its own
pages, and the same per-request views. The engine drives the drafter on rank 0; TPDrafter runs
each call on rank 0's MTPDrafter (with the real Sequences) and has ranks 1..N-1 run it too:

- `propose` and a prefill's `commit` (its catch-up) run the head (all-reduces, the
  vocab-parallel embedding and lm_head): one command each, executed on every rank at once
  (TPRunner.drafter_call); in `propose` rank 0 draws the drafts and broadcasts each step's tokens
  (MTPDrafter._agree);
- `observe`, `commit` and `release` only update the views: deferred, they travel with the next
  command (TPRunner.defer), so they cost no broadcast. `observe` reads the hidden states the
  rank's last forward kept (hyla.parallel.worker.Worker: every rank's own copy, the same
  values; none is sent).

Ranks 1..N-1 see DraftViews (hyla.parallel.views), never Sequences: the id, preemption count,
block table and the few tokens a commit pairs with its hidden rows.
"""

from __future__ import annotations

import logging

import torch

from hyla.engine.spec.mtp.drafter import MTPDrafter
from hyla.engine.spec.protocol import Proposer
from hyla.parallel.views import DraftView

log = logging.getLogger("hyla.parallel")


class TPDrafter(Proposer):
    needs_hidden = True
    kv_bytes_per_token = staticmethod(MTPDrafter.kv_bytes_per_token)  # rank 0's shard: the bytes per rank

    def __init__(self, cfg, page_size: int):
        self.cfg, self.page_size = cfg, page_size
        self.runner = None  # the TPRunner (bind)
        self.local: MTPDrafter | None = None  # rank 0's drafter
        self._first: dict[str, int] = {}  # request -> position of the first row observed, until commit

    @property
    def views(self):
        """Rank 0's per-request head views (the other ranks hold the same)."""
        return self.local.views

    @property
    def _seen(self):
        return self.local._seen

    def bind(self, runner) -> None:
        """Every rank loads its shard of the head and allocates its KV (a startup command: a
        rank's failure is raised here)."""
        self.runner = runner
        runner.group.call("mtp_bind", self.cfg, self.page_size, reply=True)
        self.local = runner.group.worker.drafter
        weights, kv = max(runner.group.replies)
        log.info("MTP head per rank: weights %.2f MiB, KV / token %d B (in the engine's pages)", weights / 2**20, kv)

    def observe(self, seqs, positions: list[int], counts: list[int], hidden: torch.Tensor) -> None:
        self.local.observe(seqs, positions, counts, hidden)
        for seq, p in zip(seqs, positions):
            self._first[seq.request_id] = p
        self.runner.defer("observe", ([DraftView.of(s, pages=False) for s in seqs], list(positions), list(counts)))

    def commit(self, seqs, kept: list[int], prefill: bool = False) -> None:
        """Ranks 1..N-1 get the tokens after each request's observed rows (what they pair with);
        after a prefill every rank runs the head's catch-up at once (MTPDrafter.catch_up)."""
        self.local.commit(seqs, kept)
        views = [DraftView.of(s, self._first.pop(s.request_id, s.num_tokens) + 1, pages=False) for s in seqs]
        self.runner.defer("commit", (views, list(kept)))
        if prefill:
            views = [DraftView.of(s) for s in seqs]
            self.runner.drafter_call("catch_up", (views,), local=lambda: self.local.catch_up(seqs))

    def propose(self, seqs, ks: list[int], generator: torch.Generator | None = None
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        views = [DraftView.of(s) for s in seqs]
        return self.runner.drafter_call("propose", (views, list(ks)),
                                        local=lambda: self.local.propose(seqs, ks, generator))

    def release(self, seq) -> None:
        self.local.release(seq)
        self._first.pop(seq.request_id, None)
        self.runner.defer("release", (DraftView.of(seq, pages=False),))
