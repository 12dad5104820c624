"""``CacheEngine``: the engine of one server (or one in-process worker), composed of its parts:
the store (``store.PieceStore``: pool, index, locks, pins, the pieces' lifecycle), the integrity
guard (``verify``), the lower tiers (``tiered``: disk and Redis, when configured) and the
in-process async lookups (``async_lookup``). Each part works through the others' methods; the
tiers hear of stores and evictions through the hooks the store was built with.

Without ``disk``/``remote`` it holds no ``TieredStorage`` and every path is memory-only. It builds
no wire structs: the server turns what it returns (figures, ``PieceRow``s) into replies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from lmcache_core.engine.async_lookup import AsyncLookups
from lmcache_core.engine.index import GroupTarget, Holder, Pair
from lmcache_core.engine.plans import RetrievePlan, StorePlan
from lmcache_core.engine.retention import PLAIN, Retention
from lmcache_core.engine.store import PieceRow, PieceStore
from lmcache_core.engine.tiered import TieredStorage
from lmcache_core.engine.verify import IntegrityGuard
from lmcache_core.errors import ProtocolError
from lmcache_core.events import KVEventSink
from lmcache_core.keys import ChunkKey, HeadRange, tenant_tag
from lmcache_core.stats import EngineStats, ModelStats, TenantStats, flat
from lmcache_core.storage.pool import MemoryPool

if TYPE_CHECKING:
    from lmcache_core.storage.disk import DiskTier
    from lmcache_core.storage.remote import RemoteTier

SORTS = ("age", "hits", "size", "key")
#: (model, layout) pairs an explain looks through per tier (memory, disk) at most.
EXPLAIN_PAIRS = 4096


class Holders(NamedTuple):
    """What ``CacheEngine.holders`` found: where each probe is held, whether a tier had more
    pairs than one explain looks through (``cut``), and Redis's state (as ``PeekReply.remote``)."""

    found: list[Holder]
    cut: bool
    remote: str
#: Tenants without a quota listed in the figures (SERVER_INFO, inspect-chunks): the largest ones.
MAX_TENANT_ROWS = 64


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
        tenants = {tenant_tag(salt): (label, size)
                   for label, (salt, size) in (tenant_quotas or {}).items()}
        self.tenant_names = {tag: label for tag, (label, _) in tenants.items()}
        tiered = disk is not None or remote is not None
        #: The one owner of the engine's state (read it for inspection; change it only through
        #: its methods).
        self.store = PieceStore(pool, chunk_size, lock_ttl_s, clock, events=events,
                                quotas=quotas,
                                tenant_quotas={tag: size for tag, (_, size) in tenants.items()},
                                max_pinned_bytes=max_pinned_bytes,
                                on_stored=self._stored if tiered else None,
                                on_evicted=self._evicted if tiered else None)
        # Checks pieces against their checksums (tier writes; retrieves when asked) and has the
        # store drop the corrupt ones.
        self.integrity = IntegrityGuard(self.store)
        self.tiers = TieredStorage(self.store, disk, remote, self.integrity) if tiered else None
        self._async = AsyncLookups(self)

    # ------------------------------------------------------------------ what it is built on

    @property
    def pool(self) -> MemoryPool:
        return self.store.pool

    @property
    def chunk_size(self) -> int:
        return self.store.chunk_size

    @property
    def quotas(self) -> Mapping[str, int]:
        return self.store.quotas

    @property
    def tenant_quotas(self) -> Mapping[str, int]:
        return self.store.tenant_quotas

    @property
    def has_tiers(self) -> bool:
        """Whether a disk or remote tier is attached (lookups with a tier budget use them)."""
        return self.tiers is not None

    @property
    def disk(self) -> DiskTier | None:
        return self.tiers.disk if self.tiers is not None else None

    @property
    def remote(self) -> RemoteTier | None:
        return self.tiers.remote if self.tiers is not None else None

    def _stored(self, keys: Sequence[ChunkKey]) -> None:
        if self.tiers is not None:
            self.tiers.stored(keys)

    def _evicted(self, key: ChunkKey) -> None:
        if self.tiers is not None:
            self.tiers.evicted(key)

    # ------------------------------------------------------------------ lookup

    def lookup(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
               chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool = True, *,
               tier_timeout_s: float | None = None, readers: int = 1, shared: int = 1) -> int:
        """How many leading chunks have pieces covering every head range in ``ranges`` (one per
        rank), locked for ``lookup_id`` when ``lock`` (``PieceStore.lookup``: each lock goes
        with the ``readers``-th read by each of the ``shared`` ranks of its range, MLA's world
        size). With ``tier_timeout_s`` and tiers, the rest of the prefix is brought from disk and
        Redis into memory first, for at most about that long (``TieredStorage.lookup``)."""
        if self.tiers is not None and tier_timeout_s is not None:
            return self.tiers.lookup(model_name, layout, ranges, chunk_hashes, lookup_id, lock,
                                     tier_timeout_s, readers, shared)
        return self.store.lookup(model_name, layout, ranges, chunk_hashes, lookup_id, lock,
                                 readers, shared)

    def lookup_groups(self, model_name: str, groups: Sequence[GroupTarget],
                      chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool = True, *,
                      tier_timeout_s: float | None = None, readers: int = 1,
                      shared: int = 1) -> int:
        """``lookup`` for a hybrid model's KV-cache groups (``PieceStore.lookup_groups``; with
        ``tier_timeout_s`` and tiers, ``TieredStorage.lookup_groups``)."""
        if self.tiers is not None and tier_timeout_s is not None:
            return self.tiers.lookup_groups(model_name, groups, chunk_hashes, lookup_id, lock,
                                            tier_timeout_s, readers, shared)
        return self.store.lookup_groups(model_name, groups, chunk_hashes, lookup_id, lock,
                                        readers, shared)

    def held(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
             chunk_hashes: Sequence[bytes]) -> int:
        """``PieceStore.held``: leading chunks covered, touching nothing."""
        return self.store.held(model_name, layout, ranges, chunk_hashes)

    def held_groups(self, model_name: str, groups: Sequence[GroupTarget],
                    chunk_hashes: Sequence[bytes]) -> int:
        """``PieceStore.held_groups``: a hybrid model's leading chunks restorable from memory,
        touching nothing."""
        return self.store.held_groups(model_name, groups, chunk_hashes)

    def layouts(self, model_name: str) -> list[str]:
        """The layouts of ``model_name`` that have resident pieces."""
        return self.store.layouts(model_name)

    # ------------------------------------------------------------------ explain

    def pairs(self) -> list[Pair]:
        """Every (model, layout) with pieces in memory or on disk (memory's first)."""
        disk = self.disk
        return list(dict.fromkeys(self.store.pairs() + (disk.pairs() if disk is not None else [])))

    def holders(self, chunk_hashes: Sequence[bytes], model_name: str,
                remote_pairs: Sequence[Pair], tier_timeout_s: float) -> Holders:
        """Where each of ``chunk_hashes`` is held under any model and layout (``lmcache lookup
        --explain``), touching nothing: memory and the disk's index looked through pair by pair
        (``model_name``'s first), Redis asked for exact keys of ``remote_pairs`` only, within
        ``tier_timeout_s``."""
        found, cut = self.store.holders(chunk_hashes, model_name, EXPLAIN_PAIRS)
        disk, remote = self.disk, self.remote
        if disk is not None:
            on_disk, disk_cut = disk.holders(chunk_hashes, model_name, EXPLAIN_PAIRS)
            found += [Holder(probe, model, layout, disk.name, tuple(ranges))
                      for probe, model, layout, ranges in on_disk]
            cut = cut or disk_cut
        state = ""
        if remote is not None and self.tiers is not None and remote_pairs:
            state, in_redis = self.tiers.remote_holders(remote_pairs, chunk_hashes,
                                                        tier_timeout_s)
            found += in_redis
        return Holders(found, cut, state)

    def model_tenants(self, model_name: str) -> tuple[int, dict[str, int]]:
        """``PieceStore.model_tenants``: the model's resident pieces, and per tenant tag."""
        return self.store.model_tenants(model_name)

    # ------------------------------------------------------------------ locks

    def expire_locks(self) -> int:
        return self.store.expire_locks()

    def free_lookup_locks(self, lookup_id: str) -> int:
        """Release whatever ``lookup_id`` still locks (its chunks that were not retrieved)."""
        return self.store.free_lookup_locks(lookup_id)

    def end_session(self, lookup_id: str) -> int:
        """A request is over: release its remaining locks (unlike LMCache, which keeps them)."""
        return self.store.free_lookup_locks(lookup_id)

    def locks_of(self, lookup_id: str) -> list[ChunkKey]:
        return self.store.locks_of(lookup_id)

    def set_lock_readers(self, lookup_id: str, readers: int, shared: int = 1) -> bool:
        """``PieceStore.set_lock_readers`` (LMCache's ``num_kv_readers`` after a lookup)."""
        return self.store.set_lock_readers(lookup_id, readers, shared)

    def release_lookup_reads(self, lookup_id: str, chunk_hashes: Collection[bytes],
                             reads: int, heads: HeadRange | None = None) -> int:
        """``PieceStore.release_lookup_reads`` (LMCache's ``free_lookup_locks`` over a range)."""
        return self.store.release_lookup_reads(lookup_id, chunk_hashes, reads, heads)

    # ------------------------------------------------------------------ store and retrieve

    def begin_store(self, keys: Sequence[ChunkKey], nbytes: int,
                    retention: Retention = PLAIN, tenant: str = "") -> StorePlan:
        """``PieceStore.begin_store``: room for the pieces not held yet."""
        return self.store.begin_store(keys, nbytes, retention, tenant)

    def finish_store(self, plan: StorePlan, ok: bool = True, *,
                     checksums_pending: bool = False) -> None:
        """``PieceStore.finish_store``: commit (the tiers then queue their writes) or free; with
        ``checksums_pending``, the checksums come after (``record_checksums``)."""
        self.store.finish_store(plan, ok, checksums_pending=checksums_pending)

    def record_checksums(self, plan: StorePlan, digests: Sequence[int] | None) -> None:
        """``PieceStore.record_checksums``: a store's checksums, taken after it committed (None:
        given up, its pieces dropped)."""
        self.store.record_checksums(plan, digests)

    def begin_retrieve(self, model_name: str, layout: str, heads: HeadRange,
                       chunk_hashes: Sequence[bytes], lookup_id: str = "") -> RetrievePlan:
        """``PieceStore.begin_retrieve``: the pieces to copy out of, held while copied."""
        return self.store.begin_retrieve(model_name, layout, heads, chunk_hashes, lookup_id)

    def finish_retrieve(self, plan: RetrievePlan, copied: int | None = None) -> None:
        self.store.finish_retrieve(plan, copied)

    def is_resident(self, key: ChunkKey) -> bool:
        """Whether the piece ``key`` is committed (visible to lookups)."""
        return self.store.is_resident(key)

    def __len__(self) -> int:
        return len(self.store)

    # ------------------------------------------------------------------ pins (lmcache pin/unpin)

    def pin(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
            chunk_hashes: Sequence[bytes], ttl_s: float | None = None) -> int:
        """``PieceStore.pin``: how many pieces are pinned now (PinLimitError past the limit)."""
        return self.store.pin(model_name, layout, ranges, chunk_hashes, ttl_s)

    def unpin(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
              chunk_hashes: Sequence[bytes]) -> int:
        return self.store.unpin(model_name, layout, ranges, chunk_hashes)

    def pin_groups(self, model_name: str, groups: Sequence[GroupTarget],
                   chunk_hashes: Sequence[bytes], ttl_s: float | None = None) -> int:
        """``PieceStore.pin_groups``: a hybrid model's pin (PinLimitError past the limit)."""
        return self.store.pin_groups(model_name, groups, chunk_hashes, ttl_s)

    def unpin_groups(self, model_name: str, groups: Sequence[GroupTarget],
                     chunk_hashes: Sequence[bytes]) -> int:
        return self.store.unpin_groups(model_name, groups, chunk_hashes)

    # ------------------------------------------------------------------ admin

    def clear(self, force: bool = False) -> tuple[int, int]:
        """``PieceStore.clear``: ``(removed, kept)``."""
        return self.store.clear(force)

    def snapshot(self) -> EngineStats:
        """The engine's section of SERVER_INFO: its counters and its gauges, read at one moment."""
        return self.store.snapshot()

    def stats(self) -> dict[str, int]:
        """The engine's figures and its tiers' by their flat names (``stats.flat``)."""
        out = flat(self.snapshot())
        if self.tiers is not None:
            out.update(self.tiers.stats())
        return out

    def model_stats(self) -> list[ModelStats]:
        """Per model: pieces, bytes, layouts and quota (SERVER_INFO, ``inspect-chunks``)."""
        return [ModelStats(model_name=model, pieces=pieces, bytes_used=nbytes, layouts=layouts,
                           quota_bytes=self.store.quotas.get(model))
                for model, (pieces, nbytes, layouts) in sorted(self.store.model_counts().items())]

    def tenant_stats(self) -> list[TenantStats]:
        """Per cache_salt tenant: pieces, bytes and quota; every tenant with a quota (by label),
        then the ``MAX_TENANT_ROWS`` largest others (by tag only: the server never sees their
        salt). Pieces stored without a salt, or loaded from a tier, belong to no tenant."""
        counts = self.store.tenant_counts()
        quotas = self.store.tenant_quotas
        named = [TenantStats(tenant=tag, name=name, pieces=counts.get(tag, (0, 0))[0],
                             bytes_used=counts.get(tag, (0, 0))[1], quota_bytes=quotas.get(tag))
                 for tag, name in sorted(self.tenant_names.items(), key=lambda item: item[1])]
        others = sorted(((tag, row) for tag, row in counts.items() if tag not in self.tenant_names),
                        key=lambda item: (-item[1][1], item[0]))[:MAX_TENANT_ROWS]
        return named + [TenantStats(tenant=tag, pieces=pieces, bytes_used=nbytes)
                        for tag, (pieces, nbytes) in others]

    def list_chunks(self, model_name: str | None = None, limit: int = 100,
                    sort: str = "age") -> tuple[list[PieceRow], int]:
        """Up to ``limit`` resident pieces (of ``model_name`` if given) and how many match.

        Sorts: ``age`` newest first, ``hits`` most first, ``size`` largest first, ``key`` by
        (model, layout, chunk hash, heads) so a chunk's pieces sit together."""
        if sort not in SORTS:
            raise ProtocolError(f"sort must be one of {', '.join(SORTS)}, got {sort!r}")
        rows = self.store.rows(model_name)
        rows.sort(key=_SORT_KEYS[sort])
        return rows[:max(limit, 0)], len(rows)

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


_SORT_KEYS: dict[str, Callable[[PieceRow], Any]] = {
    "age": lambda row: row.age_s,
    "hits": lambda row: (-row.hits, row.age_s),
    "size": lambda row: (-row.nbytes, row.age_s),
    "key": lambda row: (row.model_name, row.layout, row.chunk_hash, row.head_lo),
}
