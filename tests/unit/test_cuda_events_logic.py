"""CUDA event bookkeeping on the CPU, with fake events and futures (issue 16, findings 1, 3, 5).

- a worker's interprocess event stays alive until every request carrying its handle was answered,
  longer when a request got no reply (it may still be served), and is reused only after that;
- every wait on an event is polled with a deadline (no unbounded ``synchronize``);
- a worker event that never completes times the request out before any copy is queued.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from lmcache_core.errors import LMCacheTimeoutError, NotRegisteredError
from lmcache_core.kv import cuda_events
from lmcache_core.kv.cuda_events import CopyStream, InflightEvents, wait_event_done
from lmcache_core.transport.future import MessagingFuture


class FakeEvent:
    """Stands in for torch.cuda.Event: done after ``polls`` queries (never if None)."""

    def __init__(self, polls: int | None = 0) -> None:
        self.polls = polls
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.polls is not None and self.queries > self.polls


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _alive(ref: weakref.ref[Any]) -> bool:
    gc.collect()
    return ref() is not None


pytestmark = pytest.mark.usefixtures("own_objects_gc")  # _alive's collections stay cheap


# ---------------------------------------------------------------- finding 1: event lifetime


def test_event_lives_until_the_reply_then_is_released() -> None:
    events = InflightEvents(grace_s=10.0, spare=0)
    event = FakeEvent()
    ref = weakref.ref(event)
    future: MessagingFuture[Any] = MessagingFuture()
    events.hold(event, [future])
    del event
    assert events.release_answered() == 1 and _alive(ref)  # no reply yet: the server may open it
    future.set_result("ok")
    assert events.release_answered() == 0 and not _alive(ref)


def test_event_of_a_batch_waits_for_every_request() -> None:
    events = InflightEvents(grace_s=10.0)
    first: MessagingFuture[Any] = MessagingFuture()
    second: MessagingFuture[Any] = MessagingFuture()
    events.hold(FakeEvent(), [first, second])
    first.set_result("ok")
    assert events.release_answered() == 1
    second.set_exception(NotRegisteredError("reaped"))  # a server reply, even an error, counts
    assert events.release_answered() == 0


def test_a_request_without_reply_keeps_its_event_for_the_grace_period() -> None:
    clock = Clock()
    events = InflightEvents(grace_s=60.0, clock=clock)
    future: MessagingFuture[Any] = MessagingFuture()
    event = FakeEvent()
    events.hold(event, [future])
    future.set_exception(LMCacheTimeoutError("no reply"))  # it may still sit in the server's queue
    assert events.release_answered() == 1
    assert events.acquire(FakeEvent) is not event  # never reused while the server may open it
    clock.now = 61.0
    assert events.release_answered() == 0


def test_answered_events_are_reused_never_held_ones() -> None:
    events = InflightEvents(grace_s=10.0, spare=1)
    made: list[FakeEvent] = []

    def make() -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]

    pending: MessagingFuture[Any] = MessagingFuture()
    first = events.acquire(make)
    events.hold(first, [pending])
    second = events.acquire(make)
    assert second is not first  # first is still in flight: re-recording it would starve its wait
    events.hold(second, [MessagingFuture.completed("ok")])
    assert events.acquire(make) is second and len(made) == 2


def test_no_event_means_nothing_to_hold() -> None:
    events = InflightEvents(grace_s=1.0)
    events.hold(None, [MessagingFuture()])
    assert len(events) == 0


# ---------------------------------------------------------------- findings 3, 5: bounded waits


def test_wait_event_done_polls_with_backoff() -> None:
    clock = Clock()
    event = FakeEvent(polls=5)
    wait_event_done(event, 1.0, clock=clock, sleep=clock.sleep)
    assert event.queries == 6
    assert clock.now < 0.01  # 20 us doubling: a few hundred microseconds in all


def test_wait_event_done_times_out_on_an_event_that_never_completes() -> None:
    clock = Clock()
    event = FakeEvent(polls=None)
    with pytest.raises(LMCacheTimeoutError, match="within 2s"):
        wait_event_done(event, 2.0, "the worker's CUDA event", clock=clock, sleep=clock.sleep)
    assert 2.0 <= clock.now < 2.01
    assert event.queries < 2.0 / cuda_events._POLL_MAX_S + 20  # sleeps, never a busy spin


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


def test_copy_stream_times_out_before_queueing_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker event that never completes (a dead or hung worker): the request times out and the
    body (the copies) never runs, so no copy can land after the failure was reported."""
    stream = CopyStream("cuda:0")
    fake = FakeStream()
    monkeypatch.setattr(CopyStream, "stream", property(lambda self: fake))
    monkeypatch.setattr(cuda_events, "open_ipc_event", lambda handle, device: FakeEvent(None))
    monkeypatch.setattr(cuda_events, "_POLL_MAX_S", 1e-3)
    ran = []
    with pytest.raises(LMCacheTimeoutError), stream.run(b"e" * 64, timeout_s=0.05):
        ran.append(True)
    assert not ran and not fake.waited


def test_copy_stream_runs_after_the_worker_event(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = CopyStream("cuda:0")
    fake = FakeStream()
    event = FakeEvent(polls=3)
    synced: list[float] = []
    monkeypatch.setattr(CopyStream, "stream", property(lambda self: fake))
    monkeypatch.setattr(cuda_events, "open_ipc_event", lambda handle, device: event)
    monkeypatch.setattr(cuda_events.torch.cuda, "stream", lambda s: _Null())
    monkeypatch.setattr(CopyStream, "synchronize", lambda self, timeout_s=0.0: synced.append(timeout_s))
    with stream.run(b"e" * 64, timeout_s=7.0):
        assert event.queries == 4 and fake.waited == [event]  # done before any copy is queued
    assert synced == [7.0]  # the copies are waited for with the same bound


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
