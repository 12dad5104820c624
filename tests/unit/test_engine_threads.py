"""CacheEngine under concurrent lookups, stores and retrieves: no leak, no torn read, locks hold."""

from __future__ import annotations

import random
import threading
import time

import torch

from lmcache_core.engine import CacheEngine
from lmcache_core.keys import ChunkKey
from lmcache_core.storage.pool import MemoryPool

MODEL = "m"
WORLD = 2
DOCS = 6
CHUNKS = 8
SLOT = 64


def chunk_hash(doc: int, i: int) -> bytes:
    return bytes([doc, i]) * 16


def pattern(key: ChunkKey) -> int:
    return (key.chunk_hash[0] * CHUNKS + key.chunk_hash[1] + key.kv_rank * 64) % 256


def check_read(found: list[tuple[int, ChunkKey, torch.Tensor]]) -> None:
    for _, key, view in found:
        copy = view.clone()
        assert bool((copy == pattern(key)).all()), f"torn or foreign bytes in {key.short()}"


def unlocked_read(engine: CacheEngine, chain: list[bytes], rng: random.Random) -> None:
    """A retrieve with no lookup: only its reader pin keeps the slots from being reused."""
    keys = [ChunkKey(MODEL, WORLD, rng.randrange(WORLD), c) for c in chain]
    plan = engine.begin_retrieve(keys)
    time.sleep(0.0005)  # a slow copy: other threads store (and would evict) meanwhile
    check_read(plan.found)
    engine.finish_retrieve(plan)


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
            hits = engine.lookup(MODEL, WORLD, chain, lookup_id)
            for rank in range(WORLD):
                keys = [ChunkKey(MODEL, WORLD, rank, c) for c in chain]
                if rank == 1 and rng.random() < 0.3:
                    released = engine.end_session(lookup_id)  # rank 1 never came to retrieve
                    assert not strict or released == hits
                else:
                    plan = engine.begin_retrieve(keys[:hits], lookup_id)
                    assert not strict or plan.missing == [], "a locked chunk went missing"
                    check_read(plan.found)
                    engine.finish_retrieve(plan)
                store = engine.begin_store(keys[hits:], SLOT)
                for _, key, view in store.writes:
                    view.fill_(pattern(key))
                engine.finish_store(store, ok=rng.random() > 0.1)
            engine.free_lookup_locks(lookup_id)
    except BaseException as exc:  # pragma: no cover - reported by the test
        errors.append(exc)


def admin(engine: CacheEngine, deadline: float, force: bool, errors: list[BaseException]) -> None:
    rng = random.Random(99)
    try:
        while time.monotonic() < deadline:
            engine.stats()
            engine.list_chunks(limit=10, sort=rng.choice(["age", "hits", "size", "key"]))
            engine.expire_locks()
            if rng.random() < 0.2:
                engine.clear(force=force and rng.random() < 0.5)
            time.sleep(0.005)
    except BaseException as exc:  # pragma: no cover - reported by the test
        errors.append(exc)


def run_stress(force: bool, seconds: float = 0.6) -> CacheEngine:
    # 20 slots for 6 docs x 8 chunks x 2 ranks = 96 keys: stores evict all the time.
    engine = CacheEngine(MemoryPool.slots(SLOT, 20, pin=False), chunk_size=16)
    deadline = time.monotonic() + seconds
    errors: list[BaseException] = []
    threads = [threading.Thread(target=client, args=(engine, seed, deadline, not force, errors))
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
    pool, stats = engine.pool, engine.stats()
    assert pool.num_used + pool.num_free == pool.num_slots
    assert pool.num_used == stats["chunks"] == len(engine), "a slot leaked"
    assert stats["locks_held"] == 0
    slots = [entry.slot for entry in engine._entries.values()]
    assert len(set(slots)) == len(slots)
    assert all(pool.is_allocated(slot) for slot in slots)
    assert all(entry.locks == 0 and entry.readers == 0 for entry in engine._entries.values())
    assert engine._writing == {}
    assert stats["bytes_used"] == SLOT * stats["chunks"]
    assert stats["evictions"] > 0
    assert stats["lookup_hit_chunks"] > 0
    engine.clear()
    assert pool.num_free == pool.num_slots


def test_concurrent_clients_keep_locks_and_leak_nothing() -> None:
    run_stress(force=False)


def test_concurrent_clients_with_forced_clears() -> None:
    run_stress(force=True)
