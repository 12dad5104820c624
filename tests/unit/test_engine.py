"""CacheEngine: prefix lookup across ranks, locks and TTL, LRU eviction, store/retrieve, admin."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch

from lmcache_core.engine import CacheEngine
from lmcache_core.errors import IncompatibleError, ProtocolError
from lmcache_core.keys import ChunkKey
from lmcache_core.protocol.messages import ServerStats, StoreReply
from lmcache_core.storage.pool import MemoryPool

MODEL = "m"
SLOT = 32


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def h(i: int) -> bytes:
    return bytes([i]) * 32


def key(i: int, rank: int = 0, world_size: int = 2, model: str = MODEL) -> ChunkKey:
    return ChunkKey(model, world_size, rank, h(i))


def make(num_slots: int = 32, ttl: float = 300.0, clock: FakeClock | None = None) -> CacheEngine:
    pool = MemoryPool.slots(SLOT, num_slots, pin=False)
    return CacheEngine(pool, chunk_size=16, lock_ttl_s=ttl, clock=clock or FakeClock())


def store(engine: CacheEngine, keys: Sequence[ChunkKey], nbytes: int = SLOT) -> StoreReply:
    """Store keys whose bytes are each key's first hash byte plus its rank."""
    plan = engine.begin_store(keys, nbytes)
    for _, k, view in plan.writes:
        view.fill_(k.chunk_hash[0] + k.kv_rank)
    engine.finish_store(plan)
    return StoreReply(stored=plan.stored, already_present=plan.already_present,
                      skipped_full=plan.skipped_full)


def store_ranks(engine: CacheEngine, chunks: Sequence[int], ranks: Sequence[int] = (0, 1)) -> None:
    for rank in ranks:
        store(engine, [key(i, rank) for i in chunks])


def retrieve(engine: CacheEngine, keys: Sequence[ChunkKey], lookup_id: str = "") -> list[int]:
    plan = engine.begin_retrieve(keys, lookup_id)
    engine.finish_retrieve(plan)
    return plan.missing


def hashes(n: int) -> list[bytes]:
    return [h(i) for i in range(n)]


# ---------------------------------------------------------------- lookup


def test_prefix_counts_only_chunks_every_rank_holds() -> None:
    engine = make()
    store_ranks(engine, range(6), ranks=[0])
    store_ranks(engine, [0, 1, 2, 4, 5], ranks=[1])  # rank 1 lacks chunk 3
    assert engine.lookup(MODEL, 2, hashes(6), "a", lock=False) == 3
    assert engine.lookup(MODEL, 1, hashes(6), "a", lock=False) == 0  # another world size
    assert engine.lookup("other", 2, hashes(6), "a", lock=False) == 0
    assert engine.lookup(MODEL, 2, [h(9), *hashes(3)], "a", lock=False) == 0  # stops at the gap


def test_lookup_needs_every_rank() -> None:
    engine = make()
    store_ranks(engine, range(4), ranks=[0])
    assert engine.lookup(MODEL, 2, hashes(4), "a") == 0
    assert engine.locks_of("a") == []
    store_ranks(engine, range(4), ranks=[1])
    assert engine.lookup(MODEL, 2, hashes(4), "a") == 4


def test_lookup_counts_stats() -> None:
    engine = make()
    store_ranks(engine, range(3))
    engine.lookup(MODEL, 2, hashes(5), "a")
    engine.lookup(MODEL, 2, [], "b")
    stats = engine.stats()
    assert (stats["lookups"], stats["lookup_hit_chunks"], stats["lookup_miss_chunks"]) == (2, 3, 2)
    rows, _ = engine.list_chunks(sort="key")
    assert all(row.hits == 1 for row in rows)


def test_lookup_refuses_bad_world_size() -> None:
    with pytest.raises(ProtocolError, match="world_size"):
        make().lookup(MODEL, 0, hashes(1), "a")


def test_lookup_probes_with_plain_tuples_find_chunk_keys() -> None:
    engine = make()
    store(engine, [key(0, 0, world_size=1)])
    assert engine.lookup(MODEL, 1, [h(0)], "a") == 1
    assert engine.locks_of("a") == [key(0, 0, world_size=1)]
    assert isinstance(engine.locks_of("a")[0], ChunkKey)


# ---------------------------------------------------------------- locks


def locks_by_key(engine: CacheEngine) -> dict[ChunkKey, int]:
    rows, _ = engine.list_chunks(limit=1000, sort="key")
    return {ChunkKey(r.model_name, r.world_size, r.kv_rank, r.chunk_hash): r.locks for r in rows}


def test_lookup_locks_hit_keys_of_every_rank() -> None:
    engine = make()
    store_ranks(engine, range(4))
    assert engine.lookup(MODEL, 2, hashes(2), "a") == 2
    assert sorted(engine.locks_of("a")) == sorted(key(i, r) for i in range(2) for r in range(2))
    engine.lookup(MODEL, 2, hashes(1), "b")
    locks = locks_by_key(engine)
    assert locks[key(0, 0)] == 2
    assert locks[key(1, 1)] == 1
    assert locks[key(3, 0)] == 0
    assert engine.stats()["locks_held"] == 6


def test_retrieve_releases_that_ranks_lock_only() -> None:
    engine = make()
    store_ranks(engine, range(3))
    engine.lookup(MODEL, 2, hashes(3), "a")
    assert retrieve(engine, [key(i, 0) for i in range(3)], "a") == []
    assert sorted(engine.locks_of("a")) == sorted(key(i, 1) for i in range(3))
    assert engine.free_lookup_locks("a") == 3
    assert engine.locks_of("a") == []
    assert engine.free_lookup_locks("a") == 0
    assert engine.stats()["locks_held"] == 0


def test_retrieve_of_both_ranks_drops_the_lookup() -> None:
    engine = make()
    store_ranks(engine, range(2))
    engine.lookup(MODEL, 2, hashes(2), "a")
    retrieve(engine, [key(i, 0) for i in range(2)], "a")
    retrieve(engine, [key(i, 1) for i in range(2)], "a")
    assert engine.end_session("a") == 0
    assert all(n == 0 for n in locks_by_key(engine).values())


def test_retrieve_releases_only_its_own_lookup_id() -> None:
    engine = make()
    store_ranks(engine, range(2))
    engine.lookup(MODEL, 2, hashes(2), "a")
    engine.lookup(MODEL, 2, hashes(2), "b")
    retrieve(engine, [key(0, 0)], "a")
    retrieve(engine, [key(1, 0)])  # no lookup id: releases nothing
    assert len(engine.locks_of("a")) == 3
    assert len(engine.locks_of("b")) == 4
    assert engine.end_session("a") == 3
    assert engine.end_session("b") == 4


def test_relookup_replaces_locks() -> None:
    engine = make()
    store_ranks(engine, range(4))
    engine.lookup(MODEL, 2, hashes(4), "a")
    engine.lookup(MODEL, 2, hashes(4), "a")
    assert set(locks_by_key(engine).values()) == {1}
    engine.lookup(MODEL, 2, hashes(1), "a")
    locks = locks_by_key(engine)
    assert locks[key(0, 0)] == 1
    assert locks[key(3, 1)] == 0
    assert engine.stats()["locks_held"] == 2


def test_unlocked_lookup_keeps_existing_locks() -> None:
    engine = make()
    store_ranks(engine, range(2))
    engine.lookup(MODEL, 2, hashes(2), "a")
    engine.lookup(MODEL, 2, hashes(2), "a", lock=False)
    assert len(engine.locks_of("a")) == 4


def test_repeated_hash_locks_once() -> None:
    engine = make()
    store(engine, [key(0, 0, world_size=1)])
    assert engine.lookup(MODEL, 1, [h(0), h(0)], "a") == 2
    assert locks_by_key(engine)[key(0, 0, world_size=1)] == 1
    assert engine.free_lookup_locks("a") == 1
    assert locks_by_key(engine)[key(0, 0, world_size=1)] == 0


def test_locks_expire_after_ttl() -> None:
    clock = FakeClock()
    engine = make(ttl=10.0, clock=clock)
    store_ranks(engine, range(2))
    engine.lookup(MODEL, 2, hashes(2), "a")
    clock.now += 5
    assert engine.expire_locks() == 0
    clock.now += 5
    assert engine.expire_locks() == 4
    assert engine.locks_of("a") == []
    stats = engine.stats()
    assert (stats["locks_expired"], stats["locks_held"]) == (4, 0)


def test_relookup_restarts_the_ttl() -> None:
    clock = FakeClock()
    engine = make(ttl=10.0, clock=clock)
    store_ranks(engine, range(2))
    engine.lookup(MODEL, 2, hashes(2), "a")
    clock.now += 8
    engine.lookup(MODEL, 2, hashes(2), "a")
    clock.now += 8  # the first lock's deadline has passed, the second's has not
    assert engine.expire_locks() == 0
    assert len(engine.locks_of("a")) == 4
    clock.now += 2
    assert engine.expire_locks() == 4


def test_lookup_and_store_expire_due_locks_on_the_way() -> None:
    clock = FakeClock()
    engine = make(num_slots=2, ttl=10.0, clock=clock)
    store(engine, [key(0, 0, world_size=1), key(1, 0, world_size=1)])
    engine.lookup(MODEL, 1, hashes(2), "a")
    clock.now += 11
    # The pool is full of locked chunks whose locks are due: the store expires them and evicts.
    assert store(engine, [key(7, 0, world_size=1)]).stored == 1
    assert engine.stats()["locks_expired"] == 2
    engine.lookup(MODEL, 1, hashes(1), "b")
    clock.now += 11
    engine.lookup(MODEL, 1, [h(7)], "c")
    assert engine.locks_of("b") == []


def test_released_lock_sets_do_not_pile_up_in_the_expiry_heap() -> None:
    engine = make()
    store_ranks(engine, range(2))
    for i in range(1000):
        engine.lookup(MODEL, 2, hashes(2), f"id{i}")
        engine.free_lookup_locks(f"id{i}")
    assert len(engine._expiry) <= 64 + 2


# ---------------------------------------------------------------- eviction


def test_lru_eviction_takes_least_recently_used() -> None:
    engine = make(num_slots=3)
    for i in range(3):
        store(engine, [key(i, 0, world_size=1)])
    engine.lookup(MODEL, 1, [h(0)], "a", lock=False)  # 0 becomes most recent; 1 is now the LRU
    store(engine, [key(3, 0, world_size=1)])
    assert not engine.is_resident(key(1, 0, world_size=1))
    assert engine.is_resident(key(0, 0, world_size=1))
    assert engine.stats()["evictions"] == 1


def test_eviction_eats_a_prefix_from_its_tail() -> None:
    engine = make(num_slots=4)
    store(engine, [key(i, 0, world_size=1) for i in range(4)])
    store(engine, [key(9, 0, world_size=1)])
    assert engine.lookup(MODEL, 1, hashes(4), "a", lock=False) == 3


def test_eviction_never_takes_a_locked_chunk() -> None:
    engine = make(num_slots=3)
    for i in range(3):
        store(engine, [key(i, 0, world_size=1)])
    engine.lookup(MODEL, 1, [h(0)], "a")
    for i in range(10, 20):
        store(engine, [key(i, 0, world_size=1)])
    assert engine.is_resident(key(0, 0, world_size=1))
    engine.free_lookup_locks("a")
    store(engine, [key(30, 0, world_size=1), key(31, 0, world_size=1)])
    assert not engine.is_resident(key(0, 0, world_size=1))


def test_eviction_never_takes_a_chunk_being_read() -> None:
    engine = make(num_slots=2)
    store(engine, [key(0, 0, world_size=1), key(1, 0, world_size=1)])
    plan = engine.begin_retrieve([key(0, 0, world_size=1)])
    before = plan.found[0][2].clone()
    for i in range(10, 15):
        store(engine, [key(i, 0, world_size=1)])
    assert engine.is_resident(key(0, 0, world_size=1))
    assert torch.equal(plan.found[0][2], before)
    engine.finish_retrieve(plan)
    store(engine, [key(20, 0, world_size=1), key(21, 0, world_size=1)])
    assert not engine.is_resident(key(0, 0, world_size=1))


def test_full_pool_of_locked_chunks_skips_without_raising() -> None:
    engine = make(num_slots=2)
    store_ranks(engine, [0])
    engine.lookup(MODEL, 2, hashes(1), "a")
    reply = store(engine, [key(5, 0), key(6, 0), key(0, 0)])
    assert (reply.stored, reply.already_present, reply.skipped_full) == (0, 1, 2)
    stats = engine.stats()
    assert (stats["store_skipped_full"], stats["evictions"], stats["slots_used"]) == (2, 0, 2)
    assert stats["stores"] == 3


def test_partial_room_stores_the_head_first() -> None:
    engine = make(num_slots=3)
    store(engine, [key(0, 0, world_size=1)])
    engine.lookup(MODEL, 1, [h(0)], "a")
    reply = store(engine, [key(i, 0, world_size=1) for i in range(1, 5)])
    assert (reply.stored, reply.skipped_full) == (2, 2)
    assert engine.lookup(MODEL, 1, hashes(5), "b", lock=False) == 3


def test_slots_being_written_are_not_evicted() -> None:
    engine = make(num_slots=2)
    pending = engine.begin_store([key(0, 0), key(1, 0)], SLOT)
    assert store(engine, [key(2, 0)]).skipped_full == 1
    engine.finish_store(pending)
    assert engine.is_resident(key(0, 0))


# ---------------------------------------------------------------- store and retrieve


def test_bytes_round_trip_through_slot_views() -> None:
    engine = make()
    keys = [key(i, 0) for i in range(3)]
    data = [torch.randint(0, 256, (20,), dtype=torch.uint8) for _ in keys]
    plan = engine.begin_store(keys, 20)
    for index, _, view in plan.writes:
        assert view.shape == (20,)
        view.copy_(data[index])
    engine.finish_store(plan)
    out = engine.begin_retrieve([key(9, 0), *keys])
    assert out.missing == [0]
    assert [index for index, _, _ in out.found] == [1, 2, 3]
    for index, k, view in out.found:
        assert k == keys[index - 1]
        assert torch.equal(view, data[index - 1])
    engine.finish_retrieve(out)
    stats = engine.stats()
    assert (stats["retrieves"], stats["retrieved_chunks"], stats["retrieve_missing"]) == (1, 3, 1)
    assert (stats["chunks"], stats["bytes_used"], stats["stored_chunks"]) == (3, 60, 3)


def test_store_twice_is_harmless() -> None:
    engine = make()
    assert store(engine, [key(0, 0), key(1, 0)]).stored == 2
    reply = store(engine, [key(0, 0), key(1, 0), key(2, 0)])
    assert (reply.stored, reply.already_present) == (1, 2)
    stats = engine.stats()
    assert (stats["chunks"], stats["slots_used"], stats["stored_chunks"]) == (3, 3, 3)


def test_repeated_key_in_one_store_takes_one_slot() -> None:
    engine = make()
    reply = store(engine, [key(0, 0), key(0, 0)])
    assert (reply.stored, reply.already_present) == (1, 1)
    assert engine.pool.num_used == 1


def test_chunk_is_invisible_until_finish_store() -> None:
    engine = make()
    plan = engine.begin_store([key(0, 0, world_size=1)], SLOT)
    assert engine.lookup(MODEL, 1, [h(0)], "a") == 0
    assert engine.begin_retrieve([key(0, 0, world_size=1)]).missing == [0]
    assert engine.begin_store([key(0, 0, world_size=1)], SLOT).already_present == 1
    assert engine.stats()["chunks"] == 0
    engine.finish_store(plan)
    assert engine.lookup(MODEL, 1, [h(0)], "a") == 1


def test_failed_store_frees_its_slots() -> None:
    engine = make(num_slots=4)
    plan = engine.begin_store([key(i, 0) for i in range(4)], SLOT)
    assert engine.pool.num_free == 0
    engine.finish_store(plan, ok=False)
    engine.finish_store(plan)  # a second finish does nothing
    assert engine.pool.num_free == 4
    assert engine.lookup(MODEL, 1, [h(0)], "a") == 0
    assert not engine.is_resident(key(0, 0))
    assert store(engine, [key(0, 0)]).stored == 1  # the key can be stored again


def test_finish_retrieve_twice_does_nothing() -> None:
    engine = make()
    store_ranks(engine, [0])
    engine.lookup(MODEL, 2, hashes(1), "a")
    plan = engine.begin_retrieve([key(0, 0)], "a")
    engine.finish_retrieve(plan)
    engine.finish_retrieve(plan)
    assert engine.locks_of("a") == [key(0, 1)]
    assert engine.clear() == (1, 1)


def test_store_refuses_chunks_larger_than_a_slot() -> None:
    engine = make()
    with pytest.raises(IncompatibleError, match=rf"{SLOT + 1}.*{SLOT}"):
        engine.begin_store([key(0, 0)], SLOT + 1)
    with pytest.raises(IncompatibleError):
        engine.begin_store([key(0, 0)], 0)
    assert engine.pool.num_free == engine.pool.num_slots


# ---------------------------------------------------------------- admin


def test_clear_keeps_locked_and_read_chunks_unless_forced() -> None:
    engine = make()
    store_ranks(engine, range(3))
    engine.lookup(MODEL, 2, hashes(1), "a")  # locks chunk 0 of both ranks
    reading = engine.begin_retrieve([key(2, 0)])
    assert engine.clear() == (3, 3)
    assert engine.clear(force=True) == (2, 1)
    assert engine.locks_of("a") == []
    assert engine.stats()["locks_held"] == 0
    assert engine.is_resident(key(2, 0))
    engine.finish_retrieve(reading)
    assert engine.clear() == (1, 0)
    stats = engine.stats()
    assert (stats["chunks"], stats["slots_used"], stats["bytes_used"]) == (0, 0, 0)


def test_forced_clear_forgets_locks_so_a_restored_key_is_unlocked() -> None:
    engine = make()
    store_ranks(engine, [0])
    engine.lookup(MODEL, 2, hashes(1), "a")
    engine.clear(force=True)
    store_ranks(engine, [0])
    assert engine.free_lookup_locks("a") == 0
    assert set(locks_by_key(engine).values()) == {0}


def test_list_chunks_sorts_filters_and_limits() -> None:
    clock = FakeClock()
    engine = make(clock=clock)
    store(engine, [key(0, 0, world_size=1)], nbytes=8)
    clock.now += 1
    store(engine, [key(1, 0, world_size=1)], nbytes=16)
    clock.now += 1
    store(engine, [key(2, 0, world_size=1, model="other")], nbytes=4)
    clock.now += 1
    for _ in range(3):
        engine.lookup(MODEL, 1, [h(0)], "x", lock=False)
    engine.lookup(MODEL, 1, hashes(2), "y")

    rows, total = engine.list_chunks(sort="age")
    assert total == 3
    assert [r.chunk_hash[0] for r in rows] == [2, 1, 0]
    assert [r.age_s for r in rows] == [1.0, 2.0, 3.0]
    rows, _ = engine.list_chunks(sort="hits")
    assert [(r.chunk_hash[0], r.hits) for r in rows] == [(0, 4), (1, 1), (2, 0)]
    rows, _ = engine.list_chunks(sort="size")
    assert [r.nbytes for r in rows] == [16, 8, 4]
    rows, total = engine.list_chunks(model_name=MODEL, sort="key", limit=1)
    assert total == 2
    assert len(rows) == 1
    row = rows[0]
    assert (row.chunk_hash, row.model_name, row.world_size, row.kv_rank) == (h(0), MODEL, 1, 0)
    assert (row.tier, row.locks, row.nbytes) == ("memory", 1, 8)
    assert engine.list_chunks(limit=0) == ([], 3)
    with pytest.raises(ProtocolError, match="sort"):
        engine.list_chunks(sort="bogus")


def test_key_sort_keeps_ranks_of_a_chunk_together() -> None:
    engine = make()
    store(engine, [key(1, 1), key(0, 1)])
    store(engine, [key(1, 0), key(0, 0)])
    rows, _ = engine.list_chunks(sort="key")
    assert [(r.chunk_hash[0], r.kv_rank) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_stats_fill_server_stats() -> None:
    engine = make(num_slots=8)
    store_ranks(engine, range(2))
    stats = ServerStats(**engine.stats(), requests=1)
    assert (stats.chunks, stats.slots_total, stats.slots_used, stats.bytes_used) == (4, 8, 4, 128)


def test_constructor_validates() -> None:
    pool = MemoryPool.slots(SLOT, 2, pin=False)
    with pytest.raises(ValueError):
        CacheEngine(pool, chunk_size=0)
    with pytest.raises(ValueError):
        CacheEngine(pool, chunk_size=16, lock_ttl_s=0)


def test_lookup_is_fast() -> None:
    """64 chunks x 2 ranks, all hits, with locking: well under 100 us (bound loose for CI noise)."""
    pool = MemoryPool.slots(SLOT, 256, pin=False)
    engine = CacheEngine(pool, chunk_size=16)
    chain = [bytes([i, 7]) * 16 for i in range(64)]
    for rank in range(2):
        engine.finish_store(engine.begin_store([ChunkKey(MODEL, 2, rank, c) for c in chain], 8))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            assert engine.lookup(MODEL, 2, chain, "bench") == 64
        best = min(best, (time.perf_counter() - start) / 200)
    print(f"lookup 64 chunks x 2 ranks: {best * 1e6:.1f} us")
    assert best < 300e-6
