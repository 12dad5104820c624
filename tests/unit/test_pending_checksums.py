"""A store's checksums taken after its commit (``finish_store(checksums_pending=True)`` then
``record_checksums``): the pieces are visible at once, held by their hash (never evicted, their
slots never reused under it), and everything that relies on the checksum waits for it: a store short
of room, a tier writer's ``source``, a verified retrieve. A pending piece may still be condemned or
cleared; a checksum given up drops its pieces, never written to a tier without one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import pytest

from lmcache_core.engine import CacheEngine, GroupTarget, StorePlan, verify
from lmcache_core.engine import store as store_module
from lmcache_core.engine.index import Piece
from lmcache_core.engine.lifecycle import State
from lmcache_core.engine.store import PieceView
from lmcache_core.keys import ChunkKey
from lmcache_core.storage import integrity, record
from lmcache_core.storage.disk import DiskTier, file_name
from tests.harness import wait_until
from tests.unit.checksummed import LAYOUT, NBYTES, SLOT, engine_with, key, pattern, store

T = TypeVar("T")


def in_thread(work: Callable[[], T]) -> Future[T]:
    """``work()`` on a thread of its own; its result (or exception) in the future."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as exc:
            done.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return done


def store_pending(engine: CacheEngine, ids: list[int]) -> StorePlan:
    """A big store as the server's handler does it: copy in, commit, checksums still coming."""
    plan = engine.store.begin_store([key(i) for i in ids], NBYTES)
    for position, _, view in plan.writes:
        view.copy_(pattern(ids[position]))
    engine.store.finish_store(plan, checksums_pending=True)
    return plan


def digests_of(plan: StorePlan) -> list[int]:
    return [integrity.checksum(view) for _, _, view in plan.writes]


def readers(engine: CacheEngine, k: ChunkKey) -> int:
    return engine.store.inspect().pieces[k].readers


def hits(engine: CacheEngine, ids: list[int]) -> int:
    return engine.lookup("m", [GroupTarget(LAYOUT, ((0, 8),))], [key(i).chunk_hash for i in ids],
                         "q", lock=False)


def test_a_pending_piece_is_visible_at_once_held_by_its_hash_until_recorded() -> None:
    engine = engine_with()
    plan = store_pending(engine, [1, 2])
    assert hits(engine, [1, 2]) == 2  # visible before its checksum
    def pieces() -> list[PieceView]:
        state = engine.store.inspect().pieces
        return [state[key(i)] for i in (1, 2)]

    assert all(p.checksum == integrity.PENDING and p.readers == 1 for p in pieces())
    assert engine.snapshot().engine.checksums_pending == 2
    engine.store.record_checksums(plan, digests_of(plan))
    assert [p.checksum for p in pieces()] == [integrity.checksum(pattern(i)) for i in (1, 2)]
    assert all(p.readers == 0 for p in pieces())
    assert engine.snapshot().engine.checksums_pending == 0
    engine.store.record_checksums(plan, digests_of(plan))  # twice: nothing more
    assert all(p.readers == 0 for p in pieces())


def test_eviction_skips_a_pending_piece() -> None:
    engine = engine_with(slots=2)
    pending = store_pending(engine, [1])  # the least recently used: eviction's first pick
    store(engine, [2])
    plan = engine.store.begin_store([key(3)], NBYTES)
    assert plan.stored == 1  # room from piece 2, not from the held piece 1
    engine.store.finish_store(plan)
    assert hits(engine, [1]) == 1 and hits(engine, [2]) == 0
    engine.store.record_checksums(pending, digests_of(pending))


def test_a_store_short_of_room_waits_for_pending_checksums_then_evicts() -> None:
    engine = engine_with(slots=2)
    pending = store_pending(engine, [1])
    store(engine, [2])
    assert engine.lookup("m", [GroupTarget(LAYOUT, ((0, 8),))], [key(2).chunk_hash], "lock") == 1
    waiting = in_thread(lambda: engine.store.begin_store([key(3)], NBYTES))
    # Its claim shows while it waits (the store's lock released): nothing else may go.
    wait_until(lambda: key(3) in engine.store.inspect().writing, what="the store never waited")
    assert not waiting.done()
    engine.store.record_checksums(pending, digests_of(pending))
    plan = waiting.result(10)
    assert plan.stored == 1 and plan.skipped_full == 0  # piece 1 went, once hashed
    engine.store.finish_store(plan)
    assert hits(engine, [1]) == 0 and hits(engine, [3]) == 1


def test_a_store_waits_for_pending_checksums_at_most_the_lane_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "LANE_TIMEOUT_S", 0.05)
    engine = engine_with(slots=1)
    pending = store_pending(engine, [1])  # never recorded here (a stuck hash)
    plan = engine.store.begin_store([key(2)], NBYTES)
    assert plan.stored == 0 and plan.skipped_full == 1
    engine.store.finish_store(plan)
    engine.store.record_checksums(pending, None)


def waits_recorded(engine: CacheEngine, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once anyone waits for pending checksums (``PieceStore.wait_checksums``), before the
    wait: while the test holds the checksums back, whoever set it is still waiting."""
    waiting = threading.Event()
    real_wait = engine.store.wait_checksums

    def wait_checksums(pieces: Sequence[Piece], timeout_s: float) -> bool:
        waiting.set()
        return real_wait(pieces, timeout_s)

    monkeypatch.setattr(engine.store, "wait_checksums", wait_checksums)
    return waiting


def test_the_disk_writer_waits_for_a_pending_checksum_and_writes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk's writer thread takes a write-through piece whose checksum is pending and waits
    for it: the test holds the checksum (records it only once the writer waits), so a writer that
    went on without it is seen every run. Then it writes the store's own checksum."""
    disk = DiskTier(tmp_path, 2**20, write_through=True)
    engine = engine_with(disk)
    waiting = waits_recorded(engine, monkeypatch)
    assert engine.tiers is not None
    engine.tiers.start()
    try:
        plan = store_pending(engine, [1])  # queued for the writer as it commits
        wait_until(lambda: waiting.is_set() or disk.flush(0), what="the writer never took the piece")
        assert waiting.is_set(), "the writer went on without waiting for the piece's checksum"
        assert not disk.contains(key(1)) and not disk.flush(0)  # it waits, nothing written
        assert readers(engine, key(1)) == 2  # its hash's and the writer's
        engine.store.record_checksums(plan, digests_of(plan))
        assert disk.flush(10)
    finally:
        disk.stop()
    header = record.parse_header((tmp_path / file_name(key(1))).read_bytes())
    assert header.payload_xxh3 == integrity.checksum(pattern(1))  # the store's own checksum
    assert engine.snapshot().engine.integrity_verified_chunks == 1


def test_a_tier_writer_never_writes_a_piece_whose_checksum_is_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checksum held past the writer's bound: the writer gives the piece up and writes nothing
    (no record without the store's checksum, none of its own making); the piece stays, and once
    its checksum is recorded it is written with it."""
    monkeypatch.setattr(verify, "LANE_TIMEOUT_S", 0.05)
    disk = DiskTier(tmp_path, 2**20, write_through=True)
    engine = engine_with(disk)
    assert engine.tiers is not None
    engine.tiers.start()
    try:
        plan = store_pending(engine, [1])
        assert disk.flush(10)  # taken, waited for at most its bound, given up
        assert not disk.contains(key(1)) and disk.stats().written_chunks == 0
        assert hits(engine, [1]) == 1 and engine.snapshot().engine.checksums_pending == 1
        engine.store.record_checksums(plan, digests_of(plan))
        disk.submit([key(1)])
        assert disk.flush(10) and disk.contains(key(1))
    finally:
        disk.stop()
    header = record.parse_header((tmp_path / file_name(key(1))).read_bytes())
    assert header.payload_xxh3 == integrity.checksum(pattern(1))


def test_a_checksum_given_up_drops_its_pieces_and_writes_nothing(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 2**20)
    engine = engine_with(disk)
    plan = store_pending(engine, [1, 2])
    assert engine.tiers is not None
    guard = engine.tiers.guard

    def write() -> bool:
        with guard.source(key(1)) as found:
            return found is not None

    writing = in_thread(write)
    wait_until(lambda: readers(engine, key(1)) == 2, what="the writer never took the piece")
    engine.store.record_checksums(plan, None)  # the hash was stuck, or the server stopped
    assert writing.result(10) is False  # no record without a checksum
    assert not disk.contains(key(1)) and hits(engine, [1]) == 0 and len(engine.store) == 0
    s = engine.snapshot()
    assert s.engine.checksums_abandoned == 2 and s.engine.integrity_failures == 0
    assert s.engine.checksums_pending == 0
    wait_until(lambda: engine.pool.bytes_allocated == 0, what="the slots were never freed")


def test_verify_retrieve_waits_for_pending_checksums(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_with()
    plan = store_pending(engine, [1, 2])
    retrieve = engine.store.begin_retrieve("m", LAYOUT, (0, 8), [key(i).chunk_hash for i in (1, 2)])
    waits = waits_recorded(engine, monkeypatch)
    verifying = in_thread(lambda: engine.integrity.verify_retrieve(retrieve, 10.0))
    assert waits.wait(10)
    engine.store.record_checksums(plan, digests_of(plan))
    assert verifying.result(10) == []  # both checked, intact
    engine.store.finish_retrieve(retrieve)
    s = engine.snapshot()
    assert s.engine.integrity_verified_chunks == 2 and s.engine.retrieved_chunks == 2


def test_verify_retrieve_answers_missing_what_is_not_hashed_in_time() -> None:
    engine = engine_with()
    store(engine, [1])
    plan = store_pending(engine, [2])
    retrieve = engine.store.begin_retrieve("m", LAYOUT, (0, 8), [key(i).chunk_hash for i in (1, 2)])
    assert engine.integrity.verify_retrieve(retrieve, 0.01) == [1]
    assert retrieve.missing == [1]
    engine.store.finish_retrieve(retrieve)
    s = engine.snapshot().engine  # not corrupt: unchecked, kept
    assert s.integrity_verified_chunks == 1 and s.integrity_failures == 0
    assert hits(engine, [2]) == 1
    engine.store.record_checksums(plan, digests_of(plan))


def test_a_pending_piece_condemned_or_cleared_is_freed_once_its_hash_is_done() -> None:
    engine = engine_with()
    condemned = store_pending(engine, [1])
    cleared = store_pending(engine, [2])
    with engine.store.reading(key(1)) as held:  # the live piece
        assert held is not None
        piece = held[0]
    assert engine.integrity.condemn([piece]) == 1
    assert hits(engine, [1]) == 0 and piece.state is State.DROPPED
    assert engine.store.clear() == (1, 0)  # piece 2: held by its hash only, it goes
    assert len(engine.store) == 0 and engine.pool.bytes_allocated == 2 * SLOT  # hashes still read
    engine.store.record_checksums(condemned, digests_of(condemned))
    assert piece.state is State.FREED and engine.pool.bytes_allocated == SLOT
    engine.store.record_checksums(cleared, digests_of(cleared))
    assert engine.pool.bytes_allocated == 0 and engine.snapshot().engine.checksums_pending == 0
