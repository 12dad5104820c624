"""Checksums taken off the store's reply path (storage.checksum_lanes): the same digests as hashing
each whole piece; registered at the commit, started once the reply is out, handed over on a lane;
bounded when a lane is stuck or a hash never starts, drained or given up at close."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import pytest
import torch

from lmcache_core.storage import checksum_lanes
from lmcache_core.storage.checksum_lanes import ChecksumLanes
from lmcache_core.storage.integrity import checksum
from tests.harness import FakeClock, wait_until

REAL_CHECKSUM = checksum_lanes.checksum


def _receiver() -> tuple[Callable[[list[int] | None], None], Future[list[int] | None]]:
    """An ``on_digests`` callback and the future it fills (once: a second call fails it)."""
    got: Future[list[int] | None] = Future()
    return got.set_result, got


def _pieces(n: int, nbytes: int = 96, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (nbytes + 4,), generator=g, dtype=torch.uint8)
            for _ in range(n)]


class Stuck:
    """The lanes' checksum, blocked until ``release`` is set (a stuck lane)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self, buffer: object) -> int:
        self.started.set()
        self.release.wait(10)
        return REAL_CHECKSUM(buffer)


@pytest.fixture
def deferred(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every store hashes on a lane, however small."""
    monkeypatch.setattr(checksum_lanes, "MAX_INLINE_BYTES", 0)


@pytest.fixture
def stuck(monkeypatch: pytest.MonkeyPatch, deferred: None):
    hasher = Stuck()
    monkeypatch.setattr(checksum_lanes, "checksum", hasher)
    yield hasher
    hasher.release.set()


def test_a_deferred_store_hashes_only_once_started_and_gets_whole_piece_checksums(
        deferred: None) -> None:
    slots = _pieces(4)
    lanes = ChecksumLanes()
    try:
        sums = lanes.begin(slots, 96)
        assert sums.deferred
        on_digests, got = _receiver()
        start = sums.finish(on_digests)
        assert lanes.pending == 1 and sums.lane is None and not got.done()  # not started yet
        start()
        digests = got.result(10)
        assert digests == [checksum(s[:96]) for s in slots] and len(set(digests)) == 4
        assert lanes.pending == 0
    finally:
        lanes.close()


def test_small_stores_hash_inline_and_a_lane_is_reused_once_given_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slots = _pieces(1, 64)
    lanes = ChecksumLanes()
    try:
        small = lanes.begin(slots, 64)
        assert not small.deferred and small.digests() == [checksum(slots[0][:64])]
        monkeypatch.setattr(checksum_lanes, "MAX_INLINE_BYTES", 0)
        for _ in range(3):
            on_digests, got = _receiver()
            lanes.begin(slots, 64).finish(on_digests)()
            assert got.result(10) == [checksum(slots[0][:64])]
        assert len(lanes._all) == 1  # one store at a time: the lane came back each time
    finally:
        lanes.close()


def test_concurrent_stores_get_right_digests(deferred: None) -> None:
    lanes = ChecksumLanes()
    failures: list[str] = []

    def store(seed: int) -> None:
        slots = _pieces(3, 1 << 16, seed)
        for _ in range(20):
            on_digests, got = _receiver()
            lanes.begin(slots, 1 << 16).finish(on_digests)()
            if got.result(30) != [checksum(s[: 1 << 16]) for s in slots]:
                failures.append(f"seed {seed}")

    threads = [threading.Thread(target=store, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    created = len(lanes._all)
    lanes.close()
    assert not failures and 1 <= created <= 4  # never more lanes than stores hashing at once


def test_start_returns_before_the_digests_and_a_stuck_lane_is_reaped_when_due(
        stuck: Stuck) -> None:
    clock = FakeClock()
    slots = _pieces(1)
    lanes = ChecksumLanes(clock)
    try:
        sums = lanes.begin(slots, 96)
        on_digests, got = _receiver()
        sums.finish(on_digests)()  # returns with the lane still hashing
        assert stuck.started.wait(10) and not got.done() and lanes.pending == 1
        queued = lanes.begin(slots, 96)  # the same lane, free again: queued behind the stuck one
        on_queued, got_queued = _receiver()
        queued.finish(on_queued)()
        assert queued.lane is sums.lane
        assert lanes.reap() == 0  # not due yet
        clock.advance(checksum_lanes.LANE_TIMEOUT_S)
        assert lanes.reap() == 2  # given up: both stores on the stuck lane
        assert got.result(0) is None and got_queued.result(0) is None
        assert lanes._all == [] and lanes.pending == 0  # retired, never handed out again
        stuck.release.set()  # the stuck hash ends: its late digests go nowhere (set once)
    finally:
        lanes.close()


def test_a_hash_never_started_is_given_up_when_due(deferred: None) -> None:
    """E.g. its reply never went (the loop stopped first): its pieces must not stay pending."""
    clock = FakeClock()
    lanes = ChecksumLanes(clock)
    try:
        on_digests, got = _receiver()
        start = lanes.begin(_pieces(2), 96).finish(on_digests)
        clock.advance(checksum_lanes.LANE_TIMEOUT_S - 1)
        assert lanes.reap() == 0 and not got.done()
        clock.advance(1)
        assert lanes.reap() == 1 and got.result(0) is None and lanes.pending == 0
        start()  # a start after that hashes for nobody: the callback got its answer once
    finally:
        lanes.close()


def test_close_waits_for_a_hash_still_running(stuck: Stuck) -> None:
    slots = _pieces(1)
    lanes = ChecksumLanes()
    on_digests, got = _receiver()
    lanes.begin(slots, 96).finish(on_digests)()
    assert stuck.started.wait(10)
    drained: list[bool] = []
    closing = threading.Thread(target=lambda: drained.append(lanes.close(timeout_s=30)))
    closing.start()
    stuck.release.set()  # the hash ends while close waits for it
    closing.join(60)
    assert drained == [True] and got.result(0) == [checksum(slots[0][:96])]
    assert lanes.pending == 0


def test_close_gives_up_a_stuck_hash_and_one_never_started(stuck: Stuck) -> None:
    slots = _pieces(1)
    lanes = ChecksumLanes()
    on_sticky, got_sticky = _receiver()
    lanes.begin(slots, 96).finish(on_sticky)()
    assert stuck.started.wait(10)
    on_unstarted, got_unstarted = _receiver()
    lanes.begin(slots, 96).finish(on_unstarted)  # its reply never went
    assert not lanes.close(timeout_s=0.2)
    assert got_sticky.result(0) is None and got_unstarted.result(0) is None
    assert lanes.pending == 0


def test_after_close_stores_hash_inline_and_a_late_start_hashes_where_it_is_called(
        deferred: None) -> None:
    slots = _pieces(1)
    lanes = ChecksumLanes()
    on_digests, got = _receiver()
    start = lanes.begin(slots, 96).finish(on_digests)
    assert not lanes.close()  # nothing running; the unstarted one is given up
    assert got.result(0) is None
    start()  # no lane is created that nothing would shut down
    assert lanes._all == []
    late = lanes.begin(slots, 96)
    assert not late.deferred and late.digests() == [checksum(slots[0][:96])]


def test_a_hash_lets_the_copies_running_finish_first(deferred: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid store's first group hashed beside the next groups' gathers slowed them; the hash
    starts once no copy runs (here: it sees none running when it reads the slots)."""
    monkeypatch.setattr(checksum_lanes, "YIELD_S", 30.0)
    lanes = ChecksumLanes()
    copies_seen: list[int] = []

    def observed(buffer: object) -> int:
        copies_seen.append(lanes.copies._running)
        return REAL_CHECKSUM(buffer)

    monkeypatch.setattr(checksum_lanes, "checksum", observed)
    slots = _pieces(2)
    try:
        on_digests, got = _receiver()
        with lanes.copies.running():
            lanes.begin(slots, 96).finish(on_digests)()
            wait_until(lambda: len(lanes.copies._idle._waiters) == 1)  # type: ignore[attr-defined]
        assert got.result(10) == [REAL_CHECKSUM(s[:96]) for s in slots]
        assert copies_seen == [0, 0]
    finally:
        lanes.close()


def test_a_hash_waits_for_copies_at_most_yield_s(deferred: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream of copies never starves a hash: it goes ahead after YIELD_S."""
    monkeypatch.setattr(checksum_lanes, "YIELD_S", 0.05)
    lanes = ChecksumLanes()
    slots = _pieces(1)
    try:
        with lanes.copies.running():  # a copy that outlasts the hash
            on_digests, got = _receiver()
            lanes.begin(slots, 96).finish(on_digests)()
            assert got.result(30) == [checksum(slots[0][:96])]
    finally:
        lanes.close()
