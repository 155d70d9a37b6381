"""What SpecDecoder asks of a proposer (prompt lookup, a draft model, the checkpoint's MTP head).

    Proposer        at startup: kv_bytes_per_token, bind_weight_bytes, bind (the engine's memory
                    budget, then the target's runner, once); each step: propose, observe, commit,
                    release
    GraphExtension  optional (Proposer.graph_extension): work a proposer adds to the target's
                    verify graph, so that one replay and one readback serve the verify, the
                    acceptance and its next proposal (MTP's fused greedy step)

The decoder owns the target: it runs every verify forward (plain, or with the proposer's graph
extension) and the acceptance (hyla.engine.spec.acceptance); no proposer runs the target. What a
proposer does beyond proposing is declared here (needs_hidden, graph_extension), never probed.
"""

from __future__ import annotations

import torch

from hyla.engine.spec.acceptance import Verified


class GraphExtension:
    """A proposer's part of the verify graph: after the target's forward, in the same CUDA graph,
    the greedy acceptance rule's device form and the proposer's next proposal, read back in one
    copy (hyla.engine.spec.mtp.fused.FusedVerify). The decoder asks for the extension of a verify
    (`extend`), runs the verify with it (ModelRunner.execute(plan, extension=...)), then hands
    the launched step over (`launched`) and reads it (`collect`)."""

    def extend(self, seqs, drafts: list[list[int]], pad_to: int):
        """This verify's extension for seqs, drafts[i] checked for seqs[i] in rows of pad_to
        (CUDAGraphRunner.replay_verify's protocol: tag, pad, fill, forward); None when it does
        not apply, and the decoder runs the plain verify."""
        raise NotImplementedError

    def launched(self, seqs, drafts: list[list[int]] | None, outputs: tuple, pad_to: int):
        """The verify with this extension was launched (outputs: the graph's logits, hidden states
        and the extension's packed results) -> the step in flight, its readback on the way."""
        raise NotImplementedError

    def collect(self, flight) -> list[Verified | None]:
        """Wait for a launched step's readback -> each request's Verified (None: it finished in the
        step before, its row was padding); the proposer keeps its part until commit."""
        raise NotImplementedError


class Proposer:
    """What SpecDecoder asks of a proposer: `propose` (required) and `release` (a finished
    request); a proposer that reads the target (MTP) also gets `observe` (the final-norm hidden
    states of each target forward's rows, when needs_hidden: verify steps and prefill chunks
    alike) and `commit` (how many of those rows each request kept)."""

    needs_hidden: bool = False  # observe gets the target's final-norm hidden states
    graph_extension: GraphExtension | None = None  # the optional graph extension (set up by bind)

    # -- at startup ---------------------------------------------------------------------------

    @staticmethod
    def kv_bytes_per_token(model) -> int:
        """Bytes per token the proposer keeps in the engine's KV pages beside the target's layers
        (sized into the engine's memory budget); 0: it keeps nothing there."""
        return 0

    def bind_weight_bytes(self, model) -> int:
        """Bytes of weights `bind` will put on the device beside `model` (an upper bound), kept
        out of the automatic memory budget, which is measured before bind runs; 0: none."""
        return 0

    def bind(self, runner) -> None:
        """The target's runner, once, before the first step (MTP loads its head beside it)."""

    # -- each step -----------------------------------------------------------------------------

    def propose(self, seqs, ks: list[int], generator=None) -> list[tuple[list[int], torch.Tensor | None]]:
        """-> per sequence (up to ks[i] drafts, their draft probabilities q [len, V] or None when
        the drafts are certain or greedy)."""
        raise NotImplementedError

    def observe(self, seqs, positions: list[int], counts: list[int], hidden: torch.Tensor) -> None:
        """hidden: [sum(counts), hidden] the target's final-norm states of seqs[i]'s rows at
        positions[i] .. positions[i] + counts[i] - 1, packed in that order."""

    def commit(self, seqs, kept: list[int], prefill: bool = False) -> None:
        """seqs[i] kept the first kept[i] rows the target ran for it (a verify: the tokens the
        engine kept; prefill: a plain step's chunk, all of it, after it sampled: the proposer may
        work on the committed rows now, so that a long prompt's work is spread over its chunks)."""

    def release(self, seq) -> None:
        """seq finished or failed: drop what the proposer holds for it."""
