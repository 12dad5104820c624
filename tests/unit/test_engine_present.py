"""A store that finds some of its keys already present: those pieces belong to what it keeps, so
the room it makes for the others never evicts them (LRU, quota and retention-ordered eviction)."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_core.engine import CacheEngine, GroupTarget, Retention
from lmcache_core.engine.plans import StorePlan
from lmcache_core.engine.retention import PLAIN
from lmcache_core.keys import ChunkKey, opaque_layout
from lmcache_core.storage.pool import MemoryPool
from tests.harness import FakeClock

LAYOUT = opaque_layout(1)
SLOT = 64


def key(i: int) -> ChunkKey:
    return ChunkKey("m", LAYOUT, 0, 1, bytes([i]) * 32)


def make(slots: int = 3, clock: FakeClock | None = None, **kw: object) -> CacheEngine:
    return CacheEngine(MemoryPool.slots(SLOT, slots, pin=False), chunk_size=16,
                       clock=clock or FakeClock(start=100.0), **kw)  # type: ignore[arg-type]


def store(engine: CacheEngine, chunks: Sequence[int], retention: Retention = PLAIN) -> StorePlan:
    plan = engine.store.begin_store([key(i) for i in chunks], SLOT, retention)
    engine.store.finish_store(plan)
    return plan


def prefix(engine: CacheEngine, chunks: Sequence[int]) -> int:
    return engine.lookup("m", [GroupTarget(LAYOUT, ((0, 1),))], [key(i).chunk_hash for i in chunks],
                         "x", lock=False)


def test_a_present_lru_piece_is_not_evicted_by_its_own_store() -> None:
    engine = make()
    for i in (0, 8, 9):  # the pool is full; chunk 0 is the least recently used piece
        store(engine, [i])
    plan = store(engine, [0, 1, 2])  # a prefix: its head already held, the rest new
    assert (plan.stored, plan.already_present, plan.skipped_full) == (2, 1, 0)
    assert prefix(engine, [0, 1, 2]) == 3
    assert not engine.store.inspect().resident(key(8)) and not engine.store.inspect().resident(key(9))


def test_a_present_piece_is_not_taken_for_the_models_quota() -> None:
    engine = make(slots=4, quotas={"m": 2 * SLOT})
    store(engine, [0])
    store(engine, [8])  # the model's quota is full; chunk 0 is its oldest piece
    plan = store(engine, [0, 1])
    assert (plan.stored, plan.already_present, plan.skipped_quota) == (1, 1, 0)
    assert prefix(engine, [0, 1]) == 2 and not engine.store.inspect().resident(key(8))


def test_a_present_piece_whose_ttl_ended_is_not_taken_by_its_store() -> None:
    clock = FakeClock(start=100.0)
    engine = make(clock=clock)
    store(engine, [0], Retention(ttl_s=5))
    store(engine, [8])
    store(engine, [9])
    clock.advance(10)  # chunk 0 is expired: eviction's first
    plan = store(engine, [0, 1])
    assert (plan.stored, plan.already_present) == (1, 1)
    assert prefix(engine, [0, 1]) == 2 and not engine.store.inspect().resident(key(8))


def test_no_room_without_the_present_pieces_skips_the_new_ones() -> None:
    engine = make(slots=1)
    store(engine, [0])
    plan = store(engine, [0, 1])  # the only piece that could go is the one the store found
    assert (plan.stored, plan.already_present, plan.skipped_full) == (0, 1, 1)
    assert prefix(engine, [0]) == 1


def test_the_present_pieces_are_evictable_again_after_the_store() -> None:
    engine = make(slots=2)
    store(engine, [0])
    store(engine, [0, 1])
    assert engine.store.inspect().pieces[key(0)].readers == 0
    store(engine, [1, 5])  # chunk 0 is now the least recently used: it goes
    assert not engine.store.inspect().resident(key(0)) and prefix(engine, [0, 1]) == 0
    assert engine.store.inspect().resident(key(5))
