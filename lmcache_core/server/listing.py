"""What ``lmcache serve`` tells about itself: SERVER_INFO (its figures, models, tenants, groups)
and LIST_CHUNKS (``lmcache inspect-chunks``: the pieces of memory and the disk, in one of the
listing orders), read from the engine, the registry and the components' figures.

The listing's orders are here alone (``ORDER``), on ``PieceRow``, the one row type of every tier:
memory's rows come from the store (``PieceStore.rows``), the disk's from its index (no I/O); each
tier's are ordered and cut to the ``limit`` before they are merged, and only the rows shown become
wire rows. Redis is never listed: its keys are counted by pattern within a budget.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from lmcache_core import __version__
from lmcache_core.config import LMCacheConfig
from lmcache_core.engine import MEMORY_TIER, CacheEngine, PieceRow, PieceStore
from lmcache_core.errors import ProtocolError
from lmcache_core.protocol import messages as m
from lmcache_core.protocol.ops import RequestType
from lmcache_core.server.registry import KVRegistry
from lmcache_core.stats import (
    EventStats,
    GroupStats,
    ModelStats,
    ServerStats,
    TenantStats,
    TransportStats,
)
from lmcache_core.storage.pool import MemoryPool, process_rss_bytes
from lmcache_core.transport.routes import Route

if TYPE_CHECKING:
    from lmcache_core.storage.disk import DiskTier
    from lmcache_core.storage.remote_tier import RemoteTier

#: A listing's orders, over every tier's rows: ``age`` newest first, ``hits`` and ``size`` most
#: first (then newest), ``key`` by (model, layout, chunk hash, heads) so a chunk's pieces sit
#: together. (A piece on disk has no hits until it is loaded: 0.)
ORDER: dict[str, Callable[[PieceRow], Any]] = {
    "age": lambda row: row.age_s,
    "hits": lambda row: (-row.hits, row.age_s),
    "size": lambda row: (-row.nbytes, row.age_s),
    "key": lambda row: (row.model_name, row.layout, row.chunk_hash, row.head_lo, row.tier),
}
SORTS = tuple(ORDER)
#: Tenants without a quota listed in the figures (SERVER_INFO, inspect-chunks): the largest ones.
MAX_TENANT_ROWS = 64


def memory_rows(store: PieceStore, model_name: str | None = None, limit: int = 100,
                sort: str = "age") -> tuple[list[PieceRow], int]:
    """Up to ``limit`` resident pieces (of ``model_name`` if given) in ``sort``'s order, and how
    many match."""
    order = _order(sort)
    rows = store.rows(model_name)
    rows.sort(key=order)
    return rows[:max(limit, 0)], len(rows)


def disk_rows(disk: DiskTier, model_name: str | None, limit: int,
              sort: str) -> tuple[list[PieceRow], int, int]:
    """The first ``limit`` pieces on disk (of ``model_name`` if given) in ``sort``'s order, how
    many match and their bytes (the disk's index alone: no I/O)."""
    now = time.time()
    found = disk.listing(model_name)
    rows = (PieceRow(key.chunk_hash, key.model_name, key.layout, key.head_lo, key.head_hi, nbytes,
                     max(0.0, now - written), tier=disk.name)
            for key, nbytes, written in found)
    return (heapq.nsmallest(max(limit, 0), rows, key=_order(sort)), len(found),
            sum(nbytes for _, nbytes, _ in found))


def _order(sort: str) -> Callable[[PieceRow], Any]:
    order = ORDER.get(sort)
    if order is None:
        raise ProtocolError(f"sort must be one of {', '.join(SORTS)}, got {sort!r}")
    return order


def model_stats(engine: CacheEngine) -> list[ModelStats]:
    """Per model held: pieces, bytes, layouts and quota (SERVER_INFO, ``inspect-chunks``)."""
    quotas = engine.quotas
    return [ModelStats(model_name=model, pieces=pieces, bytes_used=nbytes, layouts=layouts,
                       quota_bytes=quotas.get(model))
            for model, (pieces, nbytes, layouts) in sorted(engine.store.model_counts().items())]


def tenant_stats(engine: CacheEngine) -> list[TenantStats]:
    """Per cache_salt tenant: pieces, bytes and quota; every tenant with a quota (by label), then
    the ``MAX_TENANT_ROWS`` largest others (by tag only: the server never sees their salt).
    Pieces stored without a salt, or loaded from a tier, belong to no tenant."""
    counts = engine.store.tenant_counts()
    quotas = engine.tenants
    named = [TenantStats(tenant=tag, name=name, pieces=counts.get(tag, (0, 0))[0],
                         bytes_used=counts.get(tag, (0, 0))[1], quota_bytes=size)
             for tag, (name, size) in sorted(quotas.items(), key=lambda item: item[1][0])]
    others = sorted(((tag, row) for tag, row in counts.items() if tag not in quotas),
                    key=lambda item: (-item[1][1], item[0]))[:MAX_TENANT_ROWS]
    return named + [TenantStats(tenant=tag, pieces=pieces, bytes_used=nbytes)
                    for tag, (pieces, nbytes) in others]


def chunk_info(row: PieceRow) -> m.ChunkInfo:
    """A listing row on the wire."""
    return m.ChunkInfo(chunk_hash=row.chunk_hash, model_name=row.model_name, layout=row.layout,
                       head_lo=row.head_lo, head_hi=row.head_hi, tier=row.tier,
                       nbytes=row.nbytes, locks=row.locks, hits=row.hits, age_s=row.age_s,
                       pinned=row.pinned, expires_in_s=row.expires_in_s, priority=row.priority)


class ServerViews:
    """SERVER_INFO and LIST_CHUNKS of one server, and the figures ``/metrics`` exports.

    Given, at construction, what they read: the config, the engine, the pool, the registry, the
    tiers (None: not configured), each other component's figures (``transport_stats``;
    ``events_stats``: the KV-event publisher's, None without one), its urls as bound
    (``url``, ``http_url``: read when asked, the ports being known only once bound) and when it
    started."""

    def __init__(self, config: LMCacheConfig, engine: CacheEngine, pool: MemoryPool,
                 registry: KVRegistry, *, disk: DiskTier | None, remote: RemoteTier | None,
                 transport_stats: Callable[[], TransportStats],
                 events_stats: Callable[[], EventStats] | None,
                 url: Callable[[], str], http_url: Callable[[], str | None],
                 started: float) -> None:
        self.config = config
        self.engine = engine
        self.pool = pool
        self.registry = registry
        self.disk = disk
        self.remote = remote
        self.transport_stats = transport_stats
        self.events_stats = events_stats
        self.url = url
        self.http_url = http_url
        self.started = started

    def routes(self) -> dict[RequestType, Route]:
        return {
            RequestType.SERVER_INFO: Route(self.server_info),
            # With tiers, a listing reads the disk index and SCANs Redis (within its budget).
            RequestType.LIST_CHUNKS: Route(self.list_chunks, blocking=self.engine.tiers is not None),
        }

    def server_info(self, _request: m.NoArgs, _client: bytes) -> m.ServerInfoReply:
        pool = self.pool
        registered = self.registry.models()
        models = model_stats(self.engine)
        for row in models:
            row.registered = registered.pop(row.model_name, 0)
        models += [m.ModelStats(model_name=name, pieces=0, bytes_used=0, registered=count,
                                quota_bytes=self.engine.quotas.get(name))
                   for name, count in sorted(registered.items())]
        for row in models:
            row.groups = [GroupStats(index=g.index, count=g.count, kind=g.kind,
                                     block_size=g.block_size, window_tokens=g.window_tokens,
                                     layout=layout)
                          for layout, g in sorted(self.registry.groups(row.model_name, None),
                                                  key=lambda item: (item[1].index, item[0]))]
        return m.ServerInfoReply(
            version=__version__, url=self.url(), pid=os.getpid(),
            chunk_size=self.config.chunk_size, uptime_s=time.monotonic() - self.started,
            pool_bytes=pool.nbytes, slab_bytes=pool.slab_bytes,
            eviction=self.config.server.eviction, stats=self.server_stats(),
            http_url=self.http_url(), models=models, tenants=tenant_stats(self.engine),
            tiers=[tier.name for tier in (self.disk, self.remote) if tier is not None],
            pool_populate=pool.populate_state, pool_populated_bytes=pool.populated_bytes,
            pool_populate_s=pool.populate_s, pool_huge_pages=pool.huge_pages,
            rss_bytes=process_rss_bytes())

    def server_stats(self) -> ServerStats:
        """Every component's section, read now: SERVER_INFO's ``stats``, and what ``/metrics``
        exports (``server.metrics``). A section is None where its component is not configured."""
        engine, events = self.engine.snapshot(), self.events_stats
        return ServerStats(engine=engine.engine, transport=self.transport_stats(),
                           workers=self.registry.stats(), disk=engine.disk, remote=engine.remote,
                           events=events() if events is not None else None)

    def list_chunks(self, request: m.ListChunksRequest, _client: bytes) -> m.ChunkListReply:
        """Up to ``limit`` pieces of the listed tiers (memory, and the disk's index) in the
        request's order, how many match in all, and each tier's total: for Redis a count of keys
        by pattern within ``remote_budget_ms`` (``RemoteTier.count_keys``; Redis is never listed)."""
        model, limit, sort = request.model_name, request.limit, request.sort
        rows: list[PieceRow] = []
        totals: list[m.TierTotal] = []
        if "memory" in request.tiers:
            memory, pieces = memory_rows(self.engine.store, model, limit, sort)
            rows += memory
            totals.append(m.TierTotal(tier=MEMORY_TIER, pieces=pieces, nbytes=sum(
                row.bytes_used for row in model_stats(self.engine)
                if model is None or row.model_name == model)))
        disk = self.disk
        if disk is not None and "disk" in request.tiers:
            on_disk, pieces, nbytes = disk_rows(disk, model, limit, sort)
            rows += on_disk
            totals.append(m.TierTotal(tier=disk.name, pieces=pieces, nbytes=nbytes))
        remote = self.remote
        if remote is not None and "remote" in request.tiers:
            totals.append(self._count_remote(remote, request))
        rows.sort(key=ORDER[sort])  # each tier's rows are in this order: a merge
        listed = sum(t.pieces for t in totals if t.tier != "remote")
        return m.ChunkListReply(chunks=[chunk_info(row) for row in rows[:limit]], total=listed,
                                tiers=totals)

    def _count_remote(self, remote: RemoteTier, request: m.ListChunksRequest) -> m.TierTotal:
        """Redis's keys matching the request's pattern (default: the model's keys, or all), counted
        on the tier's own thread for at most the request's budget."""
        from lmcache_core.storage.remote_tier import glob_escape

        match = request.remote_match
        if match is None:
            match = "*" if request.model_name is None else glob_escape(request.model_name) + ":*"
        budget_s = request.remote_budget_ms / 1000
        deadline = time.monotonic() + budget_s
        try:
            # A SCAN step is checked against the deadline before it starts; one that hangs is
            # bounded by the tier's socket timeout, which the wait here allows for.
            count = remote.run(remote.count_keys, match, deadline).result(
                timeout=budget_s + remote.timeout_s)
        except FutureTimeout:
            return m.TierTotal(tier=remote.name, pieces=0, complete=False,
                               error=f"{remote.label} did not answer within "
                                     f"{budget_s + remote.timeout_s:.1f}s")
        except RuntimeError:  # the tier is shutting down
            return m.TierTotal(tier=remote.name, pieces=0, complete=False, error="stopping")
        return m.TierTotal(tier=remote.name, pieces=count.keys, complete=count.complete,
                           pattern=count.pattern, error=count.error)
