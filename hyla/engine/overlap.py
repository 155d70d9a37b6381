"""Overlapped decode steps (vLLM's async scheduling): the next decode step's forward is queued
on the GPU before the host reads the current step's draws.

A decode step's host work (reading the draws, emitting and detokenising tokens, stop checks,
outputs, the caller's loop, the next schedule) runs while the GPU is idle unless the next
forward is already queued. Its inputs are known without the host: the same requests, each one
position further, fed the token just drawn, which is on the device. So after a pure-decode step
has drawn its tokens (hyla.engine.sampler.PendingSample: a device tensor, its copy to the host
under way) and before the host waits for them, `DecodeOverlap.launch` queues the next step's
forward with those tokens as its input ids (ModelRunner.execute(plan, fed=...)). The engine's
next `step` lands it (`LLMEngine._land_decode`): draws its tokens from its logits with the host
state that is then up to date (penalties, grammar masks, logprobs see every earlier token),
launches the step after it in turn, then reads and emits.

When it launches, checked on the host: the runner replays decode graphs and this batch's graph
is captured (or the graphs run eagerly: the CPU tests); the Scheduler says the next step is
certain to be the same requests and reserves their next page (`Scheduler.reserve_ahead`); and
every request's current draw can end it only through a stop id, which the device checks
(hyla.engine.spec.acceptance.device_stop_ids: not before min_tokens, not on its last token by
max_tokens, no stop strings, no grammar), with room before max_model_len. A request whose draw
is a stop id (or failed) is a padding row of the step in flight: its slot and pages are not
written, so the prefix cache files the state it finished with. Anything that changes the batch
from outside (an abort) lands the step in flight first (`LLMEngine.drain`).

Exactness: the step in flight runs the same graph on the same inputs as the step the host would
have scheduled next (the token ids copied on the device instead of from the host), so output is
token for token the same, sampled too (the same draws from the same generators, in order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.engine.sampler import PendingSample
from hyla.engine.spec.acceptance import device_stop_ids
from hyla.engine.step_plan import StepPlan
from hyla.ops.transfer import to_device_long

MAX_STOPS = 4  # stop ids per request the device check takes (EOS + stop_token_ids)


@dataclass
class DecodeFlight:
    """A decode step launched and not yet landed: its requests (in row order), its logits [N, V]
    and argmax [N] (views of the decode graph's outputs, valid until the next replay)."""

    seqs: list
    logits: torch.Tensor
    argmax: torch.Tensor


class DecodeOverlap:
    """The engine's decode step in flight (`flight`) and the rule for launching one."""

    def __init__(self, runner, scheduler, max_model_len: int):
        self.runner, self.scheduler, self.max_model_len = runner, scheduler, max_model_len
        self.flight: DecodeFlight | None = None
        self.launched = 0  # steps launched in flight (the tests assert the path was taken)
        # the last launch's stop ids on the device and their host key: a batch's stop ids change
        # only when its requests do, so most launches copy none
        self._stop_key: tuple | None = None
        self._stop_ids: torch.Tensor | None = None

    def stops(self, seq) -> tuple[int, ...] | None:
        """seq's stop ids, padded with -1 to MAX_STOPS + 1 (at least one -1: a failed argmax
        draw, hyla.engine.sampler.PendingSample, is -1 and so stops too), when the device can
        tell whether its draw now in flight ends it; else None (the batch is not launched ahead)."""
        if seq.num_tokens + 2 >= self.max_model_len:
            return None
        ids = device_stop_ids(seq, 1)
        return None if ids is None or len(ids) > MAX_STOPS else (*ids, *[-1] * (MAX_STOPS + 1 - len(ids)))

    @torch.inference_mode()
    def launch(self, seqs: list, draws: PendingSample) -> None:
        """After a pure-decode step of `seqs` drew `draws` (still unread), queue the next
        step's forward when it is certain to run (see the module docstring); it becomes
        self.flight. Each sequence's num_computed_tokens counts the step just run."""
        if self.flight is not None or not seqs:
            return
        stops = [self.stops(seq) for seq in seqs]
        if any(s is None for s in stops):
            return
        plan = StepPlan([0] * len(seqs), [1] * len(seqs), [s.num_computed_tokens for s in seqs],
                        [s.block_table for s in seqs], [s.slot for s in seqs], [[0]] * len(seqs))
        if not self.runner.can_feed(plan):
            return
        transfers = self.scheduler.reserve_ahead(seqs, 1)  # grows the block tables the plan holds
        if transfers is None:
            return
        self.runner.apply_transfers(transfers)  # evicted pages reach the host tier before reuse
        key = tuple(stops)
        if key != self._stop_key:
            self._stop_key, self._stop_ids = key, to_device_long(stops, draws.tokens.device)
        skip = (draws.tokens[:, None] == self._stop_ids).any(-1)
        if draws.failed is not None:
            skip |= draws.failed
        result = self.runner.execute(plan, fed=(draws.tokens, skip))
        self.flight = DecodeFlight(list(seqs), result.logits, result.argmax)
        self.launched += 1

    def take(self) -> DecodeFlight:
        flight, self.flight = self.flight, None
        return flight

    def abandon(self, device: torch.device) -> None:
        """A step failed: let what is queued finish, then forget the step in flight (the engine
        recovers its requests from the host state)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.flight = None
