"""The engine the engine's unit tests drive: a pool of small slots, pieces under the opaque layout
of a world size (heads are ranks) unless a real one is named, each piece's bytes its hash's first
byte plus its ``head_lo``; lookups and retrieves for every rank, as the server's handlers ask."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_core.engine import CacheEngine, GroupTarget, RetrievePlan
from lmcache_core.keys import ChunkKey, layout_key, opaque_layout, rank_heads, world_heads
from lmcache_core.protocol.messages import StoreReply
from lmcache_core.storage.pool import MemoryPool
from tests.harness import FakeClock

MODEL = "m"
SLOT = 32


def h(i: int) -> bytes:
    return bytes([i]) * 32


def key(i: int, rank: int = 0, world_size: int = 2, model: str = MODEL) -> ChunkKey:
    """Rank ``rank``'s piece of chunk ``i`` under the opaque layout of ``world_size``."""
    return ChunkKey(model, opaque_layout(world_size), rank, rank + 1, h(i))


def make(num_slots: int = 32, ttl: float = 300.0, clock: FakeClock | None = None) -> CacheEngine:
    pool = MemoryPool.slots(SLOT, num_slots, pin=False)
    return CacheEngine(pool, chunk_size=16, lock_ttl_s=ttl, clock=clock or FakeClock())


def store(engine: CacheEngine, keys: Sequence[ChunkKey], nbytes: int = SLOT) -> StoreReply:
    """Store keys whose bytes are each key's first hash byte plus its head_lo (opaque: its rank)."""
    plan = engine.store.begin_store(keys, nbytes)
    for _, k, view in plan.writes:
        view.fill_(k.chunk_hash[0] + k.head_lo)
    engine.store.finish_store(plan)
    return StoreReply(stored=plan.stored, already_present=plan.already_present,
                      skipped_full=plan.skipped_full, skipped_quota=plan.skipped_quota)


def store_ranks(engine: CacheEngine, chunks: Sequence[int], ranks: Sequence[int] = (0, 1)) -> None:
    for rank in ranks:
        store(engine, [key(i, rank) for i in chunks])


def lookup(engine: CacheEngine, world_size: int, chunk_hashes: Sequence[bytes], lookup_id: str,
           lock: bool = True, model: str = MODEL, layout: str | None = None) -> int:
    """A lookup for every rank of ``world_size`` (opaque layout unless ``layout``)."""
    layout = opaque_layout(world_size) if layout is None else layout
    return engine.lookup(model, [GroupTarget(layout, world_heads(layout, world_size))], chunk_hashes,
                         lookup_id, lock)


def begin(engine: CacheEngine, rank: int, world_size: int, chunk_hashes: Sequence[bytes],
          lookup_id: str = "", model: str = MODEL, layout: str | None = None) -> RetrievePlan:
    """``begin_retrieve`` of rank ``rank`` of ``world_size`` (opaque layout unless ``layout``)."""
    layout = opaque_layout(world_size) if layout is None else layout
    return engine.store.begin_retrieve(model, layout, rank_heads(layout, world_size, rank), chunk_hashes,
                                 lookup_id)


def retrieve(engine: CacheEngine, rank: int, world_size: int, chunk_hashes: Sequence[bytes],
             lookup_id: str = "", model: str = MODEL, layout: str | None = None) -> list[int]:
    plan = begin(engine, rank, world_size, chunk_hashes, lookup_id, model, layout)
    engine.store.finish_retrieve(plan)
    return plan.missing


def hashes(n: int) -> list[bytes]:
    return [h(i) for i in range(n)]


def locks_by_key(engine: CacheEngine) -> dict[ChunkKey, int]:
    return {key: piece.locks for key, piece in engine.store.inspect().pieces.items()}


# Pieces of a real layout. H = 8 KV heads: TP=1 stores one piece [0, 8), TP=2 pieces [0, 4) and
# [4, 8), TP=4 [0, 2) ...
F16 = layout_key("float16", 2, 8, 16, False)
BF16 = layout_key("bfloat16", 2, 8, 16, False)  # the same shape: only the dtype differs
MLA = layout_key("bfloat16", 2, 1, 64, True)


def piece(i: int, lo: int, hi: int, layout: str = F16, model: str = MODEL) -> ChunkKey:
    return ChunkKey(model, layout, lo, hi, h(i))
