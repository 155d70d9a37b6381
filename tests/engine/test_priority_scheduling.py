"""The "priority" scheduling policy (vLLM's --scheduling-policy priority): the waiting queue runs
lower priority values first, arrival order among equals, a preempted request goes back in its
place, and a preemption takes the running request with the largest (priority, arrival), also
when the step had already planned it. "fcfs" is unchanged."""

import pytest

from hyla.engine.pools import Pools
from hyla.engine.sampling_params import SamplingParams
from hyla.engine.scheduler import Scheduler
from hyla.engine.sequence import Sequence, Status

P = 4  # page size


def seq(n_prompt, rid, priority=0, max_tokens=8):
    return Sequence(rid, None, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens, priority=priority),
                    max_tokens, None)


def run(batch, token=1):
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(token, None)


def test_the_waiting_queue_orders_by_priority_then_arrival():
    sched = Scheduler(8, 100, Pools(num_pages=64, num_slots=8, page_size=P), policy="priority")
    seqs = [seq(3, "a", 5), seq(3, "b", -1), seq(3, "c", 5), seq(3, "d", 0), seq(3, "e", -1)]
    for s in seqs:
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["b", "e", "d", "a", "c"]
    assert [s.request_id for s in sched.schedule().seqs] == ["b", "e", "d", "a", "c"]


def test_fcfs_keeps_arrival_order():
    sched = Scheduler(8, 100, Pools(num_pages=64, num_slots=8, page_size=P))
    for s in (seq(3, "a"), seq(3, "b"), seq(3, "c")):
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["a", "b", "c"]


def test_only_free_slots_admit_and_the_most_urgent_goes_first():
    sched = Scheduler(8, 100, Pools(num_pages=64, num_slots=1, page_size=P), policy="priority")
    low, high = seq(3, "low", 3), seq(3, "high", 1)
    sched.add(low)
    sched.add(high)
    assert sched.schedule().seqs == [high]  # one slot: the lower value takes it
    sched.finish(high)
    assert sched.schedule().seqs == [low]


def test_preemption_takes_the_lowest_priority_even_if_already_planned():
    # 5 pages of 4 tokens: a (priority 2) and b (priority 0) each hold 2 pages after their prompts
    pools = Pools(num_pages=5, num_slots=4, page_size=P)
    sched = Scheduler(4, 100, pools, policy="priority")
    a, b = seq(8, "a", priority=2), seq(8, "b", priority=0)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert first.seqs == [b, a]
    run(first)
    sched.running[:] = [a, b]  # a runs first in the step's order: planned before b needs room
    batch = sched.schedule()  # a's decode takes the 5th page; b's then needs one: a is the victim
    assert a.status is Status.WAITING and a.num_preemptions == 1 and a.block_table == []
    assert batch.seqs == [b] and batch.num_new_tokens == [1]
    assert list(sched.waiting) == [a] and sched.num_preemptions == 1


def test_a_preempted_request_keeps_its_place_among_equals():
    pools = Pools(num_pages=64, num_slots=4, page_size=P)
    sched = Scheduler(1, 100, pools, policy="priority")  # one running at a time
    first, second, third = seq(3, "1"), seq(3, "2"), seq(3, "3")
    for s in (first, second, third):
        sched.add(s)
    assert sched.schedule().seqs == [first]
    sched.preempt(first)
    assert [s.request_id for s in sched.waiting] == ["1", "2", "3"]  # back ahead of later arrivals
    late = seq(3, "0", priority=-1)
    sched.add(late)
    assert [s.request_id for s in sched.waiting] == ["0", "1", "2", "3"]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        Scheduler(1, 10, Pools(num_pages=4, num_slots=1, page_size=P), policy="lifo")
