"""``CacheEngine.close``: the async lookups' prefetch threads go; the tier split keeps its hooks."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.engine.retention import Retention
from lmcache_core.keys import ChunkKey, opaque_layout
from lmcache_core.storage.disk import DiskTier
from lmcache_core.storage.pool import MemoryPool

SLOT = 64
W1 = opaque_layout(1)  # world size 1: one rank, heads (0, 1)


def _prefetch_threads(other_than: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name.startswith("lmcache-prefetch") and t not in other_than]


def _store(engine: CacheEngine, keys: list[ChunkKey]) -> None:
    plan = engine.store.begin_store(keys, SLOT)
    for i, (_, _, view) in enumerate(plan.writes):
        view.fill_(i)
    engine.store.finish_store(plan)


def test_close_without_tiers_is_a_no_op_and_lookups_go_on() -> None:
    engine = CacheEngine(MemoryPool.slots(SLOT, 4, pin=False), chunk_size=16)
    _store(engine, [ChunkKey("m", W1, 0, 1, b"a" * 16)])
    assert engine.close() and engine.close()  # idempotent
    assert engine.async_lookup_and_prefetch("x", [b"a" * 16], model_name="m") == 16
    assert engine.lookup("m", [GroupTarget(W1, ((0, 1),))], [b"a" * 16], "y") == 1


def test_close_shuts_the_prefetch_pool_down(tmp_path: Path) -> None:
    hashes = [bytes([i]) * 16 for i in range(3)]
    keys = [ChunkKey("m", W1, 0, 1, h) for h in hashes]
    disk = DiskTier(tmp_path, 1 << 20)
    writer = CacheEngine(MemoryPool.slots(SLOT, 8, pin=False), chunk_size=16, disk=disk)
    _store(writer, keys)
    for k in keys:
        with writer.store.reading(k) as held:
            assert held is not None and disk.write(k, held[1])
    engine = CacheEngine(MemoryPool.slots(SLOT, 8, pin=False), chunk_size=16,
                         disk=DiskTier(tmp_path, 1 << 20))
    assert engine.tiers is not None and engine.tiers.disk is not None and engine.tiers.remote is None
    done = threading.Event()
    answers: list[int] = []
    before = set(threading.enumerate())  # other engines' pools, if any

    def on_result(lookup_id: str, tokens: int) -> None:
        answers.append(tokens)
        done.set()

    assert engine.async_lookup_and_prefetch("d", hashes, model_name="m", on_result=on_result) is None
    assert done.wait(5) and answers == [48]
    threads = _prefetch_threads(before)
    assert threads
    assert engine.close(5)
    for t in threads:
        t.join(5)  # an idle pool thread ends once the pool is shut down
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="closed"):
        engine.async_lookup_and_prefetch("e", hashes, model_name="m", on_result=on_result)
    # Everything else still works, the synchronous tiered lookup included.
    assert engine.async_lookup_and_prefetch("f", hashes, model_name="m") == 48
    assert engine.cleanup_memory_objs("f") == 3
    assert engine.close()


def test_spill_ahead_follows_the_eviction_order(tmp_path: Path) -> None:
    """The disk writer saves what eviction will take next: priorities and TTLs reorder it, and a
    pinned piece (never evicted) is not saved ahead. Plain LRU would pick keys[0] and keys[1]."""
    engine = CacheEngine(MemoryPool.slots(SLOT, 8, pin=False), chunk_size=16,
                         disk=DiskTier(tmp_path, 1 << 20))
    keys = [ChunkKey("m", W1, 0, 1, bytes([i]) * 16) for i in range(8)]
    hints = {0: Retention(pin=True), 1: Retention(priority=5), 6: Retention(priority=-1)}
    for i, k in enumerate(keys):
        engine.store.finish_store(engine.store.begin_store([k], SLOT, hints.get(i, Retention())))
    assert engine.tiers is not None
    # Full pool, 2 slots' worth ahead: priority -1 first, then the LRU of the priority-0 pieces.
    assert engine.tiers.spill_candidates(8) == [keys[6], keys[2]]
    assert engine.tiers.spill_candidates(1) == [keys[6]]
    engine.close()


def test_stats_and_spill_hooks_without_and_with_a_disk(tmp_path: Path) -> None:
    plain = CacheEngine(MemoryPool.slots(SLOT, 4, pin=False), chunk_size=16)
    assert plain.tiers is None and plain.snapshot().disk is None
    disk = DiskTier(tmp_path, 1 << 20)
    engine = CacheEngine(MemoryPool.slots(SLOT, 8, pin=False), chunk_size=16, disk=disk)
    keys = [ChunkKey("m", W1, 0, 1, bytes([i]) * 16) for i in range(8)]
    for k in keys:
        _store(engine, [k])
    # Full pool: the 8 // 4 least recently used chunks are next in line and not on disk yet.
    assert engine.tiers is not None
    assert engine.tiers.spill_candidates(8) == keys[:2]
    with engine.store.reading(keys[0]) as held:
        assert held is not None and disk.write(keys[0], held[1])
    assert engine.tiers.spill_candidates(8) == keys[1:2]
    _store(engine, [ChunkKey("m", W1, 0, 1, b"z" * 16)])  # evicts keys[0] (saved), no unsaved loss
    stats = engine.snapshot()
    assert stats.engine.evictions == 1 and stats.disk.evicted_unsaved == 0
    assert stats.disk.chunks == 1
