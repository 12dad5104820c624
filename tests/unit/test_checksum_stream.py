"""Checksums taken off the store's reply path (storage.checksum_stream + BlockCopier.gather's
progress): the same digests as hashing each whole piece, whatever the parts; handed over after the
store returns, bounded when a lane is stuck, drained or given up at close."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import pytest
import torch

from lmcache_core.kv import copy as kv_copy
from lmcache_core.kv.copy import BlockCopier
from lmcache_core.protocol.messages import KVLayoutName
from lmcache_core.storage import checksum_stream
from lmcache_core.storage.checksum_stream import ChecksumLanes
from lmcache_core.storage.integrity import checksum
from tests.harness import FakeClock
from tests.unit.test_kv_copy import CHUNK, _canonical, _ids, _layers, _slots


def _receiver() -> tuple[Callable[[list[int] | None], None], Future[list[int] | None]]:
    """An ``on_digests`` callback and the future it fills (once: a second call fails it)."""
    got: Future[list[int] | None] = Future()
    return got.set_result, got


class StuckHasher:
    """xxh3_64's stand-in whose ``update`` blocks until ``release`` is set (a stuck lane)."""

    release = threading.Event()
    started = threading.Event()

    def update(self, _part: object) -> None:
        StuckHasher.started.set()
        StuckHasher.release.wait(10)

    def intdigest(self) -> int:
        return 7


@pytest.fixture
def stuck(monkeypatch: pytest.MonkeyPatch):
    StuckHasher.release, StuckHasher.started = threading.Event(), threading.Event()
    monkeypatch.setattr(checksum_stream, "MIN_STREAMED_BYTES", 0)
    monkeypatch.setattr(checksum_stream, "MAX_INLINE_BYTES", 0)
    monkeypatch.setattr(checksum_stream.xxhash, "xxh3_64", StuckHasher)
    yield StuckHasher
    StuckHasher.release.set()


def _copier(layout: KVLayoutName, one_storage: bool) -> BlockCopier:
    planes, width = (1, 24) if layout == "mla" else (2, 16)
    return BlockCopier(_layers(layout, _canonical(planes=planes, width=width), one_storage),
                       layout, CHUNK)


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla"])
@pytest.mark.parametrize("one_storage", [True, False])
@pytest.mark.parametrize("report_bytes", [1, 200, 1 << 20])
def test_progress_covers_each_slot_in_order_and_bytes_match(
        monkeypatch: pytest.MonkeyPatch, layout: KVLayoutName, one_storage: bool,
        report_bytes: int) -> None:
    monkeypatch.setattr(kv_copy, "REPORT_BYTES", report_bytes)
    copier = _copier(layout, one_storage)
    plain, reported = _slots(copier, 3), _slots(copier, 3)
    copier.gather(_ids(1, 3), plain)
    seen: list[tuple[int, int]] = []
    copier.gather(_ids(1, 3), reported, lambda i, n: seen.append((i, n)))
    assert all(torch.equal(a, b) for a, b in zip(plain, reported, strict=True))
    for index in range(3):
        marks = [n for i, n in seen if i == index]
        assert marks == sorted(set(marks)) and marks[-1] == copier.chunk_bytes
    if report_bytes == 1 and one_storage:  # a stacked group is split into several parts
        assert len([n for i, n in seen if i == 0]) > 1


@pytest.mark.parametrize("part_bytes", [64, 1000, 1 << 30])
def test_streamed_digests_equal_whole_piece_checksums(monkeypatch: pytest.MonkeyPatch,
                                                      part_bytes: int) -> None:
    monkeypatch.setattr(checksum_stream, "PART_BYTES", part_bytes)
    monkeypatch.setattr(checksum_stream, "MIN_STREAMED_BYTES", 0)
    monkeypatch.setattr(checksum_stream, "MAX_INLINE_BYTES", 0)
    monkeypatch.setattr(kv_copy, "REPORT_BYTES", 100)
    copier = _copier("flash_attn", True)
    slots = _slots(copier, 4)
    lanes = ChecksumLanes()
    try:
        sums = lanes.begin(slots, copier.chunk_bytes)
        assert sums.streaming and sums.deferred
        copier.gather(_ids(2, 4), slots, sums.written)
        on_digests, got = _receiver()
        sums.finish(on_digests)
        digests = got.result(10)
        assert digests == [checksum(s[: copier.chunk_bytes]) for s in slots]
        assert digests is not None and len(set(digests)) == 4
        assert lanes.pending == 0
    finally:
        lanes.close()


def test_pieces_not_reported_are_hashed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU copy reports nothing (its bytes land at the stream's end); a piece reported only in
    part is hashed whole too."""
    monkeypatch.setattr(checksum_stream, "MIN_STREAMED_BYTES", 0)
    monkeypatch.setattr(checksum_stream, "MAX_INLINE_BYTES", 0)
    monkeypatch.setattr(checksum_stream, "PART_BYTES", 8)
    slots = [torch.randint(0, 256, (100,), dtype=torch.uint8) for _ in range(3)]
    lanes = ChecksumLanes()
    try:
        sums = lanes.begin(slots, 96)
        sums.written(1, 40)  # in part only
        sums.written(2, 96)
        on_digests, got = _receiver()
        sums.finish(on_digests)
        assert got.result(10) == [checksum(s[:96]) for s in slots]
    finally:
        lanes.close()


def test_small_stores_hash_inline_others_on_a_lane_that_is_reused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slots = [torch.randint(0, 256, (64,), dtype=torch.uint8)]
    lanes = ChecksumLanes()
    try:
        small = lanes.begin(slots, 64)
        assert not small.streaming and not small.deferred
        small.written(0, 64)  # ignored
        assert small.digests() == [checksum(slots[0])]
        monkeypatch.setattr(checksum_stream, "MAX_INLINE_BYTES", 0)
        whole = lanes.begin(slots, 64)  # under MIN_STREAMED_BYTES: hashed whole, after
        assert whole.deferred and not whole.streaming
        on_digests, got = _receiver()
        whole.finish(on_digests)
        assert got.result(10) == [checksum(slots[0])]
        second = lanes.begin(slots, 64)
        second.abandon()
        assert len(lanes._all) == 1  # the lane came back and was taken again
    finally:
        lanes.close()


def test_concurrent_stores_get_their_own_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum_stream, "MIN_STREAMED_BYTES", 0)
    monkeypatch.setattr(checksum_stream, "MAX_INLINE_BYTES", 0)
    monkeypatch.setattr(checksum_stream, "PART_BYTES", 1 << 10)
    lanes = ChecksumLanes()
    failures: list[str] = []

    def store(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        slots = [torch.randint(0, 256, (1 << 16,), generator=g, dtype=torch.uint8)
                 for _ in range(3)]
        for _ in range(20):
            sums = lanes.begin(slots, 1 << 16)
            for i in range(3):
                for n in range(1 << 12, (1 << 16) + 1, 1 << 12):
                    sums.written(i, n)
            on_digests, got = _receiver()
            sums.finish(on_digests)
            if got.result(30) != [checksum(s) for s in slots]:
                failures.append(f"seed {seed}")

    held: list[object] = []
    together = threading.Barrier(4)

    def first(seed: int) -> None:  # four stores hold a lane at the same time
        sums = lanes.begin([torch.zeros(64, dtype=torch.uint8)], 64)
        held.append(sums._lane)
        together.wait(10)
        sums.abandon()
        store(seed)

    threads = [threading.Thread(target=first, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    created = len(lanes._all)
    lanes.close()
    assert not failures
    assert len(held) == 4 and len({id(lane) for lane in held}) == 4  # distinct lanes
    assert created == 4  # given back and reused: no more than the stores at once


def test_finish_returns_before_the_digests_and_a_stuck_lane_is_reaped_when_due(
        stuck: type[StuckHasher]) -> None:
    clock = FakeClock()
    slots = [torch.zeros(64, dtype=torch.uint8)]
    lanes = ChecksumLanes(clock)
    try:
        sums = lanes.begin(slots, 64)
        sums.written(0, 64)
        on_digests, got = _receiver()
        sums.finish(on_digests)  # returns with the lane still hashing
        assert stuck.started.wait(10) and not got.done() and lanes.pending == 1
        queued = lanes.begin(slots, 64)  # the same lane, free again: queued behind the stuck part
        assert queued._lane is sums._lanes._all[0]
        on_queued, got_queued = _receiver()
        queued.finish(on_queued)
        assert lanes.reap() == 0  # not due yet
        clock.advance(checksum_stream.LANE_TIMEOUT_S)
        assert lanes.reap() == 2  # given up: both stores queued on the stuck lane
        assert got.result(0) is None and got_queued.result(0) is None
        assert lanes._all == [] and lanes.pending == 0  # retired, never handed out again
        stuck.release.set()  # the stuck part ends: its late digests go nowhere (set once)
    finally:
        lanes.close()


def test_a_failed_store_cancels_its_queued_parts_and_waits_only_for_its_running_one(
        stuck: type[StuckHasher]) -> None:
    slots = [torch.zeros(64, dtype=torch.uint8)]
    lanes = ChecksumLanes()
    try:
        earlier = lanes.begin(slots, 64)
        earlier.written(0, 64)  # another store's part, stuck on the lane
        on_digests, _ = _receiver()
        earlier.finish(on_digests)
        assert stuck.started.wait(10)
        failed = lanes.begin(slots, 64)  # the same lane (given back by finish)
        failed.written(0, 64)
        part = failed._parts[0]
        # It returns while the lane is still stuck in the other store's part: its own part never
        # started, it is cancelled (not waited for behind that part).
        abandoning = threading.Thread(target=failed.abandon)
        abandoning.start()
        abandoning.join(5)
        assert not abandoning.is_alive() and not stuck.release.is_set()
        assert part.cancelled()
    finally:
        stuck.release.set()
        lanes.close()


def test_a_failed_store_on_a_lane_stuck_in_its_own_part_waits_at_most_the_timeout(
        stuck: type[StuckHasher], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum_stream, "LANE_TIMEOUT_S", 0.2)
    slots = [torch.zeros(64, dtype=torch.uint8)]
    lanes = ChecksumLanes()
    try:
        failed = lanes.begin(slots, 64)
        failed.written(0, 64)
        assert stuck.started.wait(10)
        failed.abandon()  # logged, not raised; bounded by LANE_TIMEOUT_S
        assert lanes._all == []  # retired
    finally:
        stuck.release.set()
        lanes.close()


def test_close_drains_the_digests_still_coming_and_gives_up_the_stuck_ones(
        stuck: type[StuckHasher]) -> None:
    slots = [torch.randint(0, 256, (64,), dtype=torch.uint8)]
    lanes = ChecksumLanes()
    free = lanes.begin(slots, 64)  # hashed whole (never ``written``): not stuck
    on_free, got_free = _receiver()
    sticky = lanes.begin(slots, 64)  # a second lane: the first is still held
    sticky.written(0, 64)
    on_sticky, got_sticky = _receiver()
    sticky.finish(on_sticky)
    assert stuck.started.wait(10)
    free.finish(on_free)
    assert not lanes.close(timeout_s=0.2)  # one was given up
    assert got_free.result(0) == [checksum(slots[0])]  # drained: it finished in time
    assert got_sticky.result(0) is None
    assert lanes.pending == 0


def test_after_close_stores_hash_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum_stream, "MIN_STREAMED_BYTES", 0)
    monkeypatch.setattr(checksum_stream, "MAX_INLINE_BYTES", 0)
    slots = [torch.randint(0, 256, (64,), dtype=torch.uint8)]
    lanes = ChecksumLanes()
    lanes.close()
    late = lanes.begin(slots, 64)
    assert not late.streaming and not late.deferred and lanes._all == []  # no lane left over
    late.written(0, 64)
    assert late.digests() == [checksum(slots[0])]
