"""DraftView: what an MTP drafter on ranks 1..N-1 reads of a Sequence under tensor parallelism
(rank 0's drafter reads the Sequence itself; these travel to the workers with the drafter's
calls: hyla.parallel.drafter). The target's steps need no such view: they travel as StepPlans
(hyla.engine.step_plan)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftView:
    """A request's id, preemption count, block table, and its tokens from `start` on (the ones a
    commit pairs with hidden rows; none otherwise) with the sequence's full length."""

    request_id: str
    start: int
    tokens: list[int]  # token_ids[start:]
    num_preemptions: int
    block_table: list[int]

    @classmethod
    def of(cls, seq, start: int | None = None, pages: bool = True) -> DraftView:
        """start: the first token carried (default: none, only the length); pages: with the
        block table (the calls that run the head read it)."""
        n = seq.num_tokens
        start = n if start is None else min(start, n)
        return cls(seq.request_id, start, seq.token_range(start, n), seq.num_preemptions,
                   list(seq.block_table) if pages else [])

    @property
    def num_tokens(self) -> int:
        return self.start + len(self.tokens)

    def token_range(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] for start >= self.start."""
        return self.tokens[start - self.start: stop - self.start]
