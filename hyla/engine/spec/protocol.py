"""What SpecDecoder asks of a drafter (prompt lookup, a draft model, the checkpoint's MTP head):
the hooks every drafter has, each a no-op unless the drafter needs it."""

from __future__ import annotations

import torch

from hyla.engine.spec.acceptance import Verified


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
