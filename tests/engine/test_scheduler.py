"""The Scheduler without a model: every allocation of a step is in its plan (pages, slots, draft
positions, checkpoint slots, restore copies), preemption order, and what it gives back."""

from hyla.engine.pools import Pools
from hyla.engine.prefix_cache import PrefixCache
from hyla.engine.sampling_params import SamplingParams
from hyla.engine.scheduler import Scheduler
from hyla.engine.sequence import Sequence, Status

P = 4  # page size


def seq(n_prompt, rid, max_tokens=8, first=0):
    return Sequence(rid, None, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens),
                    max_tokens, None)


def run(sched, batch, token=1):
    """What the engine does after a successful plain step: count the fed tokens, sample where a
    prompt (or a decode) completed."""
    for s, n, exports in zip(batch.seqs, batch.num_new_tokens, batch.exports):
        s.num_computed_tokens += n
        sched.file_exports(s, exports)
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(token, None)


def in_use(pools):
    return pools.pages.num_pages - pools.pages.num_free, pools.slots.num_slots - pools.slots.num_free


def test_admission_plans_pages_and_slots_within_the_token_budget():
    pools = Pools(num_pages=16, num_slots=4, page_size=P)
    sched = Scheduler(4, 10, pools)
    a, b = seq(6, "a"), seq(9, "b")
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [6, 4]  # b's prompt is chunked
    assert len(a.block_table) == 2 and len(b.block_table) == 1
    assert a.slot is not None and b.slot is not None and a.slot != b.slot
    assert in_use(pools) == (3, 2)
    assert batch.transfers == [] and batch.max_drafts == [None, None]


def test_waiting_requests_wait_for_a_free_slot():
    pools = Pools(num_pages=16, num_slots=2, page_size=P)
    sched = Scheduler(8, 100, pools)
    seqs = [seq(3, str(i)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == seqs[:2] and list(sched.waiting) == [seqs[2]]
    sched.finish(seqs[0])
    assert sched.schedule().seqs == [seqs[1], seqs[2]]


def test_running_out_of_pages_preempts_the_newest_and_admits_nobody():
    pools = Pools(num_pages=5, num_slots=4, page_size=P)
    sched = Scheduler(4, 100, pools)
    a, b, c = seq(4, "a"), seq(4, "b"), seq(4, "c")
    for s in (a, b):
        sched.add(s)
    run(sched, sched.schedule())  # 2 pages, both prompts done: each has one token to feed
    sched.add(c)
    run(sched, sched.schedule())  # c's prompt takes page 3; a and b decode into page 2 of theirs
    assert in_use(pools) == (5, 3) and [s.num_tokens for s in (a, b, c)] == [6, 6, 5]
    assert len(a.block_table) == 2 and len(b.block_table) == 2 and len(c.block_table) == 1
    d = seq(2, "d")
    sched.add(d)
    # a, b fit in their pages; c needs a second page: c (the newest) is preempted, d waits
    batch = sched.schedule()
    assert batch.seqs == [a, b] and c.status is Status.WAITING and c.num_preemptions == 1
    assert list(sched.waiting) == [c, d] and c.block_table == [] and c.slot is None
    assert sched.num_preemptions == 1
    # the preempted request recomputes everything it had
    sched.finish(a)
    sched.finish(b)
    batch = sched.schedule()
    assert batch.seqs == [c, d] and batch.num_new_tokens == [c.num_tokens, 2]


def test_a_request_alone_without_room_preempts_itself():
    pools = Pools(num_pages=2, num_slots=2, page_size=P)
    sched = Scheduler(2, 100, pools)
    a = seq(8, "a")
    sched.add(a)
    run(sched, sched.schedule())
    assert in_use(pools) == (2, 1)
    batch = sched.schedule()  # position 8 needs a third page that does not exist
    assert batch.is_empty and a.status is Status.WAITING and in_use(pools) == (0, 0)


def test_speculative_decodes_get_pages_for_their_draft_positions():
    pools = Pools(num_pages=8, num_slots=8, page_size=P)
    sched = Scheduler(2, 100, pools, slots_per_seq=4, num_speculative_tokens=3)
    a, b = seq(3, "a", max_tokens=3), seq(6, "b")
    for s in (a, b):
        sched.add(s)
    batch = sched.schedule()
    assert batch.max_drafts == [None, None]  # prefills
    assert len(a.spec_slots) == 4 and a.slot == a.spec_slots[0] and in_use(pools)[1] == 8
    run(sched, batch)
    batch = sched.schedule()
    # a: 2 more tokens at most (max_tokens 3) -> 1 draft; b: 3 drafts, positions 6..9 -> 3 pages
    assert batch.max_drafts == [1, 3]
    assert len(a.block_table) == 2 and len(b.block_table) == 3
    b.num_computed_tokens += 1  # the verify kept one token: the next position is 7, page 3 goes back
    sched.trim(b)
    assert len(b.block_table) == 2


def test_draft_pages_are_best_effort():
    pools = Pools(num_pages=2, num_slots=4, page_size=P)
    sched = Scheduler(1, 100, pools, slots_per_seq=4, num_speculative_tokens=3)
    a = seq(5, "a")
    sched.add(a)
    run(sched, sched.schedule())
    batch = sched.schedule()  # positions 5..8 need a third page: no drafts, no preemption
    assert batch.max_drafts == [0] and a.status is Status.RUNNING and len(a.block_table) == 2


def test_checkpoint_exports_and_restore_copies_are_in_the_plan():
    pools = Pools(num_pages=32, num_slots=6, page_size=P)
    cache = PrefixCache(pools)
    sched = Scheduler(2, 6, pools, prefix_cache=cache)
    a = seq(10, "a")
    sched.add(a)
    batch = sched.schedule()  # chunk 0..6: no planned position inside (prompt end - 1 = 9)
    assert a.pending_checkpoints == [9] and batch.exports == [[]]
    run(sched, batch)
    batch = sched.schedule()
    (pos, slot), = batch.exports[0]
    assert pos == 9 and slot not in (a.slot,) and a.pending_checkpoints == []
    run(sched, batch)
    sched.finish(a, file_in_cache=True)  # the running slot holds the state at 10: the tree keeps it
    assert cache.usage()["cached_checkpoints"] == 2 and in_use(pools)[1] == 2
    b = seq(12, "b")  # shares a's first 10 tokens
    sched.add(b)
    batch = sched.schedule()
    assert sched.cache_hit_tokens == 10 and b.num_computed_tokens == 10 and batch.num_new_tokens == [2]
    ckpt = cache.root.children[0][0].children[4][0].children[8][0]  # the page of tokens 8..9
    assert batch.transfers == [("copy_rows", ckpt.page, b.block_table[2], 2),
                               ("copy_slot", ckpt.checkpoints[2][1], b.slot)]


def test_failed_step_gives_the_export_slots_back():
    pools = Pools(num_pages=32, num_slots=4, page_size=P)
    sched = Scheduler(2, 100, pools, prefix_cache=PrefixCache(pools))
    a = seq(10, "a")
    sched.add(a)
    batch = sched.schedule()
    assert len(batch.exports[0]) == 1 and in_use(pools)[1] == 2
    sched.drop_exports(batch)
    assert in_use(pools)[1] == 1 and batch.exports == [[]]


def test_exports_are_skipped_when_no_slot_can_be_freed():
    pools = Pools(num_pages=32, num_slots=1, page_size=P)
    sched = Scheduler(1, 100, pools, prefix_cache=PrefixCache(pools))
    a = seq(10, "a")
    sched.add(a)
    assert sched.schedule().exports == [[]] and a.pending_checkpoints == []


def test_a_burst_is_admitted_together_while_others_decode():
    """With requests running and another incoming (a server's Scheduler.incoming), a waiting
    request is held back (the running ones decode) until none is incoming, then admitted with
    the rest of its burst; never longer than admission_hold_s after its arrival, never when it
    was preempted, never with the hold off or nothing running."""
    pools = Pools(num_pages=32, num_slots=8, page_size=P)
    sched = Scheduler(8, 100, pools)
    on_its_way = [True]
    sched.incoming = lambda: on_its_way[0]
    sched.admission_hold_s = 60.0
    running = seq(3, "running")
    sched.add(running)
    run(sched, sched.schedule())  # admitted alone: nothing ran yet (the idle case is the loop's wait)
    first, second = seq(5, "first"), seq(6, "second")
    sched.add(first)
    batch = sched.schedule()
    assert batch.seqs == [running] and list(sched.waiting) == [first]  # decoding goes on, first held
    run(sched, batch)
    sched.add(second)
    on_its_way[0] = False
    batch = sched.schedule()
    assert batch.seqs == [running, first, second]  # the burst in one step
    run(sched, batch)
    # the window bounds the hold: an arrival older than admission_hold_s is admitted at once
    on_its_way[0] = True
    late = seq(4, "late")
    sched.add(late)
    late.times.arrival_time -= 61.0
    assert sched.schedule().seqs[-1] is late
    resumed = seq(4, "resumed")  # a preempted request goes back to running at once
    sched.add(resumed)
    resumed.num_preemptions = 1
    assert sched.schedule().seqs[-1] is resumed
    # off: no hold
    sched.admission_hold_s = 0.0
    other = seq(4, "other")
    sched.add(other)
    assert sched.schedule().seqs[-1] is other
