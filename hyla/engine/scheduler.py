"""Scheduler: decides which sequences run this step and how many tokens each feeds.

It holds no tensors. Each step fills a token budget (`max_num_batched_tokens`): running sequences
first, in admission order (decodes take 1 token, unfinished prompts take a chunk), then waiting
sequences in arrival order while a state slot, pages and budget remain. Prefill chunks and
decodes share one step (continuous batching with chunked prefill).

When pages run out, the newest running sequence is preempted: it gives back its slot and pages
and is recomputed later from its prompt + output so far (exact, since recomputation replays the
same tokens). No waiting sequence is admitted in a step that preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hyla.engine.memory import MemoryManager
from hyla.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, memory: MemoryManager, prefix_cache=None,
                 slots_per_seq: int = 1):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.memory = memory
        self.prefix_cache = prefix_cache
        self.slots_per_seq = slots_per_seq
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.cache_query_tokens = 0
        self.cache_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        if any(s.suspect for s in self.running) or (self.waiting and self.waiting[0].suspect):
            return self._schedule_suspect()
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            while not self.make_room(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            self.memory.allocate(seq, n)
            batch.add(seq, n)
            budget -= n
            i += 1
        if preempted:
            return batch
        cache = self.prefix_cache
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if cache is not None and seq.num_computed_tokens == 0:
                cache.match(seq)
            n = min(seq.num_uncomputed, budget)
            if not (self.free_slot_available(self.slots_per_seq) and self.make_room(seq, n)):
                if cache is not None:
                    cache.unmatch(seq)
                break
            self.waiting.popleft()
            seq.slot = self.memory.slots.allocate()
            if self.slots_per_seq > 1:
                seq.spec_slots = [seq.slot] + [self.memory.slots.allocate() for _ in range(self.slots_per_seq - 1)]
            self.memory.allocate(seq, n)
            if cache is not None:
                self.cache_query_tokens += seq.num_tokens
                self.cache_hit_tokens += cache.restore(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        return batch

    def _schedule_suspect(self) -> ScheduledBatch:
        """After a failed step: run one suspect sequence alone (see LLMEngine.recover)."""
        batch = ScheduledBatch()
        seq = next((s for s in self.running if s.suspect), None)
        if seq is None:
            seq = self.waiting[0]
            if not self.free_slot_available(self.slots_per_seq):
                return batch
            self.waiting.popleft()
            seq.slot = self.memory.slots.allocate()
            if self.slots_per_seq > 1:
                seq.spec_slots = [seq.slot] + [self.memory.slots.allocate() for _ in range(self.slots_per_seq - 1)]
            seq.status = Status.RUNNING
            self.running.append(seq)
        n = min(seq.num_uncomputed, self.max_num_batched_tokens)
        while not self.make_room(seq, n):
            others = [s for s in self.running if s is not seq]
            if not others:
                self.preempt(seq)
                return batch
            self.preempt(others[-1])
        self.memory.allocate(seq, n)
        batch.add(seq, n)
        return batch

    def make_room(self, seq: Sequence, n: int) -> bool:
        """Pages for seq's next n tokens, evicting unused prefix-cache pages if that is needed."""
        need = self.memory.pages_needed(seq, n)
        while need > self.memory.pages.num_free:
            if self.prefix_cache is None or not self.prefix_cache.evict_pages(need - self.memory.pages.num_free):
                return False
        return True

    def free_slot_available(self, n: int = 1) -> bool:
        """n state slots can be handed out now, evicting prefix-cache checkpoints if needed."""
        while self.memory.slots.num_free < n:
            if self.prefix_cache is None or not self.prefix_cache.evict_slot():
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Give back seq's slot and pages; it is recomputed from scratch when re-admitted."""
        self.running.remove(seq)
        self.memory.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's resources and drop it from the queues."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.memory.free(seq)
