"""Overlapped MTP steps: the next fused greedy step launched before this one's readback is read.

A fused step (hyla.engine.spec.mtp.fused) of a small model is a graph of ~0.6 ms on an H200, and the
host work around it (emitting and detokenising tokens, stop checks, commits, outputs, the
caller's loop, the next schedule) was another ~0.35 ms during which the GPU sat idle. The
inputs of the next step are on the device as soon as the step has run: per request the tokens
kept (the accepted drafts and the bonus token), hence the next context, the accepted slot, the
next verify row [bonus, d'] and the head's next drafts d'. So, when the batch will certainly
step again unchanged, the next step is launched right behind the current one
(fused.DerivedExtension derives its inputs on the device), and the host reads and handles
the current step's results while the GPU runs the next: the engine step's host time leaves the
critical path. The engine collects the step in flight at its next `step`. (Plain decode
steps overlap the same way: hyla.engine.overlap.)

When it launches (`launch_after`), checked on the host against the state before the current
step: the Scheduler says the next step is certain to be the same requests and reserves pages
for its worst case, verify rows starting up to W positions later (`Scheduler.reserve_ahead`);
each request is greedy without grammar, logprobs, penalties or stop strings, past min_tokens,
with at most MAX_STOPS stop ids (EOS unless ignore_eos, plus stop_token_ids) and at least two
more full steps of room before max_tokens and max_model_len (so neither the current nor the
next step can end it by length); the graphs of the next step's bucket already captured. A
request that emits a stop token in the current step is a padding row of the next (its state, KV and head rows untouched), decided on the device by the
stop rule's device form (hyla.engine.spec.acceptance: kept_through_stop, for the requests
device_stop_ids admits); the engine then finishes it as usual and the chain ends (the
running set changed). With rollback "replay" the current step's commit (advancing each state by
its kept tokens: up to the first stop token, as the host keeps them) is replayed on the device
before the next step's verify, from the same device-side counts, and the host does not commit
that step again (`take_state_committed`). Pages are not trimmed while a step is in flight (its block tables were
fixed at launch); the chain's last step trims as usual. Anything that changes the batch from
outside (an abort) collects the step in flight first (`LLMEngine.drain`).

Exactness: a chained step runs the same graph on the same inputs as the unchained step after
it would (what the host would have filled, derived on the device instead), so greedy output is
token for token the same; the CPU tests run the same path eagerly.
"""

from __future__ import annotations

import torch

from hyla.engine.spec.mtp.fused import DerivedExtension, Flight
from hyla.engine.overlap import MAX_STOPS
from hyla.engine.spec.acceptance import argmax_accepts, device_stop_ids


class OverlapChain:
    """The engine's one step in flight (`flight`) and the rule for launching the next."""

    def __init__(self, engine, drafter, rollback: str):
        self.engine, self.drafter, self.rollback = engine, drafter, rollback
        self.flight: Flight | None = None
        self.state_committed = False  # see take_state_committed
        self.launched = 0  # steps launched in flight (the tests assert the path was taken)

    def stops(self, seq) -> list[int] | None:
        """seq's stop ids for the device check, None when the chain cannot take seq: the stop
        rule's device form must decide its next two steps' tokens as the host would
        (acceptance.device_stop_ids), its acceptance be the argmax comparison, and neither step
        reach max_model_len."""
        W = self.drafter.k + 1
        if (not argmax_accepts(seq) or seq.params.logprobs is not None
                or seq.num_tokens + 2 * W + 1 >= self.engine.max_model_len):
            return None
        ids = device_stop_ids(seq, 2 * W)
        return ids if ids is not None and len(ids) <= MAX_STOPS else None

    @torch.inference_mode()
    def launch_after(self, flight: Flight) -> None:
        """Launch the step after `flight` (still unread) when it is certain to run unchanged;
        it becomes self.flight. The host state is the one before `flight`."""
        eng, drafter = self.engine, self.drafter
        sched = eng.scheduler
        seqs = flight.seqs
        if self.flight is not None:
            return
        W = flight.W
        stops, views = [], []
        for seq in seqs:
            ids = self.stops(seq)
            view = drafter.views.get(seq.request_id)
            if ids is None or view is None or view.pending or not view.at(seq, seq.num_computed_tokens):
                return
            stops.append(ids + [-1] * (MAX_STOPS - len(ids)))
            views.append(view)
        # the same requests next (the Scheduler's word), their verify rows ending at most 2W
        # positions past these: pages reserved, evicted pages' copies run before the launch
        transfers = sched.reserve_ahead(seqs, 2 * W)
        if transfers is None:
            return
        eng.runner.apply_transfers(transfers)
        graphs, rollback = eng.runner.graphs, self.rollback
        # widths for the worst case: the next step's rows start up to W later than these
        slots = [s.spec_slots for s in seqs] if rollback == "slots" else [[s.slot] for s in seqs]
        key, rows = graphs.verify_rows([[0] * W for _ in seqs], [s.num_computed_tokens + W for s in seqs],
                                       slots, [1] * len(seqs), [s.block_table for s in seqs], rollback)
        ext = drafter.fused.extension([v.done + W for v in views], [[] for _ in seqs],
                                      [drafter._pages(s, v) for s, v in zip(seqs, views)])
        if key + (ext.tag,) not in graphs.verify_graphs:
            return  # not captured yet: the next step goes the normal way (and captures it)
        base = [[s.num_computed_tokens + 1, v.done + 1] + st for s, v, st in zip(seqs, views, stops)]
        # rollback "replay": the current step's commit runs first, from the kept counts the device knows
        derived = DerivedExtension(drafter.fused, ext.bs, ext.width, ext.rows, graphs, flight.packed, base,
                                   rollback == "replay")
        out = graphs.replay_verify(key, rows, derived)
        self.flight = drafter.fused.launched(seqs, None, out, W)
        self.state_committed = rollback == "replay"
        self.launched += 1

    def take_state_committed(self) -> bool:
        """Whether the step being handed out had its replay commit run on the device already
        (launch_after did it before the next step's verify): the host must not commit it again."""
        done, self.state_committed = self.state_committed, False
        return done

    def advance(self, launch: bool = True) -> list:
        """Take the step in flight: launch the one after it when that applies (launch), then wait
        for its readback -> its Verified results (for flight.seqs, read before calling)."""
        flight, self.flight = self.flight, None
        try:
            if launch:
                self.launch_after(flight)
            return self.drafter.fused.collect(flight)
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """A step failed: let whatever is in flight finish on the device, then forget it (the
        engine recovers its requests from the host state, which it never reached)."""
        if self.flight is not None and self.flight.ready is not None:
            torch.cuda.synchronize(self.flight.packed.device)
        self.flight = None
