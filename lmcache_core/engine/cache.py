"""``CacheEngine``: the engine of one server (or one in-process worker), composed of its parts:
the store (``store.PieceStore``: pool, index, locks, pins, the pieces' lifecycle; the one API of
stores, retrieves, lookups, pins and admin views), the integrity guard (``verify``), the lower
tiers (``tiered``: disk and Redis, when configured) and the in-process async lookups
(``async_lookup``). Each part works through the others' methods; the tiers hear of stores and
evictions through the hooks the store was built with.

Callers use the parts themselves (``engine.store``, ``engine.tiers``, ``engine.integrity``); the
engine holds only what composes them: the lookup that brings the rest of a prefix in from the
tiers when given a budget (``lookup``), where probes are held in every tier (``holders``,
``pairs``), the figures of the store and the tiers read together (``snapshot``), the seed's
in-process async lookups, and ``close``. Without ``disk``/``remote`` it holds no
``TieredStorage`` and every path is memory-only. It builds no wire structs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from lmcache_core.engine.async_lookup import AsyncLookups
from lmcache_core.engine.index import GroupTarget, Holder, Pair
from lmcache_core.engine.store import PieceStore
from lmcache_core.engine.tiered import TieredStorage
from lmcache_core.engine.verify import IntegrityGuard
from lmcache_core.events import KVEventSink
from lmcache_core.keys import ChunkKey, tenant_tag
from lmcache_core.stats import DiskStats, EngineStats, RemoteStats
from lmcache_core.storage.pool import MemoryPool

if TYPE_CHECKING:
    from lmcache_core.storage.disk import DiskTier
    from lmcache_core.storage.remote_tier import RemoteTier

#: (model, layout) pairs an explain looks through per tier (memory, disk) at most.
EXPLAIN_PAIRS = 4096


class Holders(NamedTuple):
    """What ``CacheEngine.holders`` found: where each probe is held, whether a tier had more
    pairs than one explain looks through (``cut``), and Redis's state (as ``PeekReply.remote``)."""

    found: list[Holder]
    cut: bool
    remote: str


class EngineSnapshot(NamedTuple):
    """The engine's figures read together (``CacheEngine.snapshot``): the store's, and each
    tier's (None: not configured). SERVER_INFO's ``engine``, ``disk`` and ``remote`` sections."""

    engine: EngineStats
    disk: DiskStats | None
    remote: RemoteStats | None


class CacheEngine:
    """The cache of one server (or one in-process worker); thread-safe."""

    def __init__(self, pool: MemoryPool, chunk_size: int, lock_ttl_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, *, disk: DiskTier | None = None,
                 remote: RemoteTier | None = None, events: KVEventSink | None = None,
                 quotas: Mapping[str, int] | None = None,
                 tenant_quotas: Mapping[str, tuple[str, int]] | None = None,
                 max_pinned_bytes: int | None = None) -> None:
        """``quotas``: bytes per model; ``tenant_quotas``: ``{label: (cache_salt, bytes)}``, kept
        by the salt's ``keys.tenant_tag`` (the salt is not kept; figures show the label)."""
        self.pool = pool  # what the store and the tiers' loads share
        #: Bytes per model, and per tenant tag its (label, bytes): the quotas the store enforces,
        #: as the figures show them.
        self.quotas: dict[str, int] = dict(quotas or {})
        self.tenants: dict[str, tuple[str, int]] = {
            tenant_tag(salt): (label, size) for label, (salt, size) in (tenant_quotas or {}).items()}
        tiered = disk is not None or remote is not None
        self.store = PieceStore(pool, chunk_size, lock_ttl_s, clock, events=events,
                                quotas=self.quotas,
                                tenant_quotas={tag: size for tag, (_, size) in self.tenants.items()},
                                max_pinned_bytes=max_pinned_bytes,
                                on_stored=self._stored if tiered else None,
                                on_evicted=self._evicted if tiered else None)
        # Checks pieces against their checksums (tier writes; retrieves when asked) and has the
        # store drop the corrupt ones.
        self.integrity = IntegrityGuard(self.store)
        self.tiers = (TieredStorage(self.store, pool, disk, remote, self.integrity) if tiered
                      else None)
        self._async = AsyncLookups(self.lookup, self.store.free_lookup_locks, chunk_size, tiered)

    def _stored(self, keys: Sequence[ChunkKey]) -> None:
        if self.tiers is not None:
            self.tiers.stored(keys)

    def _evicted(self, key: ChunkKey) -> None:
        if self.tiers is not None:
            self.tiers.evicted(key)

    # ------------------------------------------------------------------ lookup

    def lookup(self, model_name: str, groups: Sequence[GroupTarget],
               chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool = True, *,
               tier_timeout_s: float | None = None, readers: int = 1, shared: int = 1) -> int:
        """How many leading chunks ``groups`` can be restored from (``PieceStore.lookup``),
        locked for ``lookup_id`` when ``lock``. With ``tier_timeout_s`` and tiers, the rest of
        the prefix is brought from disk and Redis into memory first, for at most about that
        long (``TieredStorage.lookup``); else memory alone answers."""
        if self.tiers is not None and tier_timeout_s is not None:
            return self.tiers.lookup(model_name, groups, chunk_hashes, lookup_id, lock,
                                     tier_timeout_s, readers, shared)
        return self.store.lookup(model_name, groups, chunk_hashes, lookup_id, lock, readers,
                                 shared)

    # ------------------------------------------------------------------ explain

    def pairs(self) -> list[Pair]:
        """Every (model, layout) with pieces in memory or on disk (memory's first)."""
        disk = self.tiers.disk if self.tiers is not None else None
        return list(dict.fromkeys(self.store.pairs() + (disk.pairs() if disk is not None else [])))

    def holders(self, chunk_hashes: Sequence[bytes], model_name: str,
                remote_pairs: Sequence[Pair], tier_timeout_s: float) -> Holders:
        """Where each of ``chunk_hashes`` is held under any model and layout (``lmcache lookup
        --explain``), touching nothing: memory and the disk's index looked through pair by pair
        (``model_name``'s first), Redis asked for exact keys of ``remote_pairs`` only, within
        ``tier_timeout_s``."""
        found, cut = self.store.holders(chunk_hashes, model_name, EXPLAIN_PAIRS)
        tiers = self.tiers
        if tiers is None:
            return Holders(found, cut, "")
        disk = tiers.disk
        if disk is not None:
            on_disk, disk_cut = disk.holders(chunk_hashes, model_name, EXPLAIN_PAIRS)
            found += [Holder(probe, model, layout, disk.name, tuple(ranges))
                      for probe, model, layout, ranges in on_disk]
            cut = cut or disk_cut
        state = ""
        if tiers.remote is not None and remote_pairs:
            state, in_redis = tiers.remote_holders(remote_pairs, chunk_hashes, tier_timeout_s)
            found += in_redis
        return Holders(found, cut, state)

    # ------------------------------------------------------------------ figures

    def snapshot(self) -> EngineSnapshot:
        """The store's counters and gauges and each tier's, read now (SERVER_INFO's sections)."""
        tiers = self.tiers
        disk = tiers.disk if tiers is not None else None
        remote = tiers.remote if tiers is not None else None
        return EngineSnapshot(self.store.snapshot(),
                              disk.stats() if disk is not None else None,
                              remote.stats() if remote is not None else None)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Shut down the engine's own threads (the async lookups' prefetch pool, if made).
        The tiers are their owner's to stop. True if nothing was left running. Idempotent."""
        return self._async.close(timeout_s)

    # ------------------------------------------------------------------ in-process async lookup
    # The seed's engine API for lmcache_core.lookup_client: a worker's LMCacheAsyncLookupServer
    # calls these from its thread, for this engine's own rank only (``async_lookup``).

    def async_lookup_and_prefetch(self, lookup_id: str, hashes: Sequence[bytes],
                                  offsets: Sequence[int] | None = None, pin: bool = True,
                                  request_configs: dict[str, Any] | None = None, *,
                                  model_name: str = "", world_size: int = 1, worker_id: int = 0,
                                  layout: str | None = None,
                                  on_result: Callable[[str, int], None] | None = None) -> int | None:
        """Count rank ``worker_id``'s cached prefix of ``hashes``, pin it when ``pin``, answer.

        The hit tokens go to ``on_result(lookup_id, num_hit_tokens)`` and are returned; with a
        disk or Redis tier the prefix is brought in on a prefetch thread, so this returns None
        and ``on_result`` is called from there. ``layout``: the KV layout fingerprint (default:
        ``keys.opaque_layout(world_size)``); ``request_configs`` is accepted for LMCache
        compatibility."""
        return self._async.lookup_and_prefetch(lookup_id, hashes, offsets, pin,
                                               model_name=model_name, world_size=world_size,
                                               worker_id=worker_id, layout=layout,
                                               on_result=on_result)

    def cleanup_memory_objs(self, lookup_id: str) -> int:
        """Release what ``lookup_id``'s async lookup pinned (it was cancelled or timed out); a
        tiered one still in flight releases what it pins when it ends, and answers 0."""
        return self._async.cleanup(lookup_id)

