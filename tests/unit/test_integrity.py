"""Chunk checksums: taken at store, kept on the piece, carried in tier records, checked before a
tier write, after a tier read and (``verify_on_retrieve``) before a retrieve's copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.engine.index import Piece
from lmcache_core.keys import ChunkKey
from lmcache_core.storage import integrity, record
from lmcache_core.storage.disk import DiskTier, file_name
from tests.unit.checksummed import LAYOUT, NBYTES, SLOT, begin, engine_with, key, pattern, store


def corrupt(engine: CacheEngine, i: int, at: int = 10) -> None:
    with engine.store.reading(key(i)) as held:
        assert held is not None
        view = held[1]
        view[at] = view[at] ^ 0x01


def piece_of(engine: CacheEngine, k: ChunkKey) -> Piece | None:
    """The live piece of ``k`` (held for a moment, as a tier writer holds it), or None."""
    with engine.store.reading(k) as held:
        return held[0] if held is not None else None


def lookup(engine: CacheEngine, ids: list[int]) -> int:
    return engine.lookup("m", [GroupTarget(LAYOUT, ((0, 8),))], [key(i).chunk_hash for i in ids],
                         "q", lock=False, tier_timeout_s=1.0)


# ---------------------------------------------------------------- the checksum itself


def test_checksum_is_xxh3_of_the_bytes_whatever_holds_them(monkeypatch: pytest.MonkeyPatch) -> None:
    t = pattern(1)
    value = integrity.checksum(t)
    assert value == integrity.checksum(t.numpy().data) == integrity.checksum(bytes(t.numpy()))
    assert value != 0 and integrity.matches(t, value) and integrity.matches(t, 0)
    t[3] ^= 1
    assert not integrity.matches(t, value)
    monkeypatch.setattr(integrity, "_xxh3_64", lambda _buffer: 0)
    assert integrity.checksum(b"x") == 1  # 0 means "none": never a checksum


# ---------------------------------------------------------------- store and commit


def test_store_records_each_pieces_checksum() -> None:
    engine = engine_with()
    store(engine, [1, 2])
    pieces = engine.store.inspect().pieces
    for i in (1, 2):
        assert pieces[key(i)].checksum == integrity.checksum(pattern(i))


def test_a_failed_store_leaves_nothing_visible() -> None:
    engine = engine_with()
    plan = engine.store.begin_store([key(1), key(2)], NBYTES)
    plan.writes[0][2].copy_(pattern(1))  # the first chunk's copy went in, the second's failed
    engine.store.finish_store(plan, ok=False)
    assert lookup(engine, [1]) == 0 and len(engine.store) == 0 and engine.pool.bytes_allocated == 0
    store(engine, [1, 2])
    assert lookup(engine, [1, 2]) == 2


# ---------------------------------------------------------------- records


def test_a_record_with_a_wrong_payload_xxh3_is_refused() -> None:
    k, data = key(1), pattern(1).numpy().data
    good = record.encode(k, data)
    out = memoryview(bytearray(SLOT))
    assert record.decode_checked_into(good, k, out) == (NBYTES, integrity.checksum(data))
    # A header that is self-consistent (its own checksum matches) but carries another payload's
    # checksum: the payload is refused.
    lying = record.encode(k, data, payload_xxh3=integrity.checksum(pattern(2)))
    with pytest.raises(record.RecordError, match="payload_xxh3"):
        record.decode_into(lying, k, memoryview(bytearray(SLOT)))
    # The header field itself changed (its checksum then no longer matches).
    tampered = bytearray(good)
    tampered[32] ^= 0x01  # payload_xxh3 is at bytes 32..40
    with pytest.raises(record.RecordError, match="header checksum"):
        record.decode_into(bytes(tampered), k, memoryview(bytearray(SLOT)))
    # No checksum at all is no record of this format.
    zero = bytearray(good)
    zero[32:40] = bytes(8)
    with pytest.raises(record.RecordError, match="inconsistent"):
        record.decode_into(bytes(zero), k, memoryview(bytearray(SLOT)))


# ---------------------------------------------------------------- tiers


def test_a_piece_corrupted_in_memory_is_never_written_to_disk(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 2**20, write_through=True)
    engine = engine_with(disk)
    assert engine.tiers is not None
    engine.tiers.start()
    try:
        plan = begin(engine, [1, 2])
        view = plan.writes[1][2]
        view[10] ^= 0x01  # the bytes change after their checksum was taken (memory corruption)
        engine.store.finish_store(plan)  # queued for the writer
        assert disk.flush(10)
    finally:
        disk.stop()
    s = engine.snapshot()
    assert s.engine.integrity_failures == 1 and s.engine.integrity_verified_chunks == 1
    assert disk.contains(key(1)) and not engine.store.inspect().resident(key(2))
    assert lookup(engine, [1, 2]) == 1


def test_a_piece_corrupted_in_memory_is_dropped_by_the_writer(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 2**20)
    engine = engine_with(disk)
    store(engine, [1, 2])
    corrupt(engine, 2)
    assert engine.tiers is not None
    for i in (1, 2):
        with engine.tiers.guard.source(key(i)) as found:  # (bytes, their verified checksum)
            if found is not None:
                assert disk.write(key(i), *found)
    assert disk.contains(key(1)) and not disk.contains(key(2))
    s = engine.snapshot()
    assert s.engine.integrity_failures == 1 and s.engine.integrity_verified_chunks == 1
    assert len(engine.store) == 1 and engine.pool.bytes_allocated == SLOT  # its slot is free again


def test_a_writer_checks_the_piece_it_reads_not_a_newer_one_of_its_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The piece a tier writer holds may leave the index (dropped) and its key be stored again
    before the check: its bytes are checked against its own checksum, and the newer piece (of
    other bytes, another checksum) is neither condemned nor written under the old bytes."""
    engine = engine_with(DiskTier(tmp_path, 2**20))
    store(engine, [1])
    old = piece_of(engine, key(1))
    assert old is not None
    memory = engine.store.memory

    def restored_meanwhile(handle: int, nbytes: int) -> memoryview:
        with engine.store._mutex:  # a drop as eviction's: being read, its slot stays
            engine.store._drop(old)
        plan = engine.store.begin_store([key(1)], NBYTES)
        plan.writes[0][2].copy_(pattern(9))
        plan.checksums = [integrity.checksum(plan.writes[0][2])]
        engine.store.finish_store(plan)
        return memory(handle, nbytes)

    monkeypatch.setattr(engine.store, "memory", restored_meanwhile)
    assert engine.tiers is not None
    with engine.tiers.guard.source(key(1)) as found:
        assert found is not None and found[1] == old.checksum
        assert integrity.checksum(found[0]) == old.checksum
    newer = engine.store.inspect().pieces[key(1)]  # stored while the old one was held
    assert newer.handle != old.handle and newer.checksum != old.checksum
    s = engine.snapshot()
    assert s.engine.integrity_failures == 0 and s.engine.integrity_verified_chunks == 1


def test_a_tier_load_keeps_the_records_checksum_and_refuses_a_corrupt_payload(
        tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 2**20)
    for i in (1, 2, 3):
        assert disk.write(key(i), pattern(i).numpy().data)
    path = tmp_path / file_name(key(2))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one payload byte; the header is intact
    path.write_bytes(bytes(data))
    engine = engine_with(disk)
    assert lookup(engine, [1, 2, 3]) == 1  # chunk 2 fails its check: the prefix stops there
    pieces = engine.store.inspect().pieces
    assert pieces[key(1)].checksum == integrity.checksum(pattern(1))
    s = engine.snapshot()
    assert s.disk.corrupt == 1 and not path.exists() and key(2) not in pieces


# ---------------------------------------------------------------- retrieve


def test_verify_retrieve_moves_a_corrupt_chunk_to_missing_and_drops_it() -> None:
    engine = engine_with()
    store(engine, [1, 2, 3])
    corrupt(engine, 2)
    hashes = [key(i).chunk_hash for i in (1, 2, 3)]
    assert engine.lookup("m", [GroupTarget(LAYOUT, ((0, 8),))], hashes, "r") == 3
    plan = engine.store.begin_retrieve("m", LAYOUT, (0, 8), hashes, "r")
    assert engine.integrity.verify_retrieve(plan) == [1]
    assert [at for at, _ in plan.found] == [0, 2] and plan.missing == [1]
    for at, sources in plan.found:
        assert torch.equal(sources[0][0], pattern(at + 1))
    engine.store.finish_retrieve(plan)
    s = engine.snapshot()
    assert s.engine.integrity_failures == 1 and s.engine.integrity_verified_chunks == 2
    assert (s.engine.retrieved_chunks, s.engine.retrieve_missing, s.engine.locks_held) == (2, 1, 0)
    pieces = engine.store.inspect().pieces
    assert key(2) not in pieces and engine.pool.bytes_allocated == 2 * SLOT
    assert all(p.readers == 0 for p in pieces.values())


def test_a_corrupt_piece_another_retrieve_reads_is_freed_once_it_is_done() -> None:
    engine = engine_with()
    store(engine, [1])
    corrupt(engine, 1)
    hashes = [key(1).chunk_hash]
    first = engine.store.begin_retrieve("m", LAYOUT, (0, 8), hashes)
    second = engine.store.begin_retrieve("m", LAYOUT, (0, 8), hashes)  # reads it too, unverified
    assert engine.integrity.verify_retrieve(first) == [1 - 1]
    engine.store.finish_retrieve(first)
    assert len(engine.store) == 0 and engine.pool.bytes_allocated == SLOT  # still read: not freed
    engine.store.finish_retrieve(second)
    assert engine.pool.bytes_allocated == 0  # freed by its last reader's release
    store(engine, [2])
    check = engine.store.begin_retrieve("m", LAYOUT, (0, 8), [key(2).chunk_hash])
    assert engine.integrity.verify_retrieve(check) == []
    engine.store.finish_retrieve(check)
    assert engine.pool.bytes_allocated == SLOT  # only chunk 2's
