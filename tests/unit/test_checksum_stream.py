"""Checksums streamed during a gather (storage.checksum_stream + BlockCopier.gather's progress):
the same digests as hashing each whole piece afterwards, whatever the parts."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lmcache_core.kv import copy as kv_copy
from lmcache_core.kv.copy import BlockCopier
from lmcache_core.protocol.messages import KVLayoutName
from lmcache_core.storage import checksum_stream
from lmcache_core.storage.checksum_stream import ChecksumLanes
from lmcache_core.storage.integrity import checksum
from tests.unit.test_kv_copy import CHUNK, _canonical, _ids, _layers, _slots


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
    monkeypatch.setattr(kv_copy, "REPORT_BYTES", 100)
    copier = _copier("flash_attn", True)
    slots = _slots(copier, 4)
    lanes = ChecksumLanes()
    try:
        sums = lanes.begin(slots, copier.chunk_bytes)
        assert sums.streaming
        copier.gather(_ids(2, 4), slots, sums.written)
        digests = sums.digests()
        assert digests == [checksum(s[: copier.chunk_bytes]) for s in slots]
        assert len(set(digests)) == 4
    finally:
        lanes.close()


def test_pieces_not_reported_are_hashed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU copy reports nothing (its bytes land at the stream's end); a piece reported only in
    part is hashed whole too."""
    monkeypatch.setattr(checksum_stream, "MIN_STREAMED_BYTES", 0)
    monkeypatch.setattr(checksum_stream, "PART_BYTES", 8)
    slots = [torch.randint(0, 256, (100,), dtype=torch.uint8) for _ in range(3)]
    lanes = ChecksumLanes()
    try:
        sums = lanes.begin(slots, 96)
        sums.written(1, 40)  # in part only
        sums.written(2, 96)
        assert sums.digests() == [checksum(s[:96]) for s in slots]
    finally:
        lanes.close()


def test_small_stores_hash_inline_and_lanes_are_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    slots = [torch.randint(0, 256, (64,), dtype=torch.uint8)]
    lanes = ChecksumLanes()
    try:
        small = lanes.begin(slots, 64)
        assert not small.streaming
        small.written(0, 64)  # ignored
        assert small.digests() == [checksum(slots[0])]
        monkeypatch.setattr(checksum_stream, "MIN_STREAMED_BYTES", 0)
        first = lanes.begin(slots, 64)
        first.written(0, 64)
        first.digests()
        second = lanes.begin(slots, 64)
        second.abandon()
        assert len(lanes._all) == 1  # the lane came back and was taken again
    finally:
        lanes.close()


def test_concurrent_stores_get_their_own_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum_stream, "MIN_STREAMED_BYTES", 0)
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
            if sums.digests() != [checksum(s) for s in slots]:
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


def test_a_stuck_lane_fails_the_store_within_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_core.errors import LMCacheTimeoutError

    monkeypatch.setattr(checksum_stream, "MIN_STREAMED_BYTES", 0)
    monkeypatch.setattr(checksum_stream, "LANE_TIMEOUT_S", 0.2)
    release = threading.Event()

    class StuckHasher:
        def update(self, _part: object) -> None:
            release.wait(10)

    monkeypatch.setattr(checksum_stream.xxhash, "xxh3_64", StuckHasher)
    slots = [torch.zeros(64, dtype=torch.uint8)]
    lanes = ChecksumLanes()
    try:
        sums = lanes.begin(slots, 64)
        sums.written(0, 64)
        started = time.monotonic()
        with pytest.raises(LMCacheTimeoutError):
            sums.digests()
        assert time.monotonic() - started < 5
        assert lanes._all == []  # retired, never handed out again
        failed = lanes.begin(slots, 64)
        failed.written(0, 64)  # a new lane, stuck too
        failed.abandon()  # logged, not raised
        assert lanes._all == []
    finally:
        release.set()
        lanes.close()


def test_after_close_stores_hash_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum_stream, "MIN_STREAMED_BYTES", 0)
    slots = [torch.randint(0, 256, (64,), dtype=torch.uint8)]
    lanes = ChecksumLanes()
    lanes.close()
    late = lanes.begin(slots, 64)
    assert not late.streaming and lanes._all == []  # no lane that nothing would shut down
    late.written(0, 64)
    assert late.digests() == [checksum(slots[0])]
