"""Tiered async lookups cancelled by ``cleanup_memory_objs`` while in flight: nothing they lock
stays locked, and they answer 0 (a reported hit is always locked). A real engine with a disk tier
whose load waits on the test, then a stand-in engine for the orderings a real one cannot pin down
(queued behind busy threads, a newer lookup of the same id)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.engine.async_lookup import PREFETCH_THREADS, AsyncLookups
from lmcache_core.keys import ChunkKey, opaque_layout
from lmcache_core.storage.disk import DiskTier
from lmcache_core.storage.pool import MemoryPool

W1 = opaque_layout(1)
HASHES = [bytes([i]) * 32 for i in range(2)]


class Answers:
    """``on_result``: the answers by lookup id, and an event per id once it came."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.came: dict[str, threading.Event] = {}

    def __call__(self, lookup_id: str, tokens: int) -> None:
        self.tokens[lookup_id] = tokens
        self.event(lookup_id).set()

    def event(self, lookup_id: str) -> threading.Event:
        return self.came.setdefault(lookup_id, threading.Event())


def test_cleanup_of_a_running_tiered_lookup_releases_what_it_locks(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    engine = CacheEngine(MemoryPool.slots(1024, 8, pin=False), chunk_size=16, disk=disk)
    for h in HASHES:  # on disk only
        assert disk.write(ChunkKey("m", W1, 0, 1, h), memoryview(h * 20))
    loading, go = threading.Event(), threading.Event()
    load = disk.load_into

    def slow_load(key: ChunkKey, out: memoryview) -> object:
        loading.set()
        assert go.wait(5)
        return load(key, out)

    disk.load_into = slow_load  # type: ignore[method-assign]
    answers = Answers()
    try:
        assert engine.async_lookup_and_prefetch("req", HASHES, model_name="m",
                                                on_result=answers) is None
        assert loading.wait(5)  # inside the tiered lookup: its re-lookup has not locked yet
        engine.cleanup_memory_objs("req")  # the request was aborted
        go.set()
        assert answers.event("req").wait(5)
        assert answers.tokens["req"] == 0
        assert engine.store.inspect().locks_of("req") == [] and engine.snapshot().engine.locks_held == 0
        assert engine.store.clear() == (2, 0)  # the loaded pieces are not held by anyone
        # A lookup of the same id afterwards is not cancelled: it locks and reports its hits.
        assert engine.async_lookup_and_prefetch("req", HASHES, model_name="m") == 32
        assert len(engine.store.inspect().locks_of("req")) == 2
    finally:
        go.set()
        engine.close()


class FakeEngine:
    """Tiered lookups that wait on a gate per call; locks: lookup id -> chunks locked."""

    def __init__(self) -> None:
        self.locks: dict[str, int] = {}
        self.gates: list[threading.Event] = []
        self.started: list[threading.Event] = []
        self.calls = 0
        self.mutex = threading.Lock()

    def lookup(self, model_name: str, groups: Sequence[GroupTarget],
               chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool = True, *,
               tier_timeout_s: float | None = None) -> int:
        assert tier_timeout_s is not None, "a tiered engine's async lookups have a tier budget"
        with self.mutex:
            gate, started = self.gates[self.calls], self.started[self.calls]
            self.calls += 1
        started.set()
        assert gate.wait(5)
        self.locks[lookup_id] = len(chunk_hashes)  # a re-lookup replaces the id's locks
        return len(chunk_hashes)

    def free_lookup_locks(self, lookup_id: str) -> int:
        return self.locks.pop(lookup_id, 0)

    def expect(self, calls: int) -> None:
        self.gates += [threading.Event() for _ in range(calls)]
        self.started += [threading.Event() for _ in range(calls)]

    def lookups(self) -> AsyncLookups:
        """The async lookups of a tiered engine of chunk size 16 over this one."""
        return AsyncLookups(self.lookup, self.free_lookup_locks, chunk_size=16, tiered=True)


def test_a_lookup_cancelled_while_queued_does_no_io_and_answers_0() -> None:
    engine = FakeEngine()
    engine.expect(PREFETCH_THREADS)
    lookups = engine.lookups()
    answers = Answers()
    try:
        for i in range(PREFETCH_THREADS):  # every prefetch thread busy
            lookups.lookup_and_prefetch(f"busy{i}", HASHES, on_result=answers)
        for started in engine.started:
            assert started.wait(5)
        lookups.lookup_and_prefetch("queued", HASHES, on_result=answers)
        assert lookups.cleanup("queued") == 0
        for gate in engine.gates:
            gate.set()
        assert answers.event("queued").wait(5) and answers.tokens["queued"] == 0
        assert engine.calls == PREFETCH_THREADS and "queued" not in engine.locks
        for i in range(PREFETCH_THREADS):
            assert answers.event(f"busy{i}").wait(5) and answers.tokens[f"busy{i}"] == 32
        assert lookups._tracked == {}  # nothing kept once none is in flight
    finally:
        for gate in engine.gates:
            gate.set()
        lookups.close()


def test_a_newer_lookup_of_the_id_keeps_its_locks() -> None:
    engine = FakeEngine()
    engine.expect(2)
    lookups = engine.lookups()
    answers = Answers()
    try:
        lookups.lookup_and_prefetch("req", HASHES, on_result=answers)
        assert engine.started[0].wait(5)
        lookups.cleanup("req")  # the first attempt is abandoned ...
        newer = Answers()
        lookups.lookup_and_prefetch("req", HASHES, on_result=newer)  # ... and retried
        assert engine.started[1].wait(5)
        engine.gates[1].set()
        assert newer.event("req").wait(5) and newer.tokens["req"] == 32
        engine.gates[0].set()  # the abandoned one ends last: it answers 0
        assert answers.event("req").wait(5) and answers.tokens["req"] == 0
        assert engine.locks == {"req": 2}  # the id's locks stay the retry's to release
        assert lookups._tracked == {}
    finally:
        for gate in engine.gates:
            gate.set()
        lookups.close()
