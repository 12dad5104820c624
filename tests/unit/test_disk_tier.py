"""Disk tier: records and checksums, corruption and truncation, re-index, size cap, pieces of a
chunk, old-format files, engine paths."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from blake3 import blake3

from lmcache_core.engine import GroupTarget
from lmcache_core.errors import ConfigError
from lmcache_core.keys import ChunkKey, layout_key, opaque_layout, rank_heads, world_heads
from lmcache_core.storage import disk as disk_module
from lmcache_core.storage import integrity, record
from lmcache_core.storage.disk import SUFFIX, TMP_PREFIX, DiskTier, file_name
from tests.harness import wait_until

if TYPE_CHECKING:
    from lmcache_core.engine import CacheEngine

SLOT = 1024
NBYTES = 1000
LAYOUT = layout_key("bfloat16", 2, 8, 64, False)  # 8 KV heads


def key(i: int, rank: int = 0, world: int = 1, model: str = "m") -> ChunkKey:
    """Chunk ``i``'s piece that rank ``rank`` of ``world`` holds, under the opaque layout an
    in-process engine without a KV shape uses (its heads are the ranks)."""
    layout = opaque_layout(world)
    return ChunkKey(model, layout, *rank_heads(layout, world, rank), bytes([i, 0xAB]) * 16)


def piece(i: int, lo: int, hi: int, model: str = "m", layout: str = LAYOUT) -> ChunkKey:
    """Heads ``[lo, hi)`` of chunk ``i`` under a real layout fingerprint."""
    return ChunkKey(model, layout, lo, hi, bytes([i, 0xAB]) * 16)


def payload(i: int, nbytes: int = NBYTES) -> memoryview:
    return memoryview(bytes((i * 7 + j) % 251 for j in range(nbytes)))


def files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.endswith(SUFFIX))


def engine_with(disk: DiskTier | None, slots: int = 8) -> CacheEngine:
    from lmcache_core.engine import CacheEngine  # here: the tier-only tests need no engine
    from lmcache_core.storage.pool import MemoryPool

    return CacheEngine(MemoryPool.slots(SLOT, slots, pin=False), chunk_size=16, disk=disk)


def store(engine: CacheEngine, keys: list[ChunkKey]) -> None:
    plan = engine.store.begin_store(keys, NBYTES)
    for _, k, view in plan.writes:
        view.copy_(_tensor(payload(k.chunk_hash[0])))
    engine.store.finish_store(plan)


def _tensor(data: memoryview) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def retrieved(engine: CacheEngine, keys: list[ChunkKey], lookup_id: str = "") -> list[bytes | None]:
    """Each key's bytes as a retrieve of its head range finds them (keys of one model, layout and
    head range; each stored as exactly that piece)."""
    first = keys[0]
    assert all((k.model_name, k.layout, k.head_lo, k.head_hi) ==
               (first.model_name, first.layout, first.head_lo, first.head_hi) for k in keys)
    plan = engine.store.begin_retrieve(first.model_name, first.layout, (first.head_lo, first.head_hi),
                                 [k.chunk_hash for k in keys], lookup_id)
    out: list[bytes | None] = [None] * len(keys)
    for index, sources in plan.found:
        (view, lo, hi), = sources
        assert (lo, hi) == (first.head_lo, first.head_hi)
        out[index] = bytes(view.numpy())
    engine.store.finish_retrieve(plan)
    return out


def lookup_tiers(engine: CacheEngine, world: int, hashes: list[bytes], lookup_id: str,
                 **kw: Any) -> int:
    """A tiered lookup of every rank of ``world`` (opaque layout: as ``key`` names pieces)."""
    layout = opaque_layout(world)
    kw.setdefault("tier_timeout_s", kw.pop("timeout_s", 1.0))
    return engine.lookup("m", [GroupTarget(layout, world_heads(layout, world))], hashes, lookup_id,
                         **kw)


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


def v1_record(model: str, world: int, rank: int, chunk_hash: bytes, data: memoryview) -> bytes:
    """A record as format version 1 wrote it (world size and rank, no layout, no head range)."""
    name = model.encode()
    fixed = struct.pack("<4sHHQIIHH", b"LMKV", 1, 0, data.nbytes, world, rank, len(chunk_hash),
                        len(name))
    hasher = blake3(fixed)
    for part in (chunk_hash, name, data):
        hasher.update(part)
    return b"".join((fixed, hasher.digest(16), chunk_hash, name, data))


def v1_file_name(model: str, world: int, rank: int, chunk_hash: bytes) -> str:
    return f"{chunk_hash.hex()}.{world}.{rank}.{blake3(model.encode()).hexdigest(6)}{SUFFIX}"


def test_record_v2_header_names_model_layout_and_head_range() -> None:
    k = piece(1, 4, 8, model="org/model:v1")
    data = record.encode(k, payload(1))
    assert record.FORMAT_VERSION == 2 and record.FIXED_BYTES == 56
    assert record.header_bytes(k) == 56 + 32 + len("org/model:v1") + len(LAYOUT)
    magic, version, flags, nbytes, lo, hi, hash_len, model_len, layout_len, reserved, xxh3 = (
        struct.unpack_from("<4sHHQIIHHHHQ", data))
    assert (magic, version, flags, nbytes, lo, hi) == (b"LMKV", 2, 0, NBYTES, 4, 8)
    assert (hash_len, model_len, layout_len, reserved) == (32, 12, len(LAYOUT), 0)
    assert xxh3 == integrity.checksum(payload(1))  # the piece's own checksum, carried
    assert data[56 + 32:record.header_bytes(k)] == b"org/model:v1" + LAYOUT.encode()
    header = record.parse_header(data)
    assert header.key == k and header.nbytes == NBYTES and header.length == record.header_bytes(k)
    assert header.payload_xxh3 == xxh3
    out = bytearray(10)
    assert record.encode_into(k, payload(1), out) == len(data) and bytes(out) == data
    with pytest.raises(ValueError, match="head range"):
        record.encode(piece(1, 4, 4), payload(1))  # an empty head range is no key


@pytest.mark.parametrize("other", [
    piece(1, 0, 4),                                   # another piece of the same chunk
    piece(1, 4, 8, layout=layout_key("float16", 2, 8, 64, False)),  # another layout
    piece(1, 4, 8, model="n"),                        # another model
    piece(2, 4, 8),                                   # another chunk
])
def test_record_of_another_key_is_rejected(other: ChunkKey) -> None:
    data = record.encode(piece(1, 4, 8), payload(1))
    out = memoryview(bytearray(SLOT))
    with pytest.raises(record.RecordError, match="not"):
        record.decode_into(data, other, out)
    assert bytes(out) == bytes(SLOT)  # nothing copied
    with pytest.raises(record.RecordError, match="not"):
        record.verify(record.parse_header(data), memoryview(data)[record.header_bytes(other):], other)


def test_a_v1_record_is_never_served() -> None:
    h = bytes([1, 0xAB]) * 16
    old = v1_record("m", 1, 0, h, payload(1))
    out = memoryview(bytearray(SLOT))
    for expected in (key(1), ChunkKey("m", "ranks1", 0, 1, h)):
        with pytest.raises(record.RecordError, match="version 1"):
            record.decode_into(old, expected, out)
    with pytest.raises(record.RecordError, match="version 1"):
        record.parse_header(old)
    with pytest.raises(record.RecordError, match="version 1"):
        record.fixed_lengths(old[:44])  # what a v1 reader needed first is enough to refuse it
    assert bytes(out) == bytes(SLOT)


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
    assert disk.stats().loaded_chunks == 1 and disk.stats().written_chunks == 1


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
    assert disk.stats().corrupt == 1
    assert "dropped" in caplog.text


def test_damaged_file_is_a_miss_for_the_engine(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, write_through=True)
    engine = engine_with(disk)
    keys = [key(i) for i in range(4)]
    store(engine, keys)
    for k in keys:
        disk.write(k, payload(k.chunk_hash[0]))
    engine.store.clear(force=True)
    bad = tmp_path / file_name(keys[2])
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0x55
    bad.write_bytes(bytes(data))
    hashes = [k.chunk_hash for k in keys]
    assert lookup_tiers(engine, 1, hashes, "r", timeout_s=2) == 2  # stops before the bad one
    assert retrieved(engine, keys[:2], "r") == [bytes(payload(0)), bytes(payload(1))]
    assert not engine.store.inspect().resident(keys[2]) and not bad.exists()
    stats = engine.snapshot()
    assert stats.disk.corrupt == 1 and stats.engine.chunks == 2 + 1  # chunk 3 loaded, unlocked
    assert stats.engine.lookup_hit_chunks == 2 and stats.engine.lookup_miss_chunks == 2


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
    assert again.stats().corrupt == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [file_name(key(i, model="llama")) for i in range(3)] + ["notes.txt"])
    out = memoryview(bytearray(SLOT))
    assert again.read_into(key(1, model="llama"), out) == NBYTES
    assert bytes(out[:NBYTES]) == bytes(payload(1))
    assert "truncated" in caplog.text


def test_pieces_of_one_chunk_are_distinct_files_listed_by_pieces_of(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    quarters = [piece(1, lo, lo + 2) for lo in (6, 0, 4, 2)]  # TP 4's pieces, written out of order
    halves = [piece(1, lo, hi) for lo, hi in world_heads(LAYOUT, 2)]  # TP 2's pieces of it too
    for i, k in enumerate(quarters + halves):
        assert disk.write(k, payload(i, nbytes=NBYTES - i))
    assert disk.write(piece(2, 0, 4), payload(9))  # another chunk
    assert disk.write(piece(1, 0, 4, model="n"), payload(9))  # another model's chunk, same hash
    names = {file_name(k) for k in quarters + halves}
    assert len(names) == 6 and names <= {p.name for p in files(tmp_path)}
    assert len({file_name(piece(1, 0, 4, model="n")), file_name(piece(1, 0, 4)),
                file_name(piece(1, 0, 4, layout=opaque_layout(8)))}) == 3
    assert file_name(piece(1, 2, 4)) == (f"{(bytes([1, 0xAB]) * 16).hex()}.2-4."
                                         f"{blake3(b'm' + bytes(1) + LAYOUT.encode()).hexdigest(6)}"
                                         f"{SUFFIX}")
    sizes = {k: NBYTES - i for i, k in enumerate(quarters + halves)}
    expected = sorted(sizes.items(), key=lambda item: (item[0].head_lo, item[0].head_hi))
    chunk = bytes([1, 0xAB]) * 16
    assert disk.pieces_of("m", LAYOUT, chunk) == expected
    assert disk.pieces_of("n", LAYOUT, chunk) == [(piece(1, 0, 4, model="n"), NBYTES)]
    assert disk.pieces_of("m", opaque_layout(2), chunk) == []
    assert disk.pieces_of("m", LAYOUT, bytes(32)) == []
    out = memoryview(bytearray(SLOT))
    for i, k in enumerate(quarters + halves):  # each piece reads back its own bytes
        assert disk.read_into(k, out) == NBYTES - i
        assert bytes(out[:NBYTES - i]) == bytes(payload(i, nbytes=NBYTES - i))

    again = DiskTier(tmp_path, 1 << 20)  # a restart: the scan rebuilds the chunk index too
    assert again.pieces_of("m", LAYOUT, chunk) == expected
    assert again.pieces_of("m", LAYOUT, bytes([2, 0xAB]) * 16) == [(piece(2, 0, 4), NBYTES)]
    assert again.remove(piece(1, 2, 4))
    (tmp_path / file_name(piece(1, 4, 6))).unlink()  # gone behind its back: the read finds out
    assert again.read_into(piece(1, 4, 6), out) == 0
    assert [k for k, _ in again.pieces_of("m", LAYOUT, chunk)] == [
        piece(1, 0, 2), piece(1, 0, 4), piece(1, 4, 8), piece(1, 6, 8)]

    one = record.header_bytes(piece(2, 0, 4)) + NBYTES
    small = DiskTier(tmp_path, 2 * one)  # a smaller cap at the scan deletes (the LRU) pieces
    left = small.lru_keys()
    assert len(left) == 2
    for c in {k.chunk for k in again.lru_keys()}:
        assert [k for k, _ in small.pieces_of(*c)] == sorted(
            (k for k in left if k.chunk == c), key=lambda k: (k.head_lo, k.head_hi))
    assert small.write(piece(3, 0, 8), payload(3))  # evicts the least recently used piece
    assert sum(len(small.pieces_of(*k.chunk)) for k in {k.chunk: k for k in left}.values()) == 1
    assert small.pieces_of("m", LAYOUT, bytes([3, 0xAB]) * 16) == [(piece(3, 0, 8), NBYTES)]


def test_v1_files_are_dropped_at_the_scan_never_served(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    h = bytes([1, 0xAB]) * 16
    old = tmp_path / v1_file_name("m", 1, 0, h)  # as the previous format named and wrote it
    old.write_bytes(v1_record("m", 1, 0, h, payload(1)))
    renamed = tmp_path / file_name(key(1))  # a v1 record under a v2 name
    renamed.write_bytes(v1_record("m", 1, 0, h, payload(1)))
    disk = DiskTier(tmp_path, 1 << 20)
    assert len(disk) == 0 and disk.stats().corrupt == 2 and disk.bytes_used == 0
    assert not old.exists() and not renamed.exists()
    assert not disk.contains(key(1)) and disk.pieces_of("m", "ranks1", h) == []
    assert disk.read_into(key(1), memoryview(bytearray(SLOT))) == 0
    assert "version 1" in caplog.text


def test_a_file_holding_another_head_range_is_never_served(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    low, high = piece(1, 0, 4), piece(1, 4, 8)
    assert disk.write(low, payload(1)) and disk.write(high, payload(2))
    # Swapped behind the tier's back (same size): the header names the other piece.
    (tmp_path / file_name(high)).write_bytes((tmp_path / file_name(low)).read_bytes())
    out = memoryview(bytearray(SLOT))
    assert disk.read_into(high, out) == 0
    assert not disk.contains(high) and disk.stats().corrupt == 1
    assert disk.pieces_of("m", LAYOUT, low.chunk_hash) == [(low, NBYTES)]
    assert disk.read_into(low, out) == NBYTES and bytes(out[:NBYTES]) == bytes(payload(1))
    # ... and at a restart's scan, a file named for one piece that holds another is dropped.
    (tmp_path / file_name(high)).write_bytes((tmp_path / file_name(low)).read_bytes())
    again = DiskTier(tmp_path, 1 << 20)
    assert again.lru_keys() == [low] and again.stats().corrupt == 1
    assert not (tmp_path / file_name(high)).exists()


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
    assert disk.stats().deleted == 1 and len(files(tmp_path)) == 3
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
    assert engine.tiers is not None
    engine.tiers.start()  # the writer, writing the engine's pieces
    try:
        keys = [key(i, rank) for i in range(3) for rank in (0,)]
        store(engine, keys)
        assert disk.flush(5)
    finally:
        disk.stop()
    assert len(files(tmp_path)) == 3

    fresh = engine_with(DiskTier(tmp_path, 1 << 20))  # a new server on the same directory
    hashes = [k.chunk_hash for k in keys] + [key(7).chunk_hash]
    assert fresh.lookup("m", [GroupTarget(opaque_layout(1), ((0, 1),))], hashes, "q") == 0
    assert lookup_tiers(fresh, 1, hashes, "q", timeout_s=2) == 3
    assert fresh.store.inspect().locks_of("q") and set(fresh.store.inspect().locks_of("q")) == set(keys)
    assert retrieved(fresh, keys, "q") == [bytes(payload(i)) for i in range(3)]
    assert fresh.store.inspect().locks_of("q") == []
    stats = fresh.snapshot()
    assert stats.disk.loaded_chunks == 3 and stats.engine.lookups == 2
    assert stats.engine.lookup_hit_chunks == 3 and stats.engine.lookup_miss_chunks == 4 + 1


def test_prefix_needs_every_rank(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    engine = engine_with(disk, slots=16)
    for i in range(4):
        for rank in range(2):
            if (i, rank) != (2, 1):
                disk.write(key(i, rank, world=2), payload(i))
    store(engine, [key(0, 0, world=2), key(0, 1, world=2), key(1, 1, world=2)])
    hashes = [key(i).chunk_hash for i in range(4)]
    assert lookup_tiers(engine, 2, hashes, "tp", timeout_s=2) == 2
    assert len(engine.store.inspect().locks_of("tp")) == 4
    assert not engine.store.inspect().resident(key(2, 0, world=2))  # beyond the prefix: not loaded
    assert engine.snapshot().disk.loaded_chunks == 1  # only (chunk 1, rank 0) was read


def test_eviction_spills_to_disk_ahead(tmp_path: Path) -> None:
    """The writer keeps saved the least recently used pieces holding ``spill_ahead_bytes - free
    pool bytes`` (the next in line for eviction), never the warmer ones; so every eviction finds
    its piece already on disk."""
    disk = DiskTier(tmp_path, 1 << 20)  # write_through off: only pieces near eviction are saved
    engine = engine_with(disk, slots=8)
    tiers = engine.tiers
    assert tiers is not None and tiers.spill_ahead_bytes == 8 * SLOT // 4
    tiers.start()
    try:
        for i in range(7):  # separate stores: key(0) is the least recently used
            store(engine, [key(i)])
        # One slot free: 2 slots' bytes - 1 slot's at risk = more than one piece (NBYTES < SLOT)
        # holds, so exactly the two coldest pieces are saved.
        at_risk = tiers.spill_ahead_bytes - engine.pool.bytes_free
        assert at_risk == SLOT and -(-at_risk // NBYTES) == 2
        wait_until(lambda: disk.contains(key(0)) and disk.contains(key(1)))
        wait_until(lambda: not tiers.spill_candidates(8))  # the writer is done, nothing more is due
        assert [k.chunk_hash[0] for k in disk.lru_keys()] == [0, 1]  # warmer pieces are not
        assert disk.stats().written_chunks == 2
        store(engine, [key(7)])  # the pool is full: 2 slots' bytes at risk, three pieces
        wait_until(lambda: not tiers.spill_candidates(8))
        assert sorted(k.chunk_hash[0] for k in disk.lru_keys()) == [0, 1, 2]
        for i in range(8, 12):  # each store evicts the coldest piece, saved ahead of it
            store(engine, [key(i)])
            wait_until(lambda: not tiers.spill_candidates(8))
            assert sorted(k.chunk_hash[0] for k in disk.lru_keys()) == list(range(i - 4))
        assert engine.snapshot().engine.evictions == 4
        assert engine.snapshot().disk.evicted_unsaved == 0
        evicted = [key(i) for i in range(4)]
        assert all(disk.contains(k) and not engine.store.inspect().resident(k) for k in evicted)
        assert not any(disk.contains(key(i)) for i in range(7, 12))  # the warmest never went
        hashes = [k.chunk_hash for k in evicted]
        assert lookup_tiers(engine, 1, hashes, "back", timeout_s=2) == 4
        assert retrieved(engine, evicted, "back") == [bytes(payload(i)) for i in range(4)]
    finally:
        disk.stop()


def test_unsaved_evictions_and_dropped_writes_are_counted(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, write_through=True, queue_size=2)  # writer never started
    engine = engine_with(disk, slots=4)
    store(engine, [key(i) for i in range(4)])
    store(engine, [key(i) for i in range(4, 6)])
    stats = engine.snapshot()
    assert stats.disk.write_dropped == 4 and stats.disk.evicted_unsaved == 2
    assert stats.disk.chunks == 0


def test_no_tier_means_no_tier_work(tmp_path: Path) -> None:
    engine = engine_with(None)
    assert engine.tiers is None
    store(engine, [key(0)])
    assert lookup_tiers(engine, 1, [key(0).chunk_hash, key(1).chunk_hash], "x") == 1
    assert engine.snapshot().disk is None and engine.snapshot().remote is None


def _resave_between(disk: DiskTier, k: ChunkKey, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Make the tier's next unlink race a re-save of ``k`` (the writer thread, saving the key again
    once it is unindexed): the re-save runs on a thread and gets a moment to land first."""
    real_unlink = disk_module.unlink
    saved: list[bool] = []

    def racing_unlink(path: Path) -> None:
        monkeypatch.setattr(disk_module, "unlink", real_unlink)
        writer = threading.Thread(target=lambda: saved.append(disk.write(k, payload(1))))
        writer.start()
        writer.join(0.3)  # lands now unless the tier's lock keeps it out until the drop is done
        real_unlink(path)

    monkeypatch.setattr(disk_module, "unlink", racing_unlink)
    return saved


def _wait_saved(saved: list[bool]) -> None:
    wait_until(lambda: saved)
    assert saved == [True]


def test_a_resave_racing_the_drop_of_a_bad_file_is_kept(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    k = key(1)
    assert disk.write(k, payload(1))
    path = tmp_path / file_name(k)
    size = path.stat().st_size
    with open(path, "r+b") as f:  # corrupt the payload's last byte
        f.seek(-1, os.SEEK_END)
        f.write(b"X")
    saved = _resave_between(disk, k, monkeypatch)
    assert disk.load_into(k, memoryview(bytearray(NBYTES))) == (0, 0)
    _wait_saved(saved)
    assert disk.contains(k) and path.exists() and disk.stats().bytes == size
    out = memoryview(bytearray(NBYTES))
    assert disk.load_into(k, out)[0] == NBYTES and out == payload(1)


def test_a_resave_racing_remove_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    k = key(1)
    assert disk.write(k, payload(1))
    path = tmp_path / file_name(k)
    saved = _resave_between(disk, k, monkeypatch)
    assert disk.remove(k)
    _wait_saved(saved)
    assert disk.contains(k) and path.exists()
    assert disk.load_into(k, memoryview(bytearray(NBYTES)))[0] == NBYTES
