"""CacheEngine: prefix lookup across ranks, locks and TTL, LRU eviction, store/retrieve, admin."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch

from lmcache_core.engine import CacheEngine, GroupTarget, RetrievePlan
from lmcache_core.errors import IncompatibleError, ProtocolError
from lmcache_core.keys import ChunkKey, HeadRange, opaque_layout, rank_heads, world_heads
from lmcache_core.server.listing import memory_rows, model_stats
from lmcache_core.storage.pool import MemoryPool
from tests.harness import FakeClock
from tests.unit.engines import (
    BF16,
    F16,
    MLA,
    MODEL,
    SLOT,
    begin,
    h,
    hashes,
    key,
    locks_by_key,
    lookup,
    make,
    piece,
    retrieve,
    store,
    store_ranks,
)

# ---------------------------------------------------------------- lookup


def test_prefix_counts_only_chunks_every_rank_holds() -> None:
    engine = make()
    store_ranks(engine, range(6), ranks=[0])
    store_ranks(engine, [0, 1, 2, 4, 5], ranks=[1])  # rank 1 lacks chunk 3
    assert lookup(engine, 2, hashes(6), "a", lock=False) == 3
    assert lookup(engine, 1, hashes(6), "a", lock=False) == 0  # another world size
    assert lookup(engine, 2, hashes(6), "a", lock=False, model="other") == 0
    assert lookup(engine, 2, [h(9), *hashes(3)], "a", lock=False) == 0  # stops at the gap


def test_lookup_needs_every_rank() -> None:
    engine = make()
    store_ranks(engine, range(4), ranks=[0])
    assert lookup(engine, 2, hashes(4), "a") == 0
    assert engine.store.inspect().locks_of("a") == []
    store_ranks(engine, range(4), ranks=[1])
    assert lookup(engine, 2, hashes(4), "a") == 4


def test_lookup_counts_stats() -> None:
    engine = make()
    store_ranks(engine, range(3))
    lookup(engine, 2, hashes(5), "a")
    lookup(engine, 2, [], "b")
    stats = engine.snapshot()
    n = stats.engine
    assert (n.lookups, n.lookup_hit_chunks, n.lookup_miss_chunks) == (2, 3, 2)
    assert all(piece.hits == 1 for piece in engine.store.inspect().pieces.values())


def test_lookup_refuses_no_head_ranges() -> None:
    with pytest.raises(ProtocolError, match="head range"):
        make().lookup(MODEL, [GroupTarget(opaque_layout(2), ())], hashes(1), "a")
    with pytest.raises(ProtocolError, match="head range"):  # world size 0: no rank, no range
        lookup(make(), 0, hashes(1), "a")


def test_lookup_probes_with_plain_tuples_find_chunk_keys() -> None:
    engine = make()
    store(engine, [key(0, 0, world_size=1)])
    assert lookup(engine, 1, [h(0)], "a") == 1
    assert engine.store.inspect().locks_of("a") == [key(0, 0, world_size=1)]
    assert isinstance(engine.store.inspect().locks_of("a")[0], ChunkKey)


# ---------------------------------------------------------------- locks


def test_lookup_locks_hit_keys_of_every_rank() -> None:
    engine = make()
    store_ranks(engine, range(4))
    assert lookup(engine, 2, hashes(2), "a") == 2
    assert sorted(engine.store.inspect().locks_of("a")) == sorted(
        key(i, r) for i in range(2) for r in range(2))
    lookup(engine, 2, hashes(1), "b")
    locks = locks_by_key(engine)
    assert locks[key(0, 0)] == 2
    assert locks[key(1, 1)] == 1
    assert locks[key(3, 0)] == 0
    assert engine.snapshot().engine.locks_held == 6


def test_retrieve_releases_that_ranks_lock_only() -> None:
    engine = make()
    store_ranks(engine, range(3))
    lookup(engine, 2, hashes(3), "a")
    assert retrieve(engine, 0, 2, hashes(3), "a") == []
    assert sorted(engine.store.inspect().locks_of("a")) == sorted(key(i, 1) for i in range(3))
    assert engine.store.free_lookup_locks("a") == 3
    assert engine.store.inspect().locks_of("a") == []
    assert engine.store.free_lookup_locks("a") == 0
    assert engine.snapshot().engine.locks_held == 0


def test_retrieve_of_both_ranks_drops_the_lookup() -> None:
    engine = make()
    store_ranks(engine, range(2))
    lookup(engine, 2, hashes(2), "a")
    retrieve(engine, 0, 2, hashes(2), "a")
    retrieve(engine, 1, 2, hashes(2), "a")
    assert engine.store.free_lookup_locks("a") == 0
    assert all(n == 0 for n in locks_by_key(engine).values())


def test_retrieve_releases_only_its_own_lookup_id() -> None:
    engine = make()
    store_ranks(engine, range(2))
    lookup(engine, 2, hashes(2), "a")
    lookup(engine, 2, hashes(2), "b")
    retrieve(engine, 0, 2, [h(0)], "a")
    retrieve(engine, 0, 2, [h(1)])  # no lookup id: releases nothing
    assert len(engine.store.inspect().locks_of("a")) == 3
    assert len(engine.store.inspect().locks_of("b")) == 4
    assert engine.store.free_lookup_locks("a") == 3
    assert engine.store.free_lookup_locks("b") == 4


def test_relookup_replaces_locks() -> None:
    engine = make()
    store_ranks(engine, range(4))
    lookup(engine, 2, hashes(4), "a")
    lookup(engine, 2, hashes(4), "a")
    assert set(locks_by_key(engine).values()) == {1}
    lookup(engine, 2, hashes(1), "a")
    locks = locks_by_key(engine)
    assert locks[key(0, 0)] == 1
    assert locks[key(3, 1)] == 0
    assert engine.snapshot().engine.locks_held == 2


def test_unlocked_lookup_keeps_existing_locks() -> None:
    engine = make()
    store_ranks(engine, range(2))
    lookup(engine, 2, hashes(2), "a")
    lookup(engine, 2, hashes(2), "a", lock=False)
    assert len(engine.store.inspect().locks_of("a")) == 4


def test_repeated_hash_locks_once() -> None:
    engine = make()
    store(engine, [key(0, 0, world_size=1)])
    assert lookup(engine, 1, [h(0), h(0)], "a") == 2
    assert locks_by_key(engine)[key(0, 0, world_size=1)] == 1
    assert engine.store.free_lookup_locks("a") == 1
    assert locks_by_key(engine)[key(0, 0, world_size=1)] == 0


def test_locks_expire_after_ttl() -> None:
    clock = FakeClock()
    engine = make(ttl=10.0, clock=clock)
    store_ranks(engine, range(2))
    lookup(engine, 2, hashes(2), "a")
    clock.advance(5)
    assert engine.store.expire_locks() == 0
    clock.advance(5)
    assert engine.store.expire_locks() == 4
    assert engine.store.inspect().locks_of("a") == []
    stats = engine.snapshot()
    assert (stats.engine.locks_expired, stats.engine.locks_held) == (4, 0)


def test_relookup_restarts_the_ttl() -> None:
    clock = FakeClock()
    engine = make(ttl=10.0, clock=clock)
    store_ranks(engine, range(2))
    lookup(engine, 2, hashes(2), "a")
    clock.advance(8)
    lookup(engine, 2, hashes(2), "a")
    clock.advance(8)  # the first lock's deadline has passed, the second's has not
    assert engine.store.expire_locks() == 0
    assert len(engine.store.inspect().locks_of("a")) == 4
    clock.advance(2)
    assert engine.store.expire_locks() == 4


def test_lookup_and_store_expire_due_locks_on_the_way() -> None:
    clock = FakeClock()
    engine = make(num_slots=2, ttl=10.0, clock=clock)
    store(engine, [key(0, 0, world_size=1), key(1, 0, world_size=1)])
    lookup(engine, 1, hashes(2), "a")
    clock.advance(11)
    # The pool is full of locked chunks whose locks are due: the store expires them and evicts.
    assert store(engine, [key(7, 0, world_size=1)]).stored == 1
    assert engine.snapshot().engine.locks_expired == 2
    lookup(engine, 1, hashes(1), "b")
    clock.advance(11)
    lookup(engine, 1, [h(7)], "c")
    assert engine.store.inspect().locks_of("b") == []


def test_released_lock_sets_do_not_pile_up_in_the_expiry_heap() -> None:
    engine = make()
    store_ranks(engine, range(2))
    for i in range(1000):
        lookup(engine, 2, hashes(2), f"id{i}")
        engine.store.free_lookup_locks(f"id{i}")
    assert engine.store.inspect().lock_deadlines <= 64 + 2


# ---------------------------------------------------------------- eviction


def test_lru_eviction_takes_least_recently_used() -> None:
    engine = make(num_slots=3)
    for i in range(3):
        store(engine, [key(i, 0, world_size=1)])
    lookup(engine, 1, [h(0)], "a", lock=False)  # 0 becomes most recent; 1 is now the LRU
    store(engine, [key(3, 0, world_size=1)])
    assert not engine.store.inspect().resident(key(1, 0, world_size=1))
    assert engine.store.inspect().resident(key(0, 0, world_size=1))
    assert engine.snapshot().engine.evictions == 1


def test_eviction_eats_a_prefix_from_its_tail() -> None:
    engine = make(num_slots=4)
    store(engine, [key(i, 0, world_size=1) for i in range(4)])
    store(engine, [key(9, 0, world_size=1)])
    assert lookup(engine, 1, hashes(4), "a", lock=False) == 3


def test_eviction_never_takes_a_locked_chunk() -> None:
    engine = make(num_slots=3)
    for i in range(3):
        store(engine, [key(i, 0, world_size=1)])
    lookup(engine, 1, [h(0)], "a")
    for i in range(10, 20):
        store(engine, [key(i, 0, world_size=1)])
    assert engine.store.inspect().resident(key(0, 0, world_size=1))
    engine.store.free_lookup_locks("a")
    store(engine, [key(30, 0, world_size=1), key(31, 0, world_size=1)])
    assert not engine.store.inspect().resident(key(0, 0, world_size=1))


def test_eviction_never_takes_a_chunk_being_read() -> None:
    engine = make(num_slots=2)
    store(engine, [key(0, 0, world_size=1), key(1, 0, world_size=1)])
    plan = begin(engine, 0, 1, [h(0)])
    before = plan.found[0][1][0][0].clone()
    for i in range(10, 15):
        store(engine, [key(i, 0, world_size=1)])
    assert engine.store.inspect().resident(key(0, 0, world_size=1))
    assert torch.equal(plan.found[0][1][0][0], before)
    engine.store.finish_retrieve(plan)
    store(engine, [key(20, 0, world_size=1), key(21, 0, world_size=1)])
    assert not engine.store.inspect().resident(key(0, 0, world_size=1))


def test_full_pool_of_locked_chunks_skips_without_raising() -> None:
    engine = make(num_slots=2)
    store_ranks(engine, [0])
    lookup(engine, 2, hashes(1), "a")
    reply = store(engine, [key(5, 0), key(6, 0), key(0, 0)])
    assert (reply.stored, reply.already_present, reply.skipped_full) == (0, 1, 2)
    stats = engine.snapshot()
    assert (stats.engine.store_skipped_full, stats.engine.evictions) == (2, 0)
    assert engine.pool.num_allocated == 2
    assert stats.engine.stores == 3


def test_partial_room_stores_the_head_first() -> None:
    engine = make(num_slots=3)
    store(engine, [key(0, 0, world_size=1)])
    lookup(engine, 1, [h(0)], "a")
    reply = store(engine, [key(i, 0, world_size=1) for i in range(1, 5)])
    assert (reply.stored, reply.skipped_full) == (2, 2)
    assert lookup(engine, 1, hashes(5), "b", lock=False) == 3


def test_slots_being_written_are_not_evicted() -> None:
    engine = make(num_slots=2)
    pending = engine.store.begin_store([key(0, 0), key(1, 0)], SLOT)
    assert store(engine, [key(2, 0)]).skipped_full == 1
    engine.store.finish_store(pending)
    assert engine.store.inspect().resident(key(0, 0))


# ---------------------------------------------------------------- store and retrieve


def test_bytes_round_trip_through_slot_views() -> None:
    engine = make()
    keys = [key(i, 0) for i in range(3)]
    data = [torch.randint(0, 256, (20,), dtype=torch.uint8) for _ in keys]
    plan = engine.store.begin_store(keys, 20)
    for index, _, view in plan.writes:
        assert view.shape == (20,)
        view.copy_(data[index])
    engine.store.finish_store(plan)
    out = begin(engine, 0, 2, [h(9), *hashes(3)])
    assert out.missing == [0]
    assert [index for index, _ in out.found] == [1, 2, 3]
    for position, (index, sources) in enumerate(out.found):
        assert out.is_exact(position)
        [(view, lo, hi)] = sources
        assert (lo, hi) == (keys[index - 1].head_lo, keys[index - 1].head_hi)
        assert torch.equal(view, data[index - 1])
    engine.store.finish_retrieve(out)
    stats = engine.snapshot()
    assert (stats.engine.retrieves, stats.engine.retrieved_chunks, stats.engine.retrieve_missing) == (1, 3, 1)
    assert (stats.engine.chunks, stats.engine.bytes_used, stats.engine.stored_chunks) == (3, 60, 3)


def test_store_twice_is_harmless() -> None:
    engine = make()
    assert store(engine, [key(0, 0), key(1, 0)]).stored == 2
    reply = store(engine, [key(0, 0), key(1, 0), key(2, 0)])
    assert (reply.stored, reply.already_present) == (1, 2)
    stats = engine.snapshot()
    assert (stats.engine.chunks, engine.pool.num_allocated, stats.engine.stored_chunks) == (3, 3, 3)


def test_repeated_key_in_one_store_takes_one_slot() -> None:
    engine = make()
    reply = store(engine, [key(0, 0), key(0, 0)])
    assert (reply.stored, reply.already_present) == (1, 1)
    assert engine.pool.num_allocated == 1


def test_chunk_is_invisible_until_finish_store() -> None:
    engine = make()
    plan = engine.store.begin_store([key(0, 0, world_size=1)], SLOT)
    assert lookup(engine, 1, [h(0)], "a") == 0
    assert begin(engine, 0, 1, [h(0)]).missing == [0]
    assert engine.store.begin_store([key(0, 0, world_size=1)], SLOT).already_present == 1
    assert engine.snapshot().engine.chunks == 0
    engine.store.finish_store(plan)
    assert lookup(engine, 1, [h(0)], "a") == 1


def test_failed_store_frees_its_slots() -> None:
    engine = make(num_slots=4)
    plan = engine.store.begin_store([key(i, 0) for i in range(4)], SLOT)
    assert (engine.pool.num_allocated, engine.pool.free_slabs) == (4, 0)
    engine.store.finish_store(plan, ok=False)
    engine.store.finish_store(plan)  # a second finish does nothing
    assert (engine.pool.num_allocated, engine.pool.free_slabs) == (0, 4)
    assert lookup(engine, 2, [h(0)], "a") == 0
    assert not engine.store.inspect().resident(key(0, 0))
    assert store(engine, [key(0, 0)]).stored == 1  # the key can be stored again


def test_finish_retrieve_twice_does_nothing() -> None:
    engine = make()
    store_ranks(engine, [0])
    lookup(engine, 2, hashes(1), "a")
    plan = begin(engine, 0, 2, hashes(1), "a")
    engine.store.finish_retrieve(plan)
    engine.store.finish_retrieve(plan)
    assert engine.store.inspect().locks_of("a") == [key(0, 1)]
    assert engine.store.clear() == (1, 1)


def test_store_refuses_chunks_larger_than_the_pool() -> None:
    engine = make()
    whole = engine.pool.nbytes  # 32 units of SLOT rounded up to the pool's 64-byte classes
    with pytest.raises(IncompatibleError, match=rf"{whole + 1}.*{whole}.*server.pool_size"):
        engine.store.begin_store([key(0, 0)], whole + 1)
    with pytest.raises(IncompatibleError):
        engine.store.begin_store([key(0, 0)], 0)
    assert engine.pool.num_allocated == 0
    assert store(engine, [key(1, 0)], nbytes=3 * SLOT).stored == 1  # 96 bytes: an extent of 2 units
    assert store(engine, [key(0, 0)], nbytes=whole).stored == 1  # the whole pool: evicts it
    assert engine.snapshot().engine.evictions == 1 and engine.pool.free_slabs == 0


# ---------------------------------------------------------------- admin


def test_clear_keeps_locked_and_read_chunks_unless_forced() -> None:
    engine = make()
    store_ranks(engine, range(3))
    lookup(engine, 2, hashes(1), "a")  # locks chunk 0 of both ranks
    reading = begin(engine, 0, 2, [h(2)])
    assert engine.store.clear() == (3, 3)
    assert engine.store.clear(force=True) == (2, 1)
    assert engine.store.inspect().locks_of("a") == []
    assert engine.snapshot().engine.locks_held == 0
    assert engine.store.inspect().resident(key(2, 0))
    engine.store.finish_retrieve(reading)
    assert engine.store.clear() == (1, 0)
    stats = engine.snapshot()
    assert (stats.engine.chunks, stats.engine.pool_bytes_allocated, stats.engine.bytes_used) == (0, 0, 0)
    assert stats.engine.pool_slabs_free == stats.engine.pool_slabs


def test_forced_clear_forgets_locks_so_a_restored_key_is_unlocked() -> None:
    engine = make()
    store_ranks(engine, [0])
    lookup(engine, 2, hashes(1), "a")
    engine.store.clear(force=True)
    store_ranks(engine, [0])
    assert engine.store.free_lookup_locks("a") == 0
    assert set(locks_by_key(engine).values()) == {0}


def test_list_chunks_sorts_filters_and_limits() -> None:
    clock = FakeClock()
    engine = make(clock=clock)
    store(engine, [key(0, 0, world_size=1)], nbytes=8)
    clock.advance(1)
    store(engine, [key(1, 0, world_size=1)], nbytes=16)
    clock.advance(1)
    store(engine, [key(2, 0, world_size=1, model="other")], nbytes=4)
    clock.advance(1)
    for _ in range(3):
        lookup(engine, 1, [h(0)], "x", lock=False)
    lookup(engine, 1, hashes(2), "y")

    rows, total = memory_rows(engine.store, sort="age")
    assert total == 3
    assert [r.chunk_hash[0] for r in rows] == [2, 1, 0]
    assert [r.age_s for r in rows] == [1.0, 2.0, 3.0]
    rows, _ = memory_rows(engine.store, sort="hits")
    assert [(r.chunk_hash[0], r.hits) for r in rows] == [(0, 4), (1, 1), (2, 0)]
    rows, _ = memory_rows(engine.store, sort="size")
    assert [r.nbytes for r in rows] == [16, 8, 4]
    rows, total = memory_rows(engine.store, model_name=MODEL, sort="key", limit=1)
    assert total == 2
    assert len(rows) == 1
    row = rows[0]
    assert (row.chunk_hash, row.model_name, row.layout) == (h(0), MODEL, opaque_layout(1))
    assert (row.head_lo, row.head_hi) == (0, 1)
    assert (row.locks, row.nbytes) == (1, 8)
    assert memory_rows(engine.store, limit=0) == ([], 3)
    with pytest.raises(ProtocolError, match="sort"):
        memory_rows(engine.store, sort="bogus")


def test_key_sort_keeps_ranks_of_a_chunk_together() -> None:
    engine = make()
    store(engine, [key(1, 1), key(0, 1)])
    store(engine, [key(1, 0), key(0, 0)])
    rows, _ = memory_rows(engine.store, sort="key")
    assert [(r.chunk_hash[0], r.head_lo) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_snapshot_fills_the_engine_section() -> None:
    engine = make(num_slots=8)
    store_ranks(engine, range(2))
    stats = engine.snapshot().engine
    assert (stats.chunks, stats.pool_slabs, stats.pool_slabs_free, stats.bytes_used) == (4, 8, 4, 128)
    assert stats.pool_bytes_allocated == 4 * engine.pool.slab_bytes


def test_constructor_validates() -> None:
    pool = MemoryPool.slots(SLOT, 2, pin=False)
    with pytest.raises(ValueError):
        CacheEngine(pool, chunk_size=0)
    with pytest.raises(ValueError):
        CacheEngine(pool, chunk_size=16, lock_ttl_s=0)


@pytest.mark.perf  # real latency: deselected by default (about 350 us here, 2 cores)
def test_lookup_is_fast() -> None:
    """64 chunks x 2 ranks, all hits, with locking: well under 100 us (bound loose for CI noise)."""
    pool = MemoryPool.slots(SLOT, 256, pin=False)
    engine = CacheEngine(pool, chunk_size=16)
    chain = [bytes([i, 7]) * 16 for i in range(64)]
    for rank in range(2):
        keys = [ChunkKey(MODEL, opaque_layout(2), rank, rank + 1, c) for c in chain]
        engine.store.finish_store(engine.store.begin_store(keys, 8))
    ranges = world_heads(opaque_layout(2), 2)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            assert engine.lookup(MODEL, [GroupTarget(opaque_layout(2), tuple(ranges))], chain, "bench") == 64
        best = min(best, (time.perf_counter() - start) / 200)
    print(f"lookup 64 chunks x 2 ranks: {best * 1e6:.1f} us")
    assert best < 3e-3  # 10x what it takes on this machine: catches a per-key Python slide


# ---------------------------------------------------------------- pieces of a real layout
# H = 8 KV heads: TP=1 stores one piece [0, 8), TP=2 pieces [0, 4) and [4, 8), TP=4 [0, 2) ...

def tp_pieces(chunks: Sequence[int], world_size: int, layout: str = F16) -> list[ChunkKey]:
    return [piece(i, lo, hi, layout) for i in chunks for lo, hi in world_heads(layout, world_size)]


def heads_of(plan: RetrievePlan) -> list[list[HeadRange]]:
    """Per found chunk, the head ranges of the pieces to copy out of."""
    return [[(lo, hi) for _, lo, hi in sources] for _, sources in plan.found]


def test_layout_fingerprints() -> None:
    assert (F16, BF16, MLA) == ("float16:2x8x16", "bfloat16:2x8x16", "bfloat16:2xmla64")
    assert world_heads(F16, 2) == ((0, 4), (4, 8))
    assert world_heads(MLA, 4) == ((0, 1),)


def test_tp2_pieces_count_for_tp1_and_tp4_lookups() -> None:
    engine = make()
    store(engine, tp_pieces(range(3), 2))
    for world_size in (1, 2, 4, 8):
        assert lookup(engine, world_size, hashes(4), "a", lock=False, layout=F16) == 3
    whole = begin(engine, 0, 1, hashes(3), layout=F16)  # TP=1: both pieces, head-range copies
    assert heads_of(whole) == [[(0, 4), (4, 8)]] * 3
    assert not any(whole.is_exact(p) for p in range(3))
    same = begin(engine, 1, 2, hashes(3), layout=F16)  # TP=2 rank 1: its own piece
    assert heads_of(same) == [[(4, 8)]] * 3
    assert all(same.is_exact(p) for p in range(3))
    part = begin(engine, 1, 4, hashes(3), layout=F16)  # TP=4 rank 1: heads [2, 4) of [0, 4)
    assert part.heads == (2, 4) and heads_of(part) == [[(0, 4)]] * 3
    assert not part.is_exact(0)
    for plan in (whole, same, part):
        assert plan.missing == []
        for index, sources in plan.found:  # each piece's own bytes: chunk + its head_lo
            for view, lo, _ in sources:
                assert bool((view == index + lo).all())
        engine.store.finish_retrieve(plan)
    assert engine.snapshot().engine.retrieved_chunks == 9


def test_one_tp1_piece_counts_for_tp2_and_tp4() -> None:
    engine = make()
    store(engine, tp_pieces(range(2), 1))
    for world_size in (1, 2, 4):
        assert lookup(engine, world_size, hashes(2), "a", lock=False, layout=F16) == 2
    for world_size in (2, 4):
        for rank in range(world_size):
            plan = begin(engine, rank, world_size, hashes(2), layout=F16)
            assert heads_of(plan) == [[(0, 8)]] * 2
            assert not plan.is_exact(0) and plan.heads == rank_heads(F16, world_size, rank)
            engine.store.finish_retrieve(plan)
    plan = begin(engine, 0, 1, hashes(2), layout=F16)
    assert plan.is_exact(0) and plan.is_exact(1)
    engine.store.finish_retrieve(plan)


def test_pieces_of_different_tp_sizes_cover_together() -> None:
    engine = make()
    store(engine, [piece(0, 0, 2), piece(0, 2, 4), piece(0, 4, 8)])  # TP=4, TP=4, TP=2
    assert lookup(engine, 1, [h(0)], "a", lock=False, layout=F16) == 1
    assert lookup(engine, 2, [h(0)], "a", lock=False, layout=F16) == 1
    plan = begin(engine, 0, 1, [h(0)], layout=F16)
    assert heads_of(plan) == [[(0, 2), (2, 4), (4, 8)]]
    engine.store.finish_retrieve(plan)
    plan = begin(engine, 0, 2, [h(0)], layout=F16)
    assert heads_of(plan) == [[(0, 2), (2, 4)]] and not plan.is_exact(0)
    engine.store.finish_retrieve(plan)


def test_a_chunk_missing_one_ranks_heads_is_not_counted() -> None:
    engine = make()
    store(engine, tp_pieces([0, 1, 3], 2))
    store(engine, [piece(2, 0, 4)])  # chunk 2 lacks heads [4, 8)
    for world_size in (1, 2, 4):
        assert lookup(engine, world_size, hashes(4), "a", layout=F16) == 2  # the prefix stops
    assert lookup(engine, 1, [h(2)], "a", layout=F16) == 0
    assert engine.lookup(MODEL, [GroupTarget(F16, ((0, 4),))], hashes(4), "a") == 4  # rank 0 alone has it all
    assert engine.lookup(MODEL, [GroupTarget(F16, ((2, 4),))], hashes(4), "a") == 4
    low = begin(engine, 0, 2, hashes(4), layout=F16)
    assert (low.missing, heads_of(low)) == ([], [[(0, 4)]] * 4)
    high = begin(engine, 1, 2, hashes(4), layout=F16)
    assert high.missing == [2]
    assert [index for index, _ in high.found] == [0, 1, 3]
    whole = begin(engine, 0, 1, hashes(4), layout=F16)
    assert whole.missing == [2] and heads_of(whole) == [[(0, 4), (4, 8)]] * 3
    for plan in (low, high, whole):
        engine.store.finish_retrieve(plan)


def test_tp1_piece_locked_by_a_tp2_lookup_stays_locked_until_both_ranks_read() -> None:
    engine = make(num_slots=3)
    whole = [piece(i, 0, 8) for i in range(2)]
    store(engine, whole)
    assert lookup(engine, 2, hashes(2), "a", layout=F16) == 2
    assert sorted(engine.store.inspect().locks_of("a")) == sorted(whole)  # each piece once
    assert [locks_by_key(engine)[k] for k in whole] == [2, 2]  # once per rank's range
    assert engine.snapshot().engine.locks_held == 4
    assert retrieve(engine, 0, 2, hashes(2), "a", layout=F16) == []
    assert [locks_by_key(engine)[k] for k in whole] == [1, 1]
    assert sorted(engine.store.inspect().locks_of("a")) == sorted(whole)
    # Still locked: a full pool evicts nothing of it.
    reply = store(engine, [piece(i, 0, 8) for i in range(10, 13)])
    assert (reply.stored, reply.skipped_full) == (1, 2)
    assert all(engine.store.inspect().resident(k) for k in whole)
    assert retrieve(engine, 0, 2, hashes(2), "a", layout=F16) == []  # rank 0 again: no change
    assert [locks_by_key(engine)[k] for k in whole] == [1, 1]
    assert retrieve(engine, 1, 2, hashes(2), "a", layout=F16) == []
    assert engine.store.inspect().locks_of("a") == [] and engine.snapshot().engine.locks_held == 0
    assert engine.store.free_lookup_locks("a") == 0
    assert store(engine, [piece(i, 0, 8) for i in range(20, 23)]).stored == 3
    assert not any(engine.store.inspect().resident(k) for k in whole)


def test_tp2_pieces_locked_by_a_tp1_lookup_are_released_by_its_one_retrieve() -> None:
    engine = make()
    store(engine, tp_pieces(range(2), 2))
    assert lookup(engine, 1, hashes(2), "a", layout=F16) == 2
    assert len(engine.store.inspect().locks_of("a")) == 4
    assert retrieve(engine, 0, 1, hashes(2), "a", layout=F16) == []
    assert engine.store.inspect().locks_of("a") == [] and engine.snapshot().engine.locks_held == 0


def test_another_layout_of_the_same_model_never_hits() -> None:
    """float16 and bfloat16 pieces of one model, one chunk hash, one head range: different bytes,
    so a bfloat16 engine must never be handed float16 pieces (silently wrong tokens)."""
    engine = make()
    plan = engine.store.begin_store(tp_pieces(range(2), 2, F16), SLOT)
    for _, _, view in plan.writes:
        view.fill_(16)
    engine.store.finish_store(plan)
    for world_size in (1, 2, 4):
        assert lookup(engine, world_size, hashes(2), "a", layout=BF16) == 0
    assert engine.store.inspect().locks_of("a") == []
    bf = begin(engine, 0, 2, hashes(2), layout=BF16)
    assert bf.missing == [0, 1] and bf.found == []
    engine.store.finish_retrieve(bf)
    plan = engine.store.begin_store(tp_pieces(range(2), 2, BF16), SLOT)
    assert (plan.stored, plan.already_present) == (4, 0)  # not "covered" by the float16 pieces
    for _, _, view in plan.writes:
        view.fill_(99)
    engine.store.finish_store(plan)
    assert sorted(engine.store.layouts(MODEL)) == [BF16, F16]
    for layout, value in ((F16, 16), (BF16, 99)):
        got = begin(engine, 1, 2, hashes(2), layout=layout)
        assert all(bool((view == value).all()) for _, sources in got.found for view, _, _ in sources)
        engine.store.finish_retrieve(got)
    assert lookup(engine, 2, hashes(2), "b", layout=opaque_layout(2)) == 0


def test_mla_one_piece_counts_for_any_world_size() -> None:
    engine = make()
    store(engine, [piece(i, 0, 1, MLA) for i in range(3)])
    for world_size in (1, 2, 4, 8):
        assert lookup(engine, world_size, hashes(4), "a", layout=MLA) == 3
    assert len(engine.store.inspect().locks_of("a")) == 3 and engine.snapshot().engine.locks_held == 3
    plan = begin(engine, 3, 8, hashes(3), "a", layout=MLA)
    assert plan.heads == (0, 1) and heads_of(plan) == [[(0, 1)]] * 3
    assert all(plan.is_exact(p) for p in range(3))
    engine.store.finish_retrieve(plan)
    assert engine.store.inspect().locks_of("a") == []
    assert store(engine, [piece(0, 0, 1, MLA)]).already_present == 1


def test_storing_a_range_already_covered_is_already_present() -> None:
    engine = make()
    store(engine, tp_pieces([0], 2))
    reply = store(engine, [piece(0, 0, 8), piece(0, 2, 4), piece(0, 4, 6)])  # TP=1, TP=4 pieces
    assert (reply.stored, reply.already_present) == (0, 3)
    store(engine, [piece(1, 0, 8)])
    reply = store(engine, tp_pieces([1], 2))
    assert (reply.stored, reply.already_present) == (0, 2)
    store(engine, [piece(2, 0, 4)])
    reply = store(engine, [piece(2, 0, 8)])  # [4, 8) is not held: the whole piece is stored
    assert (reply.stored, reply.already_present) == (1, 0)
    assert engine.snapshot().engine.chunks == 5


def test_per_model_quota_evicts_the_models_own_oldest_pieces() -> None:
    engine = CacheEngine(MemoryPool.slots(SLOT, 8, pin=False), chunk_size=16,
                         clock=FakeClock(), quotas={"a": 3 * SLOT})
    b_keys = [key(i, 0, world_size=1, model="b") for i in range(2)]
    store(engine, b_keys)  # the least recently used pieces of all
    a_keys = [key(i, 0, world_size=1, model="a") for i in range(4)]
    for k in a_keys[:3]:
        store(engine, [k])
    assert engine.snapshot().engine.evictions == 0
    assert store(engine, [a_keys[3]]).stored == 1
    assert [engine.store.inspect().resident(k) for k in a_keys] == [False, True, True, True]
    assert all(engine.store.inspect().resident(k) for k in b_keys)
    stats = engine.snapshot()
    assert (stats.engine.evictions, stats.engine.store_skipped_quota, stats.engine.chunks) == (1, 0, 5)
    by_model = {row.model_name: row for row in model_stats(engine)}
    assert (by_model["a"].bytes_used, by_model["a"].quota_bytes) == (3 * SLOT, 3 * SLOT)
    assert (by_model["b"].bytes_used, by_model["b"].quota_bytes) == (2 * SLOT, None)
    # All of a's pieces locked: its next store is refused, b's pieces are still not taken.
    assert lookup(engine, 1, [h(1), h(2), h(3)], "lock", model="a") == 3
    reply = store(engine, [key(9, 0, world_size=1, model="a")])
    assert (reply.stored, reply.skipped_quota, reply.skipped_full) == (0, 1, 0)
    assert engine.snapshot().engine.store_skipped_quota == 1
    assert all(engine.store.inspect().resident(k) for k in b_keys)
    assert store(engine, [key(9, 0, world_size=1, model="b")]).stored == 1  # b has no quota


SLAB = 1024
X, Y = 256, 512  # model A's piece size (4 per slab), model B's (2 per slab)


def slab_engine() -> tuple[CacheEngine, list[ChunkKey], dict[ChunkKey, torch.Tensor]]:
    """A real slab pool of 4 slabs filled by model A: 16 pieces of X bytes, stored one by one
    (so piece i is the i-th least recently used and lives in slab i // 4)."""
    engine = CacheEngine(MemoryPool(4 * SLAB, slab_bytes=SLAB, pin=False), chunk_size=16,
                         clock=FakeClock())
    gen = torch.Generator().manual_seed(7)
    a_keys = [piece(i, 0, 8, model="A") for i in range(16)]
    data: dict[ChunkKey, torch.Tensor] = {}
    for k in a_keys:
        data[k] = put(engine, k, X, gen)
    assert engine.pool.free_slabs == 0 and engine.pool.class_stats() == {X: (4, 16)}
    pieces = engine.store.inspect().pieces
    assert [engine.pool.slab_of(pieces[k].handle) for k in a_keys] == [i // 4 for i in range(16)]
    return engine, a_keys, data


def put(engine: CacheEngine, k: ChunkKey, nbytes: int, gen: torch.Generator) -> torch.Tensor:
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    plan = engine.store.begin_store([k], nbytes)
    assert plan.stored == 1, plan
    plan.writes[0][2].copy_(payload)
    engine.store.finish_store(plan)
    return payload


def check_bytes(engine: CacheEngine, data: dict[ChunkKey, torch.Tensor]) -> None:
    """Every resident piece of ``data`` reads back byte-exact."""
    for k, payload in data.items():
        if not engine.store.inspect().resident(k):
            continue
        plan = engine.store.begin_retrieve(k.model_name, k.layout, (k.head_lo, k.head_hi),
                                     [k.chunk_hash])
        [(_, [(view, lo, hi)])] = plan.found
        assert (lo, hi) == (k.head_lo, k.head_hi)
        assert torch.equal(view, payload), k.short()
        engine.store.finish_retrieve(plan)


def test_eviction_across_size_classes_takes_whole_lru_slabs() -> None:
    engine, a_keys, data = slab_engine()
    gen = torch.Generator().manual_seed(8)
    b_keys = [piece(i, 0, 8, layout=BF16, model="B") for i in range(5)]
    data[b_keys[0]] = put(engine, b_keys[0], Y, gen)
    # A's least recently used slab (pieces 0-3) went whole; nothing else did.
    assert [engine.store.inspect().resident(k) for k in a_keys] == [False] * 4 + [True] * 12
    assert engine.snapshot().engine.evictions == 4
    assert engine.pool.class_stats() == {X: (3, 12), Y: (1, 1)}
    data[b_keys[1]] = put(engine, b_keys[1], Y, gen)  # the second slot of B's slab: no eviction
    assert engine.snapshot().engine.evictions == 4
    check_bytes(engine, data)
    # A lookup makes A's pieces 4-7 the most recently used: the next slab to go is 8-11's.
    assert lookup(engine, 1, [h(4), h(5), h(6), h(7)], "x", lock=False, model="A",
                  layout=F16) == 4
    data[b_keys[2]] = put(engine, b_keys[2], Y, gen)
    assert [engine.store.inspect().resident(k) for k in a_keys[4:]] == [True] * 4 + [False] * 4 + [True] * 4
    assert engine.pool.class_stats() == {X: (2, 8), Y: (2, 3)}
    check_bytes(engine, data)
    stats = engine.snapshot()
    assert (stats.engine.chunks, stats.engine.bytes_used) == (11, 8 * X + 3 * Y)
    assert stats.engine.pool_bytes_allocated == 8 * X + 3 * Y and stats.engine.pool_slabs_free == 0


def test_a_slab_holding_a_locked_piece_is_never_taken() -> None:
    engine, a_keys, data = slab_engine()
    gen = torch.Generator().manual_seed(9)
    # Lock piece 1 (slab 0, the least recently used slab after the lookup's touch of it).
    assert engine.lookup("A", [GroupTarget(F16, ((0, 8),))], [h(1)], "held") == 1
    b0 = piece(0, 0, 8, layout=BF16, model="B")
    data[b0] = put(engine, b0, Y, gen)
    assert [engine.store.inspect().resident(k) for k in a_keys[:8]] == [True] * 4 + [False] * 4  # slab 1 went
    check_bytes(engine, data)
    # A locked piece in every slab: B finds no room, and nothing is evicted.
    assert engine.lookup("A", [GroupTarget(F16, ((0, 8),))], [h(8)], "held2") == 1
    assert engine.lookup("A", [GroupTarget(F16, ((0, 8),))], [h(12)], "held3") == 1
    b_more = [piece(i, 0, 8, layout=BF16, model="B") for i in range(1, 4)]
    data[b_more[0]] = put(engine, b_more[0], Y, gen)  # B's own slab still has a free slot
    assert engine.lookup("B", [GroupTarget(BF16, ((0, 8),))], [h(0), h(1)], "heldB") == 2  # B's slab is full
    evictions = engine.snapshot().engine.evictions
    plan = engine.store.begin_store(b_more[1:], Y)
    assert (plan.stored, plan.skipped_full) == (0, 2)
    engine.store.finish_store(plan)
    assert engine.snapshot().engine.evictions == evictions
    assert sum(engine.store.inspect().resident(k) for k in a_keys) == 12
    check_bytes(engine, data)
    # Unlocked, slab 0 can go: its four pieces make room for two of B's.
    engine.store.free_lookup_locks("held")
    plan = engine.store.begin_store(b_more[1:], Y)
    assert plan.stored == 2
    engine.store.finish_store(plan)
    assert not any(engine.store.inspect().resident(k) for k in a_keys[:4])
    assert engine.store.inspect().resident(a_keys[8]) and engine.store.inspect().resident(a_keys[12])


# ---------------------------------------------------------------- found by review (fixed)


def test_a_locking_lookup_that_misses_holds_nothing() -> None:
    engine = make()
    store_ranks(engine, range(2))
    for i in range(100):
        assert lookup(engine, 2, [h(50), h(0)], f"miss{i}") == 0
    assert engine.snapshot().engine.locks_held == 0
    inspection = engine.store.inspect()
    assert (inspection.locks, inspection.lock_deadlines) == ({}, 0)


def test_quota_counts_only_the_models_own_pending_pieces() -> None:
    engine = CacheEngine(MemoryPool.slots(SLOT, 8, pin=False), chunk_size=16, clock=FakeClock(),
                         quotas={"a": 3 * SLOT})
    keys = [key(i, 0, world_size=1, model="b") for i in range(3)]
    reply = store(engine, [*keys, key(0, 0, world_size=1, model="a")])
    assert (reply.stored, reply.skipped_full) == (4, 0)
    assert engine.snapshot().engine.store_skipped_quota == 0


def test_one_store_over_the_quota_keeps_the_head_of_the_prefix() -> None:
    engine = CacheEngine(MemoryPool.slots(SLOT, 8, pin=False), chunk_size=16, clock=FakeClock(),
                         quotas={"a": 3 * SLOT})
    keys = [key(i, 0, world_size=1, model="a") for i in range(5)]
    reply = store(engine, keys)
    assert (reply.stored, reply.skipped_quota, reply.skipped_full) == (3, 2, 0)
    assert [engine.store.inspect().resident(k) for k in keys] == [True] * 3 + [False] * 2
    assert engine.snapshot().engine.evictions == 0


def test_store_skipped_quota_counts_every_refused_piece() -> None:
    engine = CacheEngine(MemoryPool.slots(SLOT, 8, pin=False), chunk_size=16, clock=FakeClock(),
                         quotas={"a": 3 * SLOT})
    reply = store(engine, [key(i, 0, world_size=1, model="a") for i in range(5)])
    assert (reply.skipped_quota, reply.skipped_full) == (2, 0)
    assert engine.snapshot().engine.store_skipped_quota == 2


def test_a_quota_that_cannot_make_room_evicts_nothing() -> None:
    engine = CacheEngine(MemoryPool.slots(SLOT, 8, pin=False), chunk_size=16, clock=FakeClock(),
                         quotas={"a": 3 * SLOT})
    keys = [key(i, 0, world_size=1, model="a") for i in range(3)]
    for k in keys:
        store(engine, [k])
    assert lookup(engine, 1, [h(1), h(2)], "held", model="a") == 2
    reply = store(engine, [key(9, 0, world_size=1, model="a")], nbytes=2 * SLOT)
    assert (reply.stored, reply.skipped_quota) == (0, 1)  # 2 locked + 2 new pieces' worth > 3
    assert all(engine.store.inspect().resident(k) for k in keys)
    assert engine.snapshot().engine.evictions == 0
