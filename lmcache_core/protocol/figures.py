"""Figures a server reports (``ServerInfoReply``'s parts): its counters, each model's and each
tenant's share of the pool. Plain structs on msgspec alone (``messages`` re-exports them)."""

from __future__ import annotations

import msgspec


class ServerStats(msgspec.Struct, kw_only=True):
    chunks: int = 0  # resident pieces
    bytes_used: int = 0
    pool_bytes_allocated: int = 0  # bytes of the pool's allocations (size classes)
    pool_slabs: int = 0
    pool_slabs_free: int = 0
    lookups: int = 0
    lookup_hit_chunks: int = 0
    lookup_miss_chunks: int = 0
    stores: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    store_skipped_full: int = 0
    store_skipped_quota: int = 0  # pieces not stored: their model or tenant was at its quota
    store_pin_refused: int = 0  # pieces stored unpinned: server.max_pinned would be passed
    pinned_pieces: int = 0  # resident pieces pinned now
    pinned_bytes: int = 0
    retrieves: int = 0
    retrieved_chunks: int = 0
    retrieved_bytes: int = 0
    retrieve_missing: int = 0
    retrieve_late_chunks: int = 0  # chunks a retrieve did not copy: its deadline passed
    evictions: int = 0
    locks_held: int = 0
    locks_expired: int = 0
    integrity_failures: int = 0  # pool pieces whose bytes no longer matched their checksum: dropped
    integrity_verified_chunks: int = 0  # pieces checked (tier writes, verified retrieves): intact
    registered_instances: int = 0
    reaped_instances: int = 0
    gpu_instances: int = 0  # registrations of KV caches on a GPU (CUDA IPC)
    pool_pinned_bytes: int = 0  # page-locked bytes of the pool (its exact size, or 0: pageable)
    requests: int = 0
    errors: int = 0
    # disk tier (zeros without one)
    disk_chunks: int = 0
    disk_bytes: int = 0
    disk_loaded_chunks: int = 0
    disk_written_chunks: int = 0
    disk_write_dropped: int = 0
    disk_evicted_unsaved: int = 0
    disk_corrupt: int = 0
    disk_deleted: int = 0
    disk_errors: int = 0
    disk_queued: int = 0
    # remote (Redis/Valkey) tier (zeros without one)
    remote_loaded_chunks: int = 0
    remote_written_chunks: int = 0
    remote_write_dropped: int = 0
    remote_write_failed: int = 0
    remote_corrupt: int = 0
    remote_errors: int = 0
    remote_outages: int = 0
    remote_lookup_timeouts: int = 0
    remote_queued: int = 0
    remote_down: int = 0
    # KV events (``server.events_url``): batches published, reported keys dropped from the full
    # queue, keys waiting, replays answered, replay requests refused.
    events_batches: int = 0
    events_dropped: int = 0
    events_pending: int = 0
    events_replays: int = 0
    events_bad_replays: int = 0


class ModelStats(msgspec.Struct, kw_only=True):
    """One model's share of the pool."""

    model_name: str
    pieces: int
    bytes_used: int
    layouts: list[str] = msgspec.field(default_factory=list)
    quota_bytes: int | None = None
    registered: int = 0  # workers registered with this model


class TenantStats(msgspec.Struct, kw_only=True):
    """One ``cache_salt`` tenant's share of the pool, by its tag (``keys.tenant_tag``); ``name``:
    its label in ``server.tenant_quotas`` ("" for a tenant not there; a salt is never sent)."""

    tenant: str
    name: str = ""
    pieces: int = 0
    bytes_used: int = 0
    quota_bytes: int | None = None
