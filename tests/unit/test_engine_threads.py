"""CacheEngine under concurrent lookups, stores and retrieves: no leak, no torn read, locks hold."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from lmcache_core.engine import CacheEngine, GroupTarget, RetrievePlan
from lmcache_core.keys import ChunkKey, layout_key, opaque_layout, world_heads
from lmcache_core.server.listing import memory_rows
from lmcache_core.storage.pool import MemoryPool

MODEL = "m"
WORLD = 2
DOCS = 6
CHUNKS = 8
SLOT = 64
LAYOUT = opaque_layout(WORLD)  # rank r's pieces hold "heads" (r, r + 1)
RANGES = world_heads(LAYOUT, WORLD)
F16 = layout_key("float16", 2, 8, 16, False)  # 8 heads: pieces of TP=1, 2 and 4 mix


def chunk_hash(doc: int, i: int) -> bytes:
    return bytes([doc, i]) * 16


def pattern(key: ChunkKey) -> int:
    return (key.chunk_hash[0] * CHUNKS + key.chunk_hash[1] + key.head_lo * 64 + key.head_hi * 16) % 256


def check_read(plan: RetrievePlan, chain: list[bytes], layout: str = LAYOUT) -> None:
    for index, sources in plan.found:
        for view, lo, hi in sources:
            key = ChunkKey(MODEL, layout, lo, hi, chain[index])
            copy = view.clone()
            assert bool((copy == pattern(key)).all()), f"torn or foreign bytes in {key.short()}"


def unlocked_read(engine: CacheEngine, chain: list[bytes], rng: random.Random) -> None:
    """A retrieve with no lookup: only its reader pin keeps the slots from being reused."""
    rank = rng.randrange(WORLD)
    plan = engine.store.begin_retrieve(MODEL, LAYOUT, (rank, rank + 1), chain)
    time.sleep(0.0005)  # a slow copy: other threads store (and would evict) meanwhile
    check_read(plan, chain)
    engine.store.finish_retrieve(plan)


def client(engine: CacheEngine, seed: int, deadline: float, strict: bool,
           errors: list[BaseException]) -> None:
    rng = random.Random(seed)
    try:
        step = 0
        while time.monotonic() < deadline:
            step += 1
            lookup_id = f"{seed}-{step}"
            doc = rng.randrange(DOCS)
            chain = [chunk_hash(doc, i) for i in range(rng.randint(1, CHUNKS))]
            if rng.random() < 0.2:
                unlocked_read(engine, chain, rng)
            hits = engine.lookup(MODEL, [GroupTarget(LAYOUT, tuple(RANGES))], chain, lookup_id)
            for rank in range(WORLD):
                keys = [ChunkKey(MODEL, LAYOUT, rank, rank + 1, c) for c in chain]
                if rank == 1 and rng.random() < 0.3:
                    released = engine.store.free_lookup_locks(lookup_id)  # rank 1 never came to retrieve
                    assert not strict or released == hits
                else:
                    plan = engine.store.begin_retrieve(MODEL, LAYOUT, (rank, rank + 1), chain[:hits],
                                                 lookup_id)
                    assert not strict or plan.missing == [], "a locked chunk went missing"
                    check_read(plan, chain)
                    engine.store.finish_retrieve(plan)
                store = engine.store.begin_store(keys[hits:], SLOT)
                for _, key, view in store.writes:
                    view.fill_(pattern(key))
                engine.store.finish_store(store, ok=rng.random() > 0.1)
            engine.store.free_lookup_locks(lookup_id)
    except BaseException as exc:  # pragma: no cover - reported by the test
        errors.append(exc)


def mixed_client(engine: CacheEngine, seed: int, deadline: float, strict: bool,
                 errors: list[BaseException]) -> None:
    """Clients of TP=1, 2 and 4 on one real layout: each reads pieces the others stored."""
    rng = random.Random(seed)
    try:
        step = 0
        while time.monotonic() < deadline:
            step += 1
            lookup_id = f"{seed}-{step}"
            doc = rng.randrange(DOCS)
            chain = [chunk_hash(doc, i) for i in range(rng.randint(1, CHUNKS))]
            ranges = world_heads(F16, rng.choice((1, 2, 4)))
            if rng.random() < 0.2:  # an unlocked read: only its reader pin holds the pieces
                plan = engine.store.begin_retrieve(MODEL, F16, rng.choice(ranges), chain)
                time.sleep(0.0005)
                check_read(plan, chain, F16)
                engine.store.finish_retrieve(plan)
            hits = engine.lookup(MODEL, [GroupTarget(F16, tuple(ranges))], chain, lookup_id)
            for rank, heads in enumerate(ranges):
                if rank and rank == len(ranges) - 1 and rng.random() < 0.3:
                    engine.store.free_lookup_locks(lookup_id)  # the last rank never came to retrieve
                    assert not strict or engine.store.inspect().locks_of(lookup_id) == []
                else:
                    plan = engine.store.begin_retrieve(MODEL, F16, heads, chain[:hits], lookup_id)
                    assert not strict or plan.missing == [], "a locked chunk went missing"
                    check_read(plan, chain, F16)
                    engine.store.finish_retrieve(plan)
                store = engine.store.begin_store([ChunkKey(MODEL, F16, *heads, c)
                                            for c in chain[hits:]], SLOT)
                for _, key, view in store.writes:
                    view.fill_(pattern(key))
                engine.store.finish_store(store, ok=rng.random() > 0.1)
            assert not strict or engine.store.inspect().locks_of(lookup_id) == [], \
                "a retrieve left locks"
            engine.store.free_lookup_locks(lookup_id)
    except BaseException as exc:  # pragma: no cover - reported by the test
        errors.append(exc)


def admin(engine: CacheEngine, deadline: float, force: bool, errors: list[BaseException]) -> None:
    rng = random.Random(99)
    try:
        while time.monotonic() < deadline:
            engine.snapshot()
            engine.store.inspect()
            memory_rows(engine.store, limit=10, sort=rng.choice(["age", "hits", "size", "key"]))
            engine.store.expire_locks()
            if rng.random() < 0.2:
                engine.store.clear(force=force and rng.random() < 0.5)
            time.sleep(0.005)
    except BaseException as exc:  # pragma: no cover - reported by the test
        errors.append(exc)


def run_stress(force: bool, seconds: float = 0.6, target: Callable[..., None] = client,
               ) -> CacheEngine:
    # 20 slots for 6 docs x 8 chunks x 2 ranks = 96 keys: stores evict all the time.
    engine = CacheEngine(MemoryPool.slots(SLOT, 20, pin=False), chunk_size=16)
    deadline = time.monotonic() + seconds
    errors: list[BaseException] = []
    threads = [threading.Thread(target=target, args=(engine, seed, deadline, not force, errors))
               for seed in range(4)]
    threads.append(threading.Thread(target=admin, args=(engine, deadline, force, errors)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors[0]
    check_invariants(engine)
    return engine


def check_invariants(engine: CacheEngine) -> None:
    pool, state = engine.pool, engine.store.inspect()
    stats = state.stats
    # MemoryPool.slots: each slot is a slab of its own.
    assert pool.num_allocated + pool.free_slabs == pool.num_slabs
    assert pool.num_allocated == stats.chunks == len(engine.store), "a slot leaked"
    assert stats.locks_held == 0 and state.locks == {}
    handles = [piece.handle for piece in state.pieces.values()]
    assert len(set(handles)) == len(handles)
    assert all(pool.is_allocated(handle) for handle in handles)
    assert all(piece.locks == 0 and piece.readers == 0 for piece in state.pieces.values())
    assert state.writing == {}
    assert state.writing_models == {} and state.writing_tenants == {}
    assert stats.bytes_used == SLOT * stats.chunks
    assert stats.evictions > 0
    assert stats.lookup_hit_chunks > 0
    engine.store.clear()
    assert (pool.num_allocated, pool.free_slabs) == (0, pool.num_slabs)


def test_concurrent_clients_keep_locks_and_leak_nothing() -> None:
    run_stress(force=False)


def test_concurrent_clients_with_forced_clears() -> None:
    run_stress(force=True)


def test_concurrent_clients_of_mixed_tp_sizes_keep_locks_and_leak_nothing() -> None:
    run_stress(force=False, target=mixed_client)


def test_concurrent_clients_of_mixed_tp_sizes_with_forced_clears() -> None:
    run_stress(force=True, target=mixed_client)
