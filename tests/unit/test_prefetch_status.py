"""``PrefetchResults``: LMCache's lookup results handed over once, and parked waits answered by the
result or by their timeout, whichever comes first (never blocking the caller)."""

from __future__ import annotations

import threading

from lmcache_core.server.lmcache.prefetch_status import DEFERRED, PrefetchResults
from tests.harness import wait_until


class Replies:
    def __init__(self) -> None:
        self.got: list[int | None] = []
        self.event = threading.Event()

    def __call__(self, hits: int | None) -> None:
        self.got.append(hits)
        self.event.set()


def test_query_semantics_none_while_running_then_the_hits_once_then_zero() -> None:
    r = PrefetchResults()
    assert r.take("unknown") == 0
    r.pending("a")
    assert r.take("a") is None and r.take("a") is None
    r.set("a", 3)
    assert r.take("a") == 3 and r.take("a") == 0


def test_a_wait_on_a_done_or_unknown_lookup_answers_at_once() -> None:
    r = PrefetchResults()
    r.pending("a")
    r.set("a", 2)
    reply = Replies()
    assert r.wait("a", 5.0, reply) == 2
    assert r.wait("a", 5.0, reply) == 0 and r.wait("b", 5.0, reply) == 0
    assert reply.got == [] and r.parked == 0


def test_a_parked_wait_gets_the_result_when_it_comes() -> None:
    r = PrefetchResults(max_wait_s=0.1)
    r.pending("a")
    first, second = Replies(), Replies()
    assert r.wait("a", 5.0, first) is DEFERRED and r.wait("a", 5.0, second) is DEFERRED
    assert r.parked == 2
    r.set("a", 4)
    assert first.got == [4] and second.got == [0]  # handed over once, to the oldest wait
    assert r.parked == 0 and r.take("a") == 0
    # the timer passes the waits' (clamped) deadline and, finding them answered, ends: it never
    # answers them again
    wait_until(lambda: r._timer is None, what="the timer thread never ended")
    assert first.got == [4] and second.got == [0]


def test_a_parked_wait_times_out_with_none_and_the_result_stays(fake_clock) -> None:
    r = PrefetchResults(clock=fake_clock)
    r.pending("a")
    reply, longer = Replies(), Replies()
    assert r.wait("a", 0.2, reply) is DEFERRED
    assert r.wait("a", 2.0, longer) is DEFERRED
    fake_clock.advance(0.19)
    assert not reply.event.wait(0.3)  # the timer keeps looking at the clock: not due yet
    fake_clock.advance(0.02)
    assert reply.event.wait(10)
    assert reply.got == [None]
    assert longer.got == [] and r.parked == 1
    r.set("a", 1)
    assert longer.got == [1] and r.take("a") == 0


def test_an_earlier_deadline_wakes_the_timer() -> None:
    r = PrefetchResults()
    r.pending("a")
    slow, fast = Replies(), Replies()
    assert r.wait("a", 30.0, slow) is DEFERRED
    assert r.wait("a", 0.1, fast) is DEFERRED
    assert fast.event.wait(10)  # woken for it: not at the slow wait's 30 s
    r.set("a", 0)
    assert slow.got == [0]


def test_waits_are_bounded_in_number_and_time() -> None:
    r = PrefetchResults(max_waits=2, max_wait_s=0.1)
    r.pending("a")
    replies = [Replies() for _ in range(3)]
    assert r.wait("a", 3600.0, replies[0]) is DEFERRED
    assert r.wait("a", 3600.0, replies[1]) is DEFERRED
    assert r.wait("a", 3600.0, replies[2]) is None  # too many parked: answered as timed out
    assert r.wait("a", 0.0, replies[2]) is None and r.wait("a", float("nan"), replies[2]) is None
    assert replies[0].event.wait(2) and replies[1].event.wait(2)  # clamped to max_wait_s
    assert [x.got for x in replies] == [[None], [None], []]


def test_dropped_results_and_the_table_bound() -> None:
    r = PrefetchResults(max_results=2)
    for name in "abc":
        r.pending(name)
        r.set(name, 1)
    assert len(r) == 2 and r.take("a") == 0  # the oldest went
    r.drop("b")
    assert r.take("b") == 0 and r.take("c") == 1


def test_a_result_is_kept_only_for_a_pending_lookup() -> None:
    r = PrefetchResults()
    r.set("never-pending", 2)
    assert len(r) == 0 and r.take("never-pending") == 0
    r.pending("a")
    r.drop("a")  # end_session while the lookup runs
    r.set("a", 3)  # the lookup finishes late: not put back
    assert len(r) == 0 and r.take("a") == 0
    r.pending("b")
    r.set("b", 0)  # a failed or dropped pending lookup: no hits, handed over as before
    assert len(r) == 1 and r.take("b") == 0 and len(r) == 0


def test_answered_waits_leave_the_deadline_heap() -> None:
    r = PrefetchResults()
    for i in range(500):
        r.pending(f"r{i}")
        assert r.wait(f"r{i}", 30.0, Replies()) is DEFERRED
        r.set(f"r{i}", 1)  # answered long before its deadline
    assert r.parked == 0
    assert len(r._deadlines) <= 64 + 1
    r.pending("live")
    live = Replies()
    assert r.wait("live", 30.0, live) is DEFERRED
    for i in range(200):
        r.pending(f"s{i}")
        assert r.wait(f"s{i}", 30.0, Replies()) is DEFERRED
        r.set(f"s{i}", 1)
    assert len(r._deadlines) <= 2 * r.parked + 64 + 1
    r.set("live", 5)
    assert live.got == [5]
