"""Prompt lookup (n-gram) drafting: no model, the drafts are copied from earlier in the sequence."""

from __future__ import annotations

from hyla.engine.config import SpecConfig
from hyla.engine.spec.protocol import Proposer


class NgramDrafter(Proposer):
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
