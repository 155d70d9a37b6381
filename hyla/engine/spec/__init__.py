"""Speculative decoding.

    protocol.py    Proposer (propose / observe / commit / release) and its optional
                   GraphExtension: what SpecDecoder asks of any proposer
    ngram.py       prompt lookup
    draft_model.py a smaller checkpoint with its own pools
    mtp/           the checkpoint's multi-token-prediction head (drafter.py, loaded through the
                   model's family), its graph extension: the fused greedy verify-and-draft step
                   in CUDA graphs (fused.py), and the overlapped chain of those steps (overlap.py)
    acceptance.py  the acceptance rule (greedy and sampled) and the stop rule, each in its host
                   form and its device form; Verified
    decoder.py     SpecDecoder (propose -> one verify forward, plain or extended -> accept ->
                   commit) and make_drafter

Each decode step of a request feeds [x0, d1..dk] (x0 = its last token, d = drafts) through the
target in one verify forward. Rejected drafts never reach a state anything starts from: with
rollback "slots" the state after every position has its own slot and the accepted one is picked
by index; with "replay" the state is only advanced by the accepted tokens.
"""

from hyla.engine.spec.decoder import SpecDecoder, make_drafter
from hyla.engine.spec.protocol import GraphExtension, Proposer

__all__ = ["SpecDecoder", "make_drafter", "Proposer", "GraphExtension"]
