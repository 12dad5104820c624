"""Disk tier: records and checksums, corruption and truncation, re-index, size cap, engine paths."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lmcache_core.engine import CacheEngine
from lmcache_core.errors import ConfigError
from lmcache_core.keys import ChunkKey
from lmcache_core.storage import record
from lmcache_core.storage.disk import SUFFIX, TMP_PREFIX, DiskTier, file_name
from lmcache_core.storage.pool import MemoryPool

SLOT = 1024
NBYTES = 1000


def key(i: int, rank: int = 0, world: int = 1, model: str = "m") -> ChunkKey:
    return ChunkKey(model, world, rank, bytes([i, 0xAB]) * 16)


def payload(i: int, nbytes: int = NBYTES) -> memoryview:
    return memoryview(bytes((i * 7 + j) % 251 for j in range(nbytes)))


def files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.endswith(SUFFIX))


def engine_with(disk: DiskTier | None, slots: int = 8) -> CacheEngine:
    return CacheEngine(MemoryPool.slots(SLOT, slots, pin=False), chunk_size=16, disk=disk)


def store(engine: CacheEngine, keys: list[ChunkKey]) -> None:
    plan = engine.begin_store(keys, NBYTES)
    for _, k, view in plan.writes:
        view.copy_(_tensor(payload(k.chunk_hash[0])))
    engine.finish_store(plan)


def _tensor(data: memoryview) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def retrieved(engine: CacheEngine, keys: list[ChunkKey], lookup_id: str = "") -> list[bytes | None]:
    plan = engine.begin_retrieve(keys, lookup_id)
    out: list[bytes | None] = [None] * len(keys)
    for index, _, view in plan.found:
        out[index] = bytes(view.numpy())
    engine.finish_retrieve(plan)
    return out


# ---------------------------------------------------------------- records


def test_record_round_trip_and_checksum() -> None:
    k = key(1)
    data = record.encode(k, payload(1))
    assert len(data) == record.header_bytes(k) + NBYTES
    out = memoryview(bytearray(SLOT))
    assert record.decode_into(data, k, out) == NBYTES
    assert bytes(out[:NBYTES]) == bytes(payload(1))
    for position in (3, 20, record.header_bytes(k) - 1, record.header_bytes(k) + 500, len(data) - 1):
        bad = bytearray(data)
        bad[position] ^= 0x01
        with pytest.raises(record.RecordError):
            record.decode_into(bytes(bad), k, memoryview(bytearray(SLOT)))
    with pytest.raises(record.RecordError, match="not"):
        record.decode_into(data, key(2), out)  # another key's record is never served
    with pytest.raises(record.RecordError):
        record.decode_into(data[:-1], k, out)  # truncated
    with pytest.raises(record.RecordError, match="fit"):
        record.decode_into(data, k, memoryview(bytearray(10)))


# ---------------------------------------------------------------- files


def test_write_read_and_file_layout(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    k = key(3, rank=1, world=2, model="org/model:v1")
    assert disk.write(k, payload(3))
    assert disk.contains(k) and disk.nbytes_of(k) == NBYTES and len(disk) == 1
    (path,) = files(tmp_path)
    assert path.name == file_name(k) and path.name.startswith(k.chunk_hash.hex())
    assert path.stat().st_size == record.header_bytes(k) + NBYTES == disk.bytes_used
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]
    out = memoryview(bytearray(SLOT))
    assert disk.read_into(k, out) == NBYTES and bytes(out[:NBYTES]) == bytes(payload(3))
    assert disk.read_into(key(4), out) == 0  # a miss
    assert disk.stats()["disk_loaded_chunks"] == 1 and disk.stats()["disk_written_chunks"] == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_damaged_file_is_dropped_never_served(tmp_path: Path, damage: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    k = key(5)
    disk.write(k, payload(5))
    (path,) = files(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[:-10]
    else:
        data += b"x"
    path.write_bytes(bytes(data))
    out = memoryview(bytearray(SLOT))
    assert disk.read_into(k, out) == 0
    assert not path.exists() and not disk.contains(k) and disk.bytes_used == 0
    assert disk.stats()["disk_corrupt"] == 1
    assert "dropped" in caplog.text


def test_damaged_file_is_a_miss_for_the_engine(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, write_through=True)
    engine = engine_with(disk)
    keys = [key(i) for i in range(4)]
    store(engine, keys)
    for k in keys:
        disk.write(k, payload(k.chunk_hash[0]))
    engine.clear(force=True)
    bad = tmp_path / file_name(keys[2])
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0x55
    bad.write_bytes(bytes(data))
    hashes = [k.chunk_hash for k in keys]
    assert engine.lookup_tiers("m", 1, hashes, "r", timeout_s=2) == 2  # stops before the bad one
    assert retrieved(engine, keys[:2], "r") == [bytes(payload(0)), bytes(payload(1))]
    assert not engine.is_resident(keys[2]) and not bad.exists()
    stats = engine.stats()
    assert stats["disk_corrupt"] == 1 and stats["slots_used"] == 2 + 1  # chunk 3 loaded, unlocked
    assert stats["lookup_hit_chunks"] == 2 and stats["lookup_miss_chunks"] == 2


def test_reindex_after_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    for i in range(5):
        disk.write(key(i, model="llama"), payload(i))
        os.utime(tmp_path / file_name(key(i, model="llama")), (1000 + i, 1000 + i))
    (tmp_path / f"{TMP_PREFIX}dead{SUFFIX}").write_bytes(b"half a write")
    (tmp_path / "notes.txt").write_text("not ours")
    truncated = tmp_path / file_name(key(3, model="llama"))
    truncated.write_bytes(truncated.read_bytes()[:-1])
    misnamed = tmp_path / file_name(key(4, model="llama"))
    misnamed.rename(tmp_path / file_name(key(9)))
    garbage = tmp_path / f"garbage{SUFFIX}"
    garbage.write_bytes(b"\x00" * 100)

    again = DiskTier(tmp_path, 1 << 20)
    assert sorted(k.chunk_hash[0] for k in again.lru_keys()) == [0, 1, 2]
    assert again.lru_keys() == [key(i, model="llama") for i in range(3)]  # LRU order from mtimes
    assert again.stats()["disk_corrupt"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [file_name(key(i, model="llama")) for i in range(3)] + ["notes.txt"])
    out = memoryview(bytearray(SLOT))
    assert again.read_into(key(1, model="llama"), out) == NBYTES
    assert bytes(out[:NBYTES]) == bytes(payload(1))
    assert "truncated" in caplog.text


def test_size_cap_deletes_least_recently_used(tmp_path: Path) -> None:
    one = record.header_bytes(key(0)) + NBYTES
    disk = DiskTier(tmp_path, 3 * one + 10)
    for i in range(3):
        assert disk.write(key(i), payload(i))
    assert disk.read_into(key(0), memoryview(bytearray(SLOT))) == NBYTES  # 0 is now the newest
    assert disk.write(key(3), payload(3))
    assert [k.chunk_hash[0] for k in disk.lru_keys()] == [2, 0, 3]
    assert not (tmp_path / file_name(key(1))).exists()
    assert disk.bytes_used == 3 * one <= disk.max_bytes
    assert disk.stats()["disk_deleted"] == 1 and len(files(tmp_path)) == 3
    assert not disk.write(key(9), payload(9, nbytes=4 * one))  # larger than the whole cap
    for age, i in enumerate((2, 0, 3)):  # file times are coarse: make the order explicit
        os.utime(tmp_path / file_name(key(i)), (2000 + age, 2000 + age))
    assert DiskTier(tmp_path, one + 1).lru_keys() == [key(3)]  # a smaller cap at re-index trims


def test_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_size"):
        DiskTier(tmp_path, 0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"disk\.path"):
        DiskTier(tmp_path / "file" / "sub", 100)


# ---------------------------------------------------------------- with the engine


def test_write_through_and_lookup_after_restart(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, write_through=True)
    engine = engine_with(disk)
    disk.start()
    try:
        keys = [key(i, rank) for i in range(3) for rank in (0,)]
        store(engine, keys)
        assert disk.flush(5)
    finally:
        disk.stop()
    assert len(files(tmp_path)) == 3

    fresh = engine_with(DiskTier(tmp_path, 1 << 20))  # a new server on the same directory
    hashes = [k.chunk_hash for k in keys] + [key(7).chunk_hash]
    assert fresh.lookup("m", 1, hashes, "q") == 0
    assert fresh.lookup_tiers("m", 1, hashes, "q", timeout_s=2) == 3
    assert fresh.locks_of("q") and set(fresh.locks_of("q")) == set(keys)
    assert retrieved(fresh, keys, "q") == [bytes(payload(i)) for i in range(3)]
    assert fresh.locks_of("q") == []
    stats = fresh.stats()
    assert stats["disk_loaded_chunks"] == 3 and stats["lookups"] == 2
    assert stats["lookup_hit_chunks"] == 3 and stats["lookup_miss_chunks"] == 4 + 1


def test_prefix_needs_every_rank(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    engine = engine_with(disk, slots=16)
    for i in range(4):
        for rank in range(2):
            if (i, rank) != (2, 1):
                disk.write(key(i, rank, world=2), payload(i))
    store(engine, [key(0, 0, world=2), key(0, 1, world=2), key(1, 1, world=2)])
    hashes = [key(i).chunk_hash for i in range(4)]
    assert engine.lookup_tiers("m", 2, hashes, "tp", timeout_s=2) == 2
    assert len(engine.locks_of("tp")) == 4
    assert not engine.is_resident(key(2, 0, world=2))  # beyond the prefix: not loaded
    assert engine.stats()["disk_loaded_chunks"] == 1  # only (chunk 1, rank 0) was read


def test_eviction_spills_to_disk_ahead(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)  # write_through off: only chunks near eviction are saved
    engine = engine_with(disk, slots=8)
    disk.start()
    try:
        for i in range(7):  # separate stores: key(0) is the least recently used
            store(engine, [key(i)])
        # 1 slot free: the coldest 8 // 4 - 1 chunk is saved
        _wait(lambda: disk.contains(key(0)))
        assert not any(disk.contains(key(i)) for i in range(1, 7))  # warmer chunks are not
        for i in range(7, 12):
            store(engine, [key(i)])
            _wait(lambda: not engine._spill_candidates(8))
        assert engine.stats()["evictions"] == 4
        assert engine.stats()["disk_evicted_unsaved"] == 0
        evicted = [key(i) for i in range(4)]
        assert all(disk.contains(k) and not engine.is_resident(k) for k in evicted)
        hashes = [k.chunk_hash for k in evicted]
        assert engine.lookup_tiers("m", 1, hashes, "back", timeout_s=2) == 4
        assert retrieved(engine, evicted, "back") == [bytes(payload(i)) for i in range(4)]
    finally:
        disk.stop()


def test_unsaved_evictions_and_dropped_writes_are_counted(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, write_through=True, queue_size=2)  # writer never started
    engine = engine_with(disk, slots=4)
    store(engine, [key(i) for i in range(4)])
    store(engine, [key(i) for i in range(4, 6)])
    stats = engine.stats()
    assert stats["disk_write_dropped"] == 4 and stats["disk_evicted_unsaved"] == 2
    assert stats["disk_chunks"] == 0


def test_no_tier_means_no_tier_work(tmp_path: Path) -> None:
    engine = engine_with(None)
    assert not engine.has_tiers
    store(engine, [key(0)])
    assert engine.lookup_tiers("m", 1, [key(0).chunk_hash, key(1).chunk_hash], "x") == 1
    assert "disk_chunks" not in engine.stats()


def _wait(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
