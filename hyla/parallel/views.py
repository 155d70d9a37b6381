"""The parts of a Sequence that ranks 1..N-1 see under tensor parallelism: token suffixes indexed
with the sequence's own positions, and DraftView (what an MTP drafter reads). Rank 0 reads the
Sequence itself; these travel to the workers (hyla.parallel.runner, hyla.parallel.drafter)."""

from __future__ import annotations

from dataclasses import dataclass


class Suffix:
    """seq.token_ids from `start` on, indexed with the sequence's own positions."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]):
        self.start, self.tokens = start, tokens

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.tokens[i.start - self.start: i.stop - self.start]
        return self.tokens[i - self.start]


class _Tail(Suffix):
    """seq.token_ids from `start` to its end; len() is the whole sequence's length."""

    __slots__ = ()

    def __len__(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class DraftView:
    """What an MTPDrafter reads of a Sequence on ranks 1..N-1 (rank 0 reads the Sequence): its
    id, preemption count, block table, and its tokens from `start` on (the ones a commit pairs
    with hidden rows; none otherwise) with the sequence's full length."""

    request_id: str
    token_ids: _Tail
    num_preemptions: int
    block_table: list[int]

    @classmethod
    def of(cls, seq, start: int | None = None, pages: bool = True) -> DraftView:
        """start: the first token carried (default: none, only the length); pages: with the
        block table (the calls that run the head read it)."""
        n = seq.num_tokens
        start = n if start is None else min(start, n)
        return cls(seq.request_id, _Tail(start, seq.token_range(start, n)), seq.num_preemptions,
                   list(seq.block_table) if pages else [])

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def token_range(self, start: int, stop: int) -> list[int]:
        return self.token_ids[start:stop]
