"""Scheduler: decides which sequences run this step and plans every allocation the step makes.

It holds no tensors, and it is the only place that hands out pages and state slots (from the
Pools) during serving. Each step fills a token budget (`max_num_batched_tokens`): running
sequences first, in admission order (decodes take 1 token, unfinished prompts take a chunk), then
waiting sequences in arrival order while state slots, pages and budget remain. Prefill chunks and
decodes share one step (continuous batching with chunked prefill). Then, for the step's
sequences: the pages of speculative draft positions (best effort) and the state slots of the
checkpoints their prefill exports (best effort). The ScheduledBatch carries all of it, with the
copies the prefix cache planned meanwhile (restores, and moves between its storage tiers) to run
before the forward; ModelRunner executes them.

A request whose prefix-cache hit is copied back from the host tier runs in the step that admits
it: the runner applies the step's copies before its forward (hyla.engine.cache_tiers).

When pages run out, the newest running sequence is preempted: it gives back its slots and pages
and is recomputed later from its prompt + output so far (exact, since recomputation replays the
same tokens). No waiting sequence is admitted in a step that preempted.

Policies (vLLM's --scheduling-policy): "fcfs" admits in arrival order and puts a preempted
sequence back at the head of the queue. "priority" keeps the waiting queue ordered by
(SamplingParams.priority, arrival): a lower value first, arrival order among equals, a preempted
sequence back in its place; the victim of a preemption is the running sequence with the largest
(priority, arrival), also when the step had already planned it (it is then taken out of the batch).
"""

from __future__ import annotations

import time

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hyla.engine.pools import Pools
from hyla.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """One step's plan. seqs[i] feeds num_new_tokens[i] tokens. exports[i]: the (absolute
    position, state slot) checkpoints seqs[i]'s prefill exports in this step (the slots are
    already allocated). max_drafts[i]: None for a plain step, else seqs[i] is a speculative
    decode that may draft that many tokens (pages for its 1 + max_drafts positions are
    reserved). transfers: the prefix cache's copies (hyla.engine.cache_tiers) to run, in order,
    before the step's forward."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    exports: list[list[tuple[int, int]]] = field(default_factory=list)
    max_drafts: list[int | None] = field(default_factory=list)
    transfers: list[tuple] = field(default_factory=list)

    def add(self, seq: Sequence, n: int, exports=None, max_drafts: int | None = None) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.exports.append(exports or [])
        self.max_drafts.append(max_drafts)

    def remove(self, seq: Sequence) -> int:
        """Take seq out of the plan (preempted after it was planned) -> the tokens it had."""
        i = self.seqs.index(seq)
        n = self.num_new_tokens[i]
        for column in (self.seqs, self.num_new_tokens, self.exports, self.max_drafts):
            del column[i]
        return n

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def split(self) -> tuple[ScheduledBatch, ScheduledBatch]:
        """(plain part, speculative part), each in schedule order; copies stay with the whole."""
        plain, spec = ScheduledBatch(), ScheduledBatch()
        for seq, n, e, k in zip(self.seqs, self.num_new_tokens, self.exports, self.max_drafts):
            (plain if k is None else spec).add(seq, n, e, k)
        return plain, spec


class Scheduler:
    """slots_per_seq: state slots a running request holds (1, or 1 + k with speculative "slots"
    rollback). num_speculative_tokens: k when speculative decoding is on (0: off); max_model_len
    bounds the draft positions. policy: "fcfs" or "priority" (see the module docstring)."""

    POLICIES = ("fcfs", "priority")

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, pools: Pools, prefix_cache=None,
                 slots_per_seq: int = 1, num_speculative_tokens: int = 0, max_model_len: int = 1 << 30,
                 policy: str = "fcfs"):
        if policy not in self.POLICIES:
            raise ValueError(f"scheduling_policy must be one of {self.POLICIES}, got {policy!r}")
        self.policy = policy
        self._arrivals = itertools.count()
        self._arrival: dict[str, int] = {}  # request id -> arrival number (kept across preemptions)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pools = pools
        self.prefix_cache = prefix_cache
        self.slots_per_seq = slots_per_seq
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # set by a server (hyla.server.async_engine): whether a request is on its way to `add`
        # (arrived and still being prepared, or queued for the engine's loop); None: never
        self.incoming: Callable[[], bool] | None = None
        # the server's admission window (seconds): while requests run, a new one is admitted up to
        # this long after its arrival only once none is incoming, so that a burst shares a step
        self.admission_hold_s = 0.0
        self.num_preemptions = 0
        self.cache_query_tokens = 0
        self.cache_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        self._arrival[seq.request_id] = next(self._arrivals)
        if self.policy == "priority":
            self._enqueue(seq)
        else:
            self.waiting.append(seq)

    def _key(self, seq: Sequence) -> tuple[int, int]:
        """Priority order: (priority, arrival); smaller runs first and is preempted last."""
        return seq.params.priority, self._arrival[seq.request_id]

    def _enqueue(self, seq: Sequence) -> None:
        """Insert into the priority-ordered waiting queue, after every sequence of a smaller or
        equal key (a linear scan: waiting queues are short next to a step's work)."""
        key = self._key(seq)
        at = next((j for j, s in enumerate(self.waiting) if self._key(s) > key), len(self.waiting))
        self.waiting.insert(at, seq)

    def _victim(self) -> Sequence:
        """The running sequence a preemption takes: the newest (fcfs), or the one with the
        largest (priority, arrival)."""
        if self.policy == "priority":
            return max(self.running, key=self._key)
        return self.running[-1]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Plan one step (see the module docstring); an empty batch when nothing can run.

        Pages: `pools.allocate` grows `seq.block_table` to cover the step's tokens; each page's
        reference belongs to the request until finish / abort / preemption. Pages a prefix-cache
        hit shares carry one more reference, the tree's; the tree evicts only pages nobody else
        references (PrefixCache.evict_pages)."""
        if any(s.suspect for s in self.running) or (self.waiting and self.waiting[0].suspect):
            return self._plan_extras(self._schedule_suspect())
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            shifted = False  # a preemption in this turn may have removed a sequence before seq
            while not self.make_room(seq, n):
                victim = self._victim()
                self.preempt(victim)
                preempted = shifted = True
                if victim is seq:
                    break
                if victim in batch.seqs:  # planned earlier in this step (priority policy): unplanned
                    budget += batch.remove(victim)
                    n = min(seq.num_uncomputed, budget)
            if seq.status is not Status.RUNNING:
                break
            self.pools.allocate(seq, n)
            batch.add(seq, n)
            budget -= n
            # (found again only after a preemption: index() each turn made a step quadratic in the batch)
            i = self.running.index(seq) + 1 if shifted else i + 1
        if preempted or self._holding_admission():
            return self._plan_extras(batch)
        cache = self.prefix_cache
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            fit = self._fit(seq, budget, idle=not self.running and not batch.seqs)
            if fit is None:
                break
            hit, n = fit
            self.waiting.popleft()
            self._admit(seq)
            self.pools.allocate(seq, n)
            if cache is not None:
                self.cache_query_tokens += seq.num_tokens
                hit_tokens = cache.restore(seq, hit)
                self.cache_hit_tokens += hit_tokens
                if seq.num_preemptions == 0:  # what the request reports: its first start's hit (vLLM's)
                    seq.num_cached_tokens = hit_tokens
            batch.add(seq, n)
            budget -= n
        return self._plan_extras(batch)

    def _holding_admission(self) -> bool:
        """Whether this step admits no waiting request so that those on their way can join it in
        the next (hyla.server.admission: a burst that arrives together is admitted together):
        requests run (their decode goes on meanwhile), a request is incoming, and the first
        waiting one arrived less than admission_hold_s ago and was never preempted (a preempted
        request is resumed at once). Two turns of an agent trace arriving a few milliseconds
        apart otherwise run one prefill step after the other, the second waiting the whole first
        (a ~1K-token step of the 48B shape: ~60 ms on an H200)."""
        if self.admission_hold_s <= 0 or not self.running or not self.waiting or self.incoming is None:
            return False
        first = self.waiting[0]
        return (first.num_preemptions == 0 and time.monotonic() - first.times.arrival_time < self.admission_hold_s
                and self.incoming())

    def reserve_ahead(self, seqs: list[Sequence], num_tokens: int) -> list[tuple] | None:
        """For a step launched before this one's tokens are read (hyla.engine.overlap): whether
        the next step is certain to run `seqs` again, in this order (every running request, none
        suspect, and no waiting or incoming request can be admitted: none waits or is on its
        way, or max_num_seqs run), and pages for each one's next num_tokens positions past its
        computed tokens. Those pages are allocated now -> the prefix cache's copies the evictions
        planned (to run before the launch: they read pages handed out here), or None (nothing
        reserved beyond what the normal schedule would also hand out; the next step is scheduled
        as usual).

        An incoming request holds the launch back because a step queued ahead would delay its
        prefill by a whole step: it could join only the step after that one (a decode step of
        the 48B shape under load is ~12 ms; docs/perf-log/2026-12-07-host-tier-ttft-parts.md)."""
        admissible = len(self.running) < self.max_num_seqs
        if ((admissible and (self.waiting or (self.incoming is not None and self.incoming())))
                or len(self.running) != len(seqs)
                or any(a is not b for a, b in zip(self.running, seqs)) or any(s.suspect for s in seqs)):
            return None
        for seq in seqs:
            if not self.make_room(seq, num_tokens):
                return None
            self.pools.allocate(seq, num_tokens)
        return self.prefix_cache.take_transfers() if self.prefix_cache is not None else []

    def _fit(self, seq: Sequence, budget: int, idle: bool):
        """(prefix-cache hit or None, tokens n) when the waiting seq can start now with n of its
        tokens (free slots and pages found, evicting cache entries as needed), else None with
        any match undone.

        A hit pins what it uses: its shared pages, the partial page its rows are copied from,
        its checkpoint. When those pinned entries are exactly what the request lacks room for
        and nothing runs (idle), no later step would ever free anything, so the request starts
        without the hit (recomputed from scratch, the cache's unpinned entries evictable)
        instead of waiting forever."""
        cache = self.prefix_cache
        # prompt logprobs need the logits of every prompt position: such a request computes them all
        wants_all = seq.params.prompt_logprobs is not None
        hit = cache.match(seq) if cache is not None and seq.num_computed_tokens == 0 and not wants_all else None
        n = min(seq.num_uncomputed, budget)
        if self.free_slot_available(self.slots_per_seq) and self.make_room(seq, n):
            return hit, n
        if cache is not None:
            cache.unmatch(seq, hit)
        if hit is None or not idle:
            return None
        n = min(seq.num_uncomputed, budget)
        if self.free_slot_available(self.slots_per_seq) and self.make_room(seq, n):
            return None, n
        return None

    def _admit(self, seq: Sequence) -> None:
        """Hand a waiting sequence its state slots (the caller checked free_slot_available).

        Ownership: `seq.slot` (and, with speculative "slots" rollback, the k spare slots with it
        in `seq.spec_slots`; `seq.slot` is always one of them) belongs to the request from here
        until finish / abort / preemption (Scheduler.finish / preempt give them back; on a
        normal finish the prefix cache takes over the slot holding the final state). Nothing
        evicts a running request's slots or pages: eviction only touches what the prefix cache
        alone holds."""
        seq.slot = self.pools.slots.allocate()
        if self.slots_per_seq > 1:
            seq.spec_slots = [seq.slot] + [self.pools.slots.allocate() for _ in range(self.slots_per_seq - 1)]
        seq.status = Status.RUNNING
        if seq.times.first_scheduled_time is None:  # a preempted request's return is not its first
            seq.times.first_scheduled_time = time.monotonic()
        self.running.append(seq)

    def _plan_extras(self, batch: ScheduledBatch) -> ScheduledBatch:
        """After the tokens are chosen: the draft positions of speculative decodes and the
        checkpoint slots of prefills, both best effort (never a preemption)."""
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if self.num_speculative_tokens and self.wants_speculation(seq, n):
                batch.max_drafts[i] = self._reserve_drafts(seq)
            else:
                batch.exports[i] = self._plan_exports(seq, n)
        if self.prefix_cache is not None:  # evictions and restores planned copies: before the forward
            batch.transfers = self.prefix_cache.take_transfers()
        return batch

    @staticmethod
    def wants_speculation(seq: Sequence, n: int) -> bool:
        """A running request in its decode phase (its one unfed token is its last sampled one)."""
        return n == 1 and bool(seq.output_token_ids) and seq.num_uncomputed == 1

    def _reserve_drafts(self, seq: Sequence) -> int:
        """Pages for the draft positions of a speculative decode -> how many drafts it may make
        (at most k, within max_tokens and max_model_len; 0 when no pages can be found).

        Ownership: the pages past position num_computed_tokens + 1 are lent for this step only;
        after the verify, `trim` gives back those of rejected positions."""
        k = max(0, min(self.num_speculative_tokens, seq.max_tokens - len(seq.output_token_ids) - 1,
                       self.max_model_len - seq.num_tokens - 1))
        if k and not self.make_room(seq, 1 + k):
            return 0
        self.pools.allocate(seq, 1 + k)
        return k

    def _plan_exports(self, seq: Sequence, n: int) -> list[tuple[int, int]]:
        """Checkpoints (absolute position, fresh slot) seq exports in this step: the prefix
        cache's planned positions that fall inside the step's new tokens. Best effort: a
        checkpoint is skipped when no slot can be freed for it.

        Ownership: an export slot belongs to the step until its forward ran; then `file_exports`
        hands it to the prefix cache (which may evict it from then on), or `drop_exports` gives
        it back when the step failed."""
        mine = []
        lo, hi = seq.num_computed_tokens, seq.num_computed_tokens + n
        for pos in [p for p in seq.pending_checkpoints if lo < p <= hi]:
            seq.pending_checkpoints.remove(pos)
            if self.free_slot_available():
                mine.append((pos, self.pools.slots.allocate()))
        return mine

    def file_exports(self, seq: Sequence, exports: list[tuple[int, int]]) -> None:
        """The step that exported these checkpoints succeeded: the prefix cache takes them."""
        for pos, slot in exports:
            self.prefix_cache.insert(seq, pos, slot)

    def drop_exports(self, batch: ScheduledBatch) -> None:
        """The step failed: give back the slots its checkpoints were to be exported into."""
        for exports in batch.exports:
            for _, slot in exports:
                self.pools.slots.release(slot)
            exports.clear()

    def trim(self, seq: Sequence) -> None:
        """After a verify step: give back the pages of rejected draft positions."""
        self.pools.trim(seq)

    def _schedule_suspect(self) -> ScheduledBatch:
        """After a failed step: run one suspect sequence alone (see LLMEngine.recover)."""
        batch = ScheduledBatch()
        seq = next((s for s in self.running if s.suspect), None)
        if seq is None:
            seq = self.waiting[0]
            if not self.free_slot_available(self.slots_per_seq):
                return batch
            self.waiting.popleft()
            self._admit(seq)
        n = min(seq.num_uncomputed, self.max_num_batched_tokens)
        while not self.make_room(seq, n):
            others = [s for s in self.running if s is not seq]
            if not others:
                self.preempt(seq)
                return batch
            self.preempt(max(others, key=self._key) if self.policy == "priority" else others[-1])
        self.pools.allocate(seq, n)
        batch.add(seq, n)
        return batch

    def make_room(self, seq: Sequence, n: int) -> bool:
        """Pages for seq's next n tokens, evicting unused prefix-cache pages if that is needed."""
        need = self.pools.pages_needed(seq, n)
        while need > self.pools.pages.num_free:
            if self.prefix_cache is None or not self.prefix_cache.evict_pages(need - self.pools.pages.num_free):
                return False
        return True

    def free_slot_available(self, n: int = 1) -> bool:
        """n state slots can be handed out now, evicting prefix-cache checkpoints if needed."""
        while self.pools.slots.num_free < n:
            if self.prefix_cache is None or not self.prefix_cache.evict_slot():
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Give back seq's slots and pages; it is recomputed from scratch when re-admitted."""
        self.running.remove(seq)
        self.pools.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy == "priority":
            self._enqueue(seq)
        else:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, file_in_cache: bool = False) -> None:
        """Release a finished (or aborted, or failed) sequence's resources and drop it from the
        queues. file_in_cache (a normal finish): the prefix cache takes over the running slot,
        which holds the state after every fed token (no copy), and the pages' KV."""
        if file_in_cache and self.prefix_cache is not None and seq.num_computed_tokens > 0:
            self.prefix_cache.insert(seq, seq.num_computed_tokens, seq.slot)
            if seq.spec_slots:
                seq.spec_slots.remove(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._arrival.pop(seq.request_id, None)
        self.pools.free(seq)
