"""The engine of the integrity tests: slots of 1 KiB, each piece 1000 bytes of its own pattern in
a real layout of 8 KV heads, stored as the server's handler stores (copied in, then checksummed)."""

from __future__ import annotations

import torch

from lmcache_core.engine import CacheEngine, StorePlan
from lmcache_core.keys import ChunkKey, layout_key
from lmcache_core.storage import integrity
from lmcache_core.storage.disk import DiskTier
from lmcache_core.storage.pool import MemoryPool

SLOT = 1024
NBYTES = 1000
LAYOUT = layout_key("bfloat16", 2, 8, 64, False)  # 8 KV heads


def key(i: int) -> ChunkKey:
    return ChunkKey("m", LAYOUT, 0, 8, bytes([i, 0xC3]) * 16)


def pattern(i: int) -> torch.Tensor:
    return ((torch.arange(NBYTES, dtype=torch.int64) * (i + 3) + 11) % 251).to(torch.uint8)


def engine_with(disk: DiskTier | None = None, slots: int = 8) -> CacheEngine:
    return CacheEngine(MemoryPool.slots(SLOT, slots, pin=False), chunk_size=16, disk=disk)


def begin(engine: CacheEngine, ids: list[int]) -> StorePlan:
    """A store's first half as the server's handler does it: copy in, then checksum."""
    plan = engine.store.begin_store([key(i) for i in ids], NBYTES)
    for position, _, view in plan.writes:
        view.copy_(pattern(ids[position]))
    plan.checksums = [integrity.checksum(view) for _, _, view in plan.writes]
    return plan


def store(engine: CacheEngine, ids: list[int]) -> None:
    engine.store.finish_store(begin(engine, ids))
