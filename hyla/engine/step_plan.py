"""StepPlan, what one forward of the target runs, and StepResult, what it gives back.

A StepPlan holds plain data only (ints and lists, never a Sequence): the engine builds it from
the Scheduler's ScheduledBatch (`plain`), SpecDecoder from the requests it verifies (`verify`);
ModelRunner.execute runs it, and under tensor parallelism the same plan travels to every rank
as it is (hyla.parallel.runner). A plan is built for one step and read during it: its block
tables and slot lists may be the sequences' own lists.

    plain step   rows of new tokens (prefill chunks and decodes): token_ids packed row after
                 row (seq_lens of them per row), each row's context (tokens already in its
                 pages and state), block table and state slot, the offsets within each row
                 whose logits are wanted (logit_rows), the state checkpoints a prefill exports
    verify step  rows [x0, d1..dk] (x0: the request's last token, d: its drafts; k = seq_lens
                 - 1, the draft layout): rollback "slots" (each row's per-position state slots,
                 `accepted` = 1 + the index of the one holding the current state) or "replay"
                 (its one slot, accepted 1); pad_to: W = 1 + k when every row may be padded to W
                 tokens (the fixed shape of a CUDA graph)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepPlan:
    token_ids: list[int]  # the new tokens of every row, packed
    seq_lens: list[int]  # new tokens per row
    context_lens: list[int]  # tokens already computed per row (its position of the first new token)
    block_tables: list[list[int]]
    state_slots: list[int] | list[list[int]]  # plain: a slot per row; verify: per row its W slots ([slot]: "replay")
    logit_rows: list[list[int]] | None = None  # plain: offsets within each row's new tokens; verify: every row
    checkpoints: list[list[tuple[int, int]]] | None = None  # per row (offset p, slot): the state after p tokens
    rollback: str | None = None  # a verify step's rollback ("slots" / "replay"); None: a plain step
    accepted: list[int] | None = None  # verify: 1 + the index in state_slots[n] of the current state
    pad_to: int | None = None  # verify: W when every row may be padded to W tokens

    @classmethod
    def plain(cls, seqs, num_new_tokens: list[int], logit_rows: list[list[int]],
              checkpoints: list[list[tuple[int, int]]] | None = None) -> StepPlan:
        """seqs[n] feeds its next num_new_tokens[n] tokens; logit_rows[n]: the offsets within
        them whose logits are wanted (usually [n_new - 1] when it finishes its prompt or decodes,
        [] mid-prompt); checkpoints[n]: (offset, slot) state exports of its prefill."""
        ids: list[int] = []
        for seq, n in zip(seqs, num_new_tokens):
            ids.extend(seq.token_range(seq.num_computed_tokens, seq.num_computed_tokens + n))
        return cls(ids, list(num_new_tokens), [seq.num_computed_tokens for seq in seqs],
                   [seq.block_table for seq in seqs], [seq.slot for seq in seqs], logit_rows, checkpoints)

    @classmethod
    def verify(cls, seqs, drafts: list[list[int]], rollback: str, pad_to: int | None = None) -> StepPlan:
        """One verify row [x0, d1..dk] per sequence, drafts[n] its drafts. "slots":
        seq.spec_slots are the per-position slots and seq.slot (one of them) holds the current
        state; "replay": seq.slot only."""
        if rollback == "slots":
            slots = [seq.spec_slots for seq in seqs]
            accepted = [seq.spec_slots.index(seq.slot) + 1 for seq in seqs]
        else:
            slots, accepted = [[seq.slot] for seq in seqs], [1] * len(seqs)
        return cls([t for seq, d in zip(seqs, drafts) for t in [seq.last_token_id, *d]],
                   [1 + len(d) for d in drafts], [seq.num_computed_tokens for seq in seqs],
                   [seq.block_table for seq in seqs], slots, rollback=rollback, accepted=accepted, pad_to=pad_to)

    @property
    def is_verify(self) -> bool:
        return self.rollback is not None

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    def padded_rows(self) -> list[list[int]]:
        """A verify plan's rows, each padded with token 0 to pad_to tokens."""
        rows, at = [], 0
        for n in self.seq_lens:
            rows.append(self.token_ids[at:at + n] + [0] * (self.pad_to - n))
            at += n
        return rows


@dataclass
class StepResult:
    """What ModelRunner.execute gives back.

    logits: fp32; a plain step's wanted rows [sum(len(logit_rows)), V] in order; a verify's
        every row [sum(seq_lens), V]; with a graph extension the graph's own [bs, W, V] buffer.
    hidden: the final-norm hidden states of the same tokens (with return_hidden; a plain step's
        of every new token [T_total, hidden]; with an extension the graph's [bs, W, hidden]).
    extension: what the graph extension computed (views of its graph's buffers), None without.
    in_graph: the step ran through the runner's CUDA graphs (replayed, or their padded inputs
        run eagerly when capture is off); a "replay" verify's commit_replay takes it.
    argmax: a decode graph's step: each logits row's argmax [R] int64, -1 where the row's largest
        logit is not finite (computed in the graph: the draws of a batch drawn by argmax alone,
        hyla.engine.spec.acceptance.argmax_draws); None otherwise."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    extension: tuple | None = None
    in_graph: bool = False
    argmax: torch.Tensor | None = None
