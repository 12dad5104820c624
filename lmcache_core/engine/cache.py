"""``CacheEngine``: the core (``core.CacheCore``) composed with its lower tiers, its in-process
async lookups and the operators' views (clear, stats, chunk listings).

Without ``disk``/``remote`` it holds no ``TieredStorage`` and every path is memory-only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lmcache_core.engine.async_lookup import AsyncLookups
from lmcache_core.engine.core import MEMORY_TIER, CacheCore
from lmcache_core.engine.index import Piece, find_hits
from lmcache_core.engine.retention import Retention
from lmcache_core.engine.tiered import TieredStorage
from lmcache_core.engine.verify import IntegrityGuard
from lmcache_core.errors import PinLimitError, ProtocolError
from lmcache_core.events import KVEventSink
from lmcache_core.keys import ChunkKey, HeadRange, tenant_tag
from lmcache_core.protocol.messages import ChunkInfo
from lmcache_core.stats import EngineStats, ModelStats, TenantStats, flat
from lmcache_core.storage.pool import MemoryPool

if TYPE_CHECKING:
    from lmcache_core.storage.disk import DiskTier
    from lmcache_core.storage.remote import RemoteTier

SORTS = ("age", "hits", "size", "key")
#: Tenants without a quota listed in the figures (SERVER_INFO, inspect-chunks): the largest ones.
MAX_TENANT_ROWS = 64


class CacheEngine(CacheCore):
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
        super().__init__(pool, chunk_size, lock_ttl_s, clock, events=events, quotas=quotas,
                         tenant_quotas={tag: size for tag, (_, size) in tenants.items()},
                         max_pinned_bytes=max_pinned_bytes)
        # Checks pieces against their checksums (tier writes; retrieves when asked) and drops
        # the corrupt ones.
        self.integrity = IntegrityGuard(self)
        self.tiers = (TieredStorage(self, disk, remote, self.integrity)
                      if disk is not None or remote is not None else None)
        self._async = AsyncLookups(self)

    # ------------------------------------------------------------------ lower tiers

    @property
    def has_tiers(self) -> bool:
        """Whether a disk or remote tier is attached (lookups then go through ``lookup_tiers``)."""
        return self.tiers is not None

    @property
    def disk(self) -> DiskTier | None:
        return self.tiers.disk if self.tiers is not None else None

    @property
    def remote(self) -> RemoteTier | None:
        return self.tiers.remote if self.tiers is not None else None

    def lookup_tiers(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
                     chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool = True,
                     timeout_s: float = 1.0) -> int:
        """``lookup``, then bring the rest of the prefix from disk and Redis into memory, for at
        most about ``timeout_s`` (``TieredStorage.lookup``). Without tiers it is ``lookup``."""
        if self.tiers is None:
            return self.lookup(model_name, layout, ranges, chunk_hashes, lookup_id, lock)
        return self.tiers.lookup(model_name, layout, ranges, chunk_hashes, lookup_id, lock,
                                 timeout_s)

    # ------------------------------------------------------------------ inspection

    def is_resident(self, key: ChunkKey) -> bool:
        """Whether the piece ``key`` is committed (visible to lookups)."""
        with self.mutex:
            return key in self.index.lru

    def locks_of(self, lookup_id: str) -> list[ChunkKey]:
        """The pieces ``lookup_id`` holds a lock on (for inspection and tests)."""
        with self.mutex:
            return self.locks.keys_of(lookup_id)

    def set_lock_readers(self, lookup_id: str, readers: int, shared: int = 1) -> bool:
        """Each lock ``lookup_id`` holds (per head range and chunk) goes with the ``readers``-th
        retrieve of it by each of the ``shared`` ranks reading that range (LMCache's
        ``num_kv_readers``; MLA's world size); called right after the lookup. False if it
        holds none."""
        with self.mutex:
            return self.locks.set_readers(lookup_id, readers, shared)

    def release_lookup_reads(self, lookup_id: str, chunk_hashes: Collection[bytes],
                             reads: int, heads: HeadRange | None = None) -> int:
        """Count ``reads`` reads of every range (or of ``heads`` only) of ``lookup_id``'s locks
        on the chunks ``chunk_hashes`` name, releasing those with none left to wait for
        (LMCache's ``free_lookup_locks`` over a range); how many piece locks went."""
        with self.mutex:
            return self.locks.release_chunks(lookup_id, chunk_hashes, reads, heads)

    def held(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
             chunk_hashes: Sequence[bytes]) -> int:
        """How many leading chunks resident pieces cover for ``ranges``, touching nothing (no
        LRU move, no hit or lookup counted, no lock): to compare candidate layouts."""
        with self.mutex:
            return find_hits(self.index, model_name, layout, ranges, chunk_hashes).count

    def layouts(self, model_name: str) -> list[str]:
        """The layouts of ``model_name`` that have resident pieces (a lookup by a client that
        names no layout tries these)."""
        with self.mutex:
            return [layout for (model, layout) in self.index.layout_chunks if model == model_name]

    def __len__(self) -> int:
        return len(self.index)

    # ------------------------------------------------------------------ pins (lmcache pin/unpin)

    def pin(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
            chunk_hashes: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Pin the pieces covering ``ranges`` of the leading chunks held (until unpinned, or
        for ``ttl_s``); how many pieces are pinned now. PinLimitError, pinning nothing, when
        that would pass ``max_pinned_bytes``."""
        with self.mutex:
            now = self.clock()
            pieces = self._pieces_of(model_name, layout, ranges, chunk_hashes)
            book = self.retention
            more = sum(piece.nbytes for piece in pieces if not piece.pinned)
            if book.pinned_bytes + more > book.max_pinned_bytes:
                raise PinLimitError(
                    f"pinning {len(pieces)} piece(s) ({more} more bytes) would hold "
                    f"{book.pinned_bytes + more} bytes pinned, over server.max_pinned "
                    f"({book.max_pinned_bytes}); unpin others or raise it")
            hint = Retention(ttl_s=ttl_s, pin=True)
            for piece in pieces:
                # The pin's TTL replaces the piece's (none: pinned until unpinned, whatever TTL
                # it had); its priority stays (the hint has none).
                book.apply(piece, hint, now, fresh=False, replace_ttl=ttl_s is not None)
        return len(pieces)

    def unpin(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
              chunk_hashes: Sequence[bytes]) -> int:
        """Unpin the pieces covering ``ranges`` of the leading chunks held; how many were."""
        with self.mutex:
            pieces = self._pieces_of(model_name, layout, ranges, chunk_hashes)
            return sum(self.retention.unpin(piece) for piece in pieces)

    def _pieces_of(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
                   chunk_hashes: Sequence[bytes]) -> list[Piece]:
        return find_hits(self.index, model_name, layout, ranges, chunk_hashes).pieces()

    # ------------------------------------------------------------------ admin

    def clear(self, force: bool = False) -> tuple[int, int]:
        """Drop resident pieces; returns ``(removed, kept)``. Unforced, locked and pinned pieces
        stay; forced, they go with their locks and pins. Pieces being read always stay."""
        removed = kept = 0
        dropped: list[ChunkKey] = []
        with self.mutex:
            for piece in list(self.index):
                if piece.readers or ((piece.locks or piece.pinned) and not force):
                    kept += 1
                else:
                    self.drop(piece)
                    dropped.append(piece.key)
                    removed += 1
            if self.events is not None and dropped:
                self.events.removed(dropped, MEMORY_TIER)
            if force:
                self.locks.purge(self.index.lru)
        return removed, kept

    def snapshot(self) -> EngineStats:
        """The engine's section of SERVER_INFO: its counters and its gauges, read at one moment."""
        pool = self.pool
        with self.mutex:
            return self.counters.copy(
                lookup_hit_tokens=self.counters.lookup_hit_chunks * self.chunk_size,
                chunks=len(self.index), bytes_used=self.index.nbytes,
                pool_capacity_bytes=pool.nbytes, pool_bytes_allocated=pool.bytes_allocated,
                pool_slabs=pool.num_slabs, pool_slabs_free=pool.free_slabs,
                pool_pinned_bytes=pool.pinned_bytes, locks_held=self.locks.held_count(),
                pinned_pieces=len(self.retention.pinned), pinned_bytes=self.retention.pinned_bytes)

    def stats(self) -> dict[str, int]:
        """The engine's figures and its tiers' by their flat names (``stats.flat``)."""
        out = flat(self.snapshot())
        if self.tiers is not None:
            out.update(self.tiers.stats())
        return out

    def model_stats(self) -> list[ModelStats]:
        """Per model: pieces, bytes, layouts and quota (SERVER_INFO, ``inspect-chunks``)."""
        with self.mutex:
            counts = self.index.model_counts()
            layouts: dict[str, list[str]] = {}
            for model, layout in self.index.layout_chunks:
                layouts.setdefault(model, []).append(layout)
        return [ModelStats(model_name=model, pieces=pieces, bytes_used=nbytes,
                           layouts=sorted(layouts.get(model, [])),
                           quota_bytes=self.quotas.get(model))
                for model, (pieces, nbytes) in sorted(counts.items())]

    def tenant_stats(self) -> list[TenantStats]:
        """Per cache_salt tenant: pieces, bytes and quota; every tenant with a quota (by label),
        then the ``MAX_TENANT_ROWS`` largest others (by tag only: the server never sees their
        salt). Pieces stored without a salt, or loaded from a tier, belong to no tenant."""
        with self.mutex:
            counts = self.index.tenant_counts()
        named = [TenantStats(tenant=tag, name=name, pieces=counts.get(tag, (0, 0))[0],
                             bytes_used=counts.get(tag, (0, 0))[1],
                             quota_bytes=self.tenant_quotas.get(tag))
                 for tag, name in sorted(self.tenant_names.items(), key=lambda item: item[1])]
        others = sorted(((tag, row) for tag, row in counts.items() if tag not in self.tenant_names),
                        key=lambda item: (-item[1][1], item[0]))[:MAX_TENANT_ROWS]
        return named + [TenantStats(tenant=tag, pieces=pieces, bytes_used=nbytes)
                        for tag, (pieces, nbytes) in others]

    def list_chunks(self, model_name: str | None = None, limit: int = 100,
                    sort: str = "age") -> tuple[list[ChunkInfo], int]:
        """Up to ``limit`` resident pieces (of ``model_name`` if given) and how many match.

        Sorts: ``age`` newest first, ``hits`` most first, ``size`` largest first, ``key`` by
        (model, layout, chunk hash, heads) so a chunk's pieces sit together."""
        if sort not in SORTS:
            raise ProtocolError(f"sort must be one of {', '.join(SORTS)}, got {sort!r}")
        with self.mutex:
            now = self.clock()
            rows = [(piece, now - piece.created, piece.locks, piece.hits) for piece in self.index
                    if model_name is None or piece.key.model_name == model_name]
        rows.sort(key=_SORT_KEYS[sort])
        return [_chunk_info(*row, now) for row in rows[:max(limit, 0)]], len(rows)

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


_Row = tuple["Piece", float, int, int]
_SORT_KEYS: dict[str, Callable[[_Row], Any]] = {
    "age": lambda row: row[1],
    "hits": lambda row: (-row[3], row[1]),
    "size": lambda row: (-row[0].nbytes, row[1]),
    "key": lambda row: (row[0].key.model_name, row[0].key.layout, row[0].key.chunk_hash,
                        row[0].key.head_lo),
}


def _chunk_info(piece: Piece, age_s: float, locks: int, hits: int, now: float) -> ChunkInfo:
    key = piece.key
    expires_in = None if piece.expires == math.inf else max(0.0, piece.expires - now)
    return ChunkInfo(chunk_hash=key.chunk_hash, model_name=key.model_name, layout=key.layout,
                     head_lo=key.head_lo, head_hi=key.head_hi, tier=MEMORY_TIER,
                     nbytes=piece.nbytes, locks=locks, hits=hits, age_s=age_s,
                     pinned=piece.pinned, expires_in_s=expires_in, priority=piece.priority)
