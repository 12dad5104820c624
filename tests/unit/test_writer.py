"""``BackgroundWriter``: the bounded write-behind queue and thread the disk and remote tiers share."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from lmcache_core.storage.writer import BackgroundWriter
from tests.harness import wait_until


def _writer(write: Callable[[list[int]], None], queue_size: int = 4,
            **kw: Any) -> BackgroundWriter[int]:
    return BackgroundWriter("test tier", "test-writer", queue_size, write, **kw)


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    w = _writer(lambda batch: None, queue_size=3)
    assert w.submit(range(5)) == 2
    assert w.queued == w.pending == 3
    assert not w.flush(0.05)  # never started: nothing is written
    assert w.stop(1.0)  # not started: a no-op


def test_unbounded_like_queue_queue_when_size_is_not_positive() -> None:
    w = _writer(lambda batch: None, queue_size=0)
    assert w.submit(range(10_000)) == 0 and w.queued == 10_000


def test_batches_flush_and_stop() -> None:
    written: list[list[int]] = []
    w = _writer(written.append, queue_size=100, batch=8)
    w.submit(range(20))
    w.start()
    try:
        assert w.flush(5)
        assert sorted(x for batch in written for x in batch) == list(range(20))
        assert all(1 <= len(batch) <= 8 for batch in written)
        assert w.pending == 0
    finally:
        assert w.stop(5)
    assert not any(t.name == "test-writer" for t in threading.enumerate())


def test_stop_writes_what_is_queued_within_the_deadline() -> None:
    written: list[int] = []
    gate = threading.Event()

    def write(batch: list[int]) -> None:
        gate.wait(5)
        written.extend(batch)

    w = _writer(write, queue_size=10)
    w.start()
    w.submit(range(5))
    threading.Timer(0.1, gate.set).start()
    start = time.monotonic()
    assert w.stop(5)
    assert written == list(range(5))
    assert time.monotonic() - start < 2  # woken by the last write, not by the deadline


def test_stop_gives_up_at_its_deadline() -> None:
    release = threading.Event()
    w = _writer(lambda batch: release.wait(10), queue_size=10)
    w.start()
    w.submit(range(3))
    start = time.monotonic()
    assert not w.stop(0.2, grace_s=0.1)  # the write is still stuck
    assert 0.2 <= time.monotonic() - start < 3.0  # 10x the 0.3 s it should take
    release.set()


def test_a_failing_write_does_not_end_the_writer(caplog: pytest.LogCaptureFixture) -> None:
    written: list[int] = []

    def write(batch: list[int]) -> None:
        if 1 in batch:
            raise OSError("boom")
        written.extend(batch)

    w = _writer(write, queue_size=10)
    w.start()
    try:
        w.submit([1])
        w.submit([2])
        assert w.flush(5) and written == [2]
        assert any("writer failed" in r.getMessage() for r in caplog.records)
    finally:
        w.stop(5)


def test_idle_runs_on_idle_ticks_and_after_the_next_item_once_requested() -> None:
    idles: list[float] = []
    w = _writer(lambda batch: None, idle=lambda: idles.append(time.monotonic()), idle_s=0.05)
    w.start()
    try:
        wait_until(lambda: len(idles) >= 2)  # nothing queued: every idle_s
    finally:
        w.stop(5)
    idles.clear()
    w = _writer(lambda batch: None, idle=lambda: idles.append(time.monotonic()), idle_s=60)
    w.start()
    try:
        w.request_idle()
        time.sleep(0.1)  # (kept: waits for a call that must not come; a slow machine can only hide it)
        assert not idles  # does not wake the writer by itself
        w.submit([1])
        wait_until(lambda: len(idles) == 1)  # ...but runs after the next item
        w.submit([2])
        assert w.flush(5) and len(idles) == 1  # once per request
    finally:
        start = time.monotonic()
        w.stop(5)
        assert time.monotonic() - start < 1  # a stop wakes a writer waiting for items


def test_while_down_nothing_is_taken_probes_are_spaced_and_stop_does_not_wait() -> None:
    down = True
    probes: list[float] = []
    written: list[int] = []

    def probe() -> None:
        probes.append(time.monotonic())

    w = _writer(written.extend, queue_size=10, down=lambda: down, probe=probe,
                probe_interval_s=0.05)
    w.submit([1, 2])
    w.start()
    try:
        wait_until(lambda: len(probes) >= 3)
        assert written == [] and w.queued == 2
        assert all(b - a >= 0.04 for a, b in itertools.pairwise(probes))
        down = False
        assert w.flush(5) and written == [1, 2]
        down = True
        w.submit([3])
    finally:
        start = time.monotonic()
        assert w.stop(10)
        assert time.monotonic() - start < 1  # down: no drain wait
    assert written == [1, 2]


def test_on_start_runs_first_and_restart_works() -> None:
    order: list[str] = []
    w = _writer(lambda batch: order.append("write"), on_start=lambda: order.append("start"))
    w.submit([1])
    w.start()
    assert w.flush(5) and order == ["start", "write"]
    assert w.stop(5)
    w.submit([2])
    w.start()
    try:
        assert w.flush(5) and order == ["start", "write", "start", "write"]
    finally:
        w.stop(5)
