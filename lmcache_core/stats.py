"""The stats schema: every figure a server reports, declared once, in the structs that hold it.

Each component owns one struct and adds to its fields (``EngineStats``: the engine; ``DiskStats``,
``RemoteStats``: the tiers; ``EventStats``: the KV-event publisher; ``TransportStats``: the socket
loop; ``WorkerStats``: the registry); ``ServerStats`` nests them and is sent as is in SERVER_INFO.
A field's declaration (``counter`` or ``gauge``: its Prometheus name, help and labels, in its
``msgspec.Meta``) is all that ``/metrics`` (``server.metrics``), ``lmcache stats`` (``flat_all``)
and ``docs/metrics.md`` read: adding a figure is one line in one struct here.

Counters only grow; gauges are read when a snapshot is taken (their owner fills them then). A
section of ``ServerStats`` is None when its component is not configured (no disk tier, say).
Imports msgspec and ``errors`` alone: the engine and the tiers use this module, the protocol
embeds it.
"""

from __future__ import annotations

import functools
import threading
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec

from lmcache_core.errors import ErrorCode

Kind = Literal["counter", "gauge"]
S = TypeVar("S", bound="Stats")

_LOCK = threading.Lock()  # ``add`` and ``copy`` of every struct: adds are rare and tiny next to I/O


def counter(help_text: str, metric: str = "", *, label: str = "", tier: bool = False,
            total_of: str = "") -> msgspec.Meta:
    """A figure that only grows: ``lmcache_<metric>_total`` (``metric`` defaults to the field's
    name). ``label``: a ``dict[str, int]`` field is one sample per key, labelled so. ``tier``: one
    sample labelled ``tier`` (the struct's ``tier``) of a family every tier shares. ``total_of``:
    not a family of its own, the sum of family ``lmcache_<total_of>``'s samples."""
    return _declare("counter", help_text, metric, label, tier, total_of)


def gauge(help_text: str, metric: str = "", *, label: str = "", tier: bool = False,
          total_of: str = "") -> msgspec.Meta:
    """A figure read now: ``lmcache_<metric>`` (as ``counter``, without ``_total``)."""
    return _declare("gauge", help_text, metric, label, tier, total_of)


def _declare(kind: Kind, help_text: str, metric: str, label: str, tier: bool,
             total_of: str) -> msgspec.Meta:
    return msgspec.Meta(description=help_text, extra={
        "kind": kind, "metric": metric, "label": label, "tier": tier, "total_of": total_of})


class Figure(msgspec.Struct, frozen=True):
    """One field's declaration, as ``declared`` reads it back."""

    field: str
    kind: Kind
    metric: str  # without ``lmcache_`` and ``_total``
    help: str
    label: str = ""
    tier: bool = False
    total_of: str = ""

    @property
    def family(self) -> str:
        """The exposed family name (``lmcache_..._total`` for a counter)."""
        name = f"lmcache_{self.total_of or self.metric}"
        return name + "_total" if self.kind == "counter" else name


class Stats(msgspec.Struct, kw_only=True):
    """The base of every section: ``add`` from any thread, ``copy`` read at one moment.

    ``prefix``: what ``flat`` puts before its fields' names; ``tier``: the value of the ``tier``
    label of its tier-shared families."""

    prefix: ClassVar[str] = ""
    tier: ClassVar[str] = ""

    def add(self, **deltas: int) -> None:
        """Add each ``name=delta`` to its field, atomically (``x.n += 1`` from two threads can lose
        one: a read, an add and a write)."""
        with _LOCK:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def copy(self: S, **now: Any) -> S:
        """A copy read at one moment, with the gauges in ``now`` filled in."""
        with _LOCK:
            return msgspec.structs.replace(self, **now)


# ---------------------------------------------------------------------------- the engine


class EngineStats(Stats):
    """The engine's figures: its counters (added to in place, under the engine's lock) and the
    pool's and index's state (gauges, filled by the engine's ``snapshot``)."""

    lookups: Annotated[int, counter("Lookup requests served.")] = 0
    lookup_hit_chunks: Annotated[int, counter(
        "Chunks lookups found (the leading chunks every tensor-parallel rank holds).")] = 0
    lookup_hit_tokens: Annotated[int, counter(
        "Tokens of the chunks lookups found (hit chunks x chunk_size).")] = 0
    lookup_miss_chunks: Annotated[int, counter("Chunks lookups asked for and did not find.")] = 0
    stores: Annotated[int, counter("Store requests served.")] = 0
    stored_chunks: Annotated[int, counter("Chunks copied into the pool by stores.")] = 0
    stored_bytes: Annotated[int, counter("Bytes copied into the pool by stores.")] = 0
    store_skipped_full: Annotated[int, counter(
        "Chunk pieces stores skipped: no pool space could be freed (every piece locked or being "
        "read).", "store_skipped_full_chunks")] = 0
    store_skipped_quota: Annotated[int, counter(
        "Chunk pieces stores skipped: their model or tenant was at its quota (server.quotas, "
        "server.tenant_quotas) and none of its own pieces could be evicted.",
        "store_skipped_quota_chunks")] = 0
    store_pin_refused: Annotated[int, counter(
        "Chunk pieces stored unpinned although their store asked for a pin: server.max_pinned "
        "would have been passed.", "store_pin_refused_chunks")] = 0
    store_late: Annotated[int, counter(
        "Chunks stores did not copy: the request reached a copy thread past its copy_by_ns (half "
        "the worker's request timeout), when the worker may have given up on it and vLLM reused "
        "its blocks.", "store_late_chunks")] = 0
    retrieves: Annotated[int, counter("Retrieve requests served.")] = 0
    retrieved_chunks: Annotated[int, counter("Chunks copied out of the pool by retrieves.")] = 0
    retrieved_bytes: Annotated[int, counter("Bytes copied out of the pool by retrieves.")] = 0
    retrieve_missing: Annotated[int, counter(
        "Chunks retrieves asked for and did not find.", "retrieve_missing_chunks")] = 0
    retrieve_late_chunks: Annotated[int, counter(
        "Chunks retrieves did not copy because their load deadline passed (vLLM recomputes "
        "them).")] = 0
    evictions: Annotated[int, counter(
        "Chunks evicted from the pool (least recently used first).")] = 0
    locks_expired: Annotated[int, counter(
        "Chunk locks released by their TTL (a lookup whose retrieve never came).",
        "lock_expirations")] = 0
    integrity_failures: Annotated[int, counter(
        "Chunk pieces in the pool whose bytes no longer matched the checksum taken at their "
        "store (found before a tier write or a verified retrieve): dropped, never served.")] = 0
    integrity_verified_chunks: Annotated[int, counter(
        "Chunk pieces checked against their checksum and found intact (tier writes; retrieves "
        "with integrity.verify_on_retrieve).")] = 0
    checksums_abandoned: Annotated[int, counter(
        "Chunk pieces dropped because their checksum, taken after their store replied, was not "
        "taken in time (a stuck hash) or the server stopped first.",
        "checksums_abandoned_chunks")] = 0
    # gauges
    chunks: Annotated[int, gauge(
        "Chunk pieces resident in the pool (visible to lookups; a piece is some KV heads of one "
        "chunk).", "pool_chunks")] = 0
    bytes_used: Annotated[int, gauge(
        "Bytes of chunk pieces resident in the pool.", "pool_used_bytes")] = 0
    pool_capacity_bytes: Annotated[int, gauge("Bytes of the memory pool (preallocated).")] = 0
    pool_bytes_allocated: Annotated[int, gauge(
        "Bytes of the pool's allocations (resident pieces and those being written, each rounded "
        "up to its size class).", "pool_allocated_bytes")] = 0
    pool_slabs: Annotated[int, gauge(
        "Allocation units of the pool (server.slab_size each: a slab of one size class, or part "
        "of one larger piece).")] = 0
    pool_slabs_free: Annotated[int, gauge(
        "Units of the pool that no slab or larger piece holds.", "pool_free_slabs")] = 0
    pool_pinned_bytes: Annotated[int, gauge(
        "Page-locked bytes of the pool (its exact size, or 0: pageable).")] = 0
    pinned_pieces: Annotated[int, gauge(
        "Chunk pieces pinned now (never evicted until their TTL).", "pinned_chunks")] = 0
    pinned_bytes: Annotated[int, gauge("Bytes of the chunk pieces pinned now.")] = 0
    locks_held: Annotated[int, gauge(
        "Chunk locks lookups hold for coming retrieves (a chunk locked by two lookups counts "
        "twice); locked chunks are never evicted.", "lookup_locks")] = 0
    checksums_pending: Annotated[int, gauge(
        "Chunk pieces whose checksum is still being taken after their store replied (each is held "
        "until then: tier writes and verified retrieves wait for it).", "checksums_pending_chunks")] = 0


# ---------------------------------------------------------------------------- lower tiers


class TierStats(Stats):
    """What every lower tier counts, one family each with a ``tier`` label."""

    loaded_chunks: Annotated[int, counter(
        "Chunks lookups loaded from a lower tier into the pool.", "tier_read_chunks",
        tier=True)] = 0
    written_chunks: Annotated[int, counter(
        "Chunks written behind to a lower tier.", "tier_written_chunks", tier=True)] = 0
    write_dropped: Annotated[int, counter(
        "Chunk writes dropped because the tier's write queue was full.", "tier_dropped_writes",
        tier=True)] = 0
    corrupt: Annotated[int, counter(
        "Chunks read back from a tier whose checksum did not match (dropped, never served).",
        "tier_corrupt_chunks", tier=True)] = 0
    errors: Annotated[int, counter("I/O errors of a tier.", "tier_errors", tier=True)] = 0
    queued: Annotated[int, gauge(
        "Chunk writes waiting in a tier's write-behind queue.", "tier_queued_writes",
        tier=True)] = 0


class DiskStats(TierStats):
    """The disk tier's figures (``storage.disk.DiskTier`` adds to them)."""

    prefix: ClassVar[str] = "disk_"
    tier: ClassVar[str] = "disk"

    evicted_unsaved: Annotated[int, counter(
        "Chunks evicted from the pool before the disk tier had written them.",
        "disk_evicted_unsaved_chunks")] = 0
    deleted: Annotated[int, counter(
        "Chunk files deleted to stay within disk.max_size.", "disk_deleted_chunks")] = 0
    chunks: Annotated[int, gauge("Chunk files on disk.", "disk_chunks")] = 0
    bytes: Annotated[int, gauge("Bytes of chunk files on disk.", "disk_used_bytes")] = 0


class RemoteStats(TierStats):
    """The remote tier's figures, Redis/Valkey or Mooncake Store (``storage.remote_tier.RemoteTier``
    adds to them)."""

    prefix: ClassVar[str] = "remote_"
    tier: ClassVar[str] = "remote"

    write_failed: Annotated[int, counter(
        "Chunk writes the remote store (Redis, Mooncake Store) refused or timed out.",
        "remote_failed_writes")] = 0
    outages: Annotated[int, counter(
        "Times the remote store was found down (then skipped and probed).", "remote_outages")] = 0
    lookup_timeouts: Annotated[int, counter(
        "Lookups that stopped waiting on the remote store at their deadline.",
        "remote_lookup_timeouts")] = 0
    up: Annotated[int, gauge(
        "1 while the remote store answers, 0 during an outage (lookups and writes skip it then).",
        "remote_up")] = 1


# ---------------------------------------------------------------------------- the server


class EventStats(Stats):
    """The KV-event publisher's figures (``server.events_url``)."""

    prefix: ClassVar[str] = "events_"

    batches: Annotated[int, counter("KV-event batches published.", "kv_events_batches")] = 0
    dropped: Annotated[int, counter(
        "Reported keys dropped because the KV-event queue was full (routers miss them).",
        "kv_events_dropped")] = 0
    replays: Annotated[int, counter(
        "KV-event replay requests answered.", "kv_events_replays")] = 0
    bad_replays: Annotated[int, counter(
        "Malformed KV-event replay requests.", "kv_events_bad_replays")] = 0
    pending: Annotated[int, gauge(
        "Reported keys waiting for the next KV-event batch.", "kv_events_pending")] = 0


def _no_errors() -> dict[str, int]:
    return dict.fromkeys((code.value for code in ErrorCode), 0)


class TransportStats(Stats):
    """The socket loop's figures: only its thread adds to them (workers hand their errors back
    with their replies), so plain ``+=`` and ``error`` need no lock."""

    requests: Annotated[int, counter(
        "Requests received (every frame set, answered or rejected).")] = 0
    errors: Annotated[int, counter("Error replies sent.", total_of="errors")] = 0
    errors_by_code: Annotated[dict[str, int], counter(
        "Error replies sent, by error code.", "errors", label="code")] = msgspec.field(
            default_factory=_no_errors)
    in_flight: Annotated[int, gauge(
        "Store, retrieve and registration requests (and lookups, with a lower tier) queued for or "
        "running on the copy workers.", "requests_in_flight")] = 0

    def error(self, code: str) -> None:
        """One more error reply, with this code (one of ``ErrorCode``'s: a small fixed set)."""
        self.errors += 1
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1

    def copy(self, **now: Any) -> TransportStats:
        return super().copy(errors_by_code=dict(self.errors_by_code), **now)


class WorkerStats(Stats):
    """The registered KV caches (``server.registry.KVRegistry.stats``, read when asked)."""

    registered_instances: Annotated[int, gauge(
        "KV caches registered (one per worker rank; a hybrid model's: one per KV-cache group).",
        total_of="registered_workers")] = 0
    registered_models: Annotated[int, gauge(
        "Models with at least one registered KV cache.")] = 0
    gpu_instances: Annotated[int, gauge(
        "KV caches registered on a GPU (CUDA IPC).", "registered_gpu_workers")] = 0
    reaped_instances: Annotated[int, counter(
        "Registered KV caches dropped because their worker died or went silent.",
        "reaped_workers")] = 0


class ServerStats(msgspec.Struct, kw_only=True):
    """Every section, as SERVER_INFO sends it (None: that component is not configured)."""

    engine: EngineStats = msgspec.field(default_factory=EngineStats)
    transport: TransportStats = msgspec.field(default_factory=TransportStats)
    workers: WorkerStats = msgspec.field(default_factory=WorkerStats)
    disk: DiskStats | None = None
    remote: RemoteStats | None = None
    events: EventStats | None = None


class GroupStats(msgspec.Struct, kw_only=True):
    """One KV-cache group of a hybrid model as its workers registered it (``KVGroup``), and the
    layout fingerprint its pieces are filed under."""

    index: int
    count: int
    kind: str  # full | sliding | mamba | local
    block_size: int
    window_tokens: int = 0  # a sliding window's tokens, a local group's attention chunk's
    layout: str = ""


class ModelStats(msgspec.Struct, kw_only=True):
    """One model's share of the pool."""

    model_name: str
    pieces: int
    bytes_used: int
    layouts: list[str] = msgspec.field(default_factory=list)
    quota_bytes: int | None = None
    registered: int = 0  # workers registered with this model
    groups: list[GroupStats] = msgspec.field(default_factory=list)  # a hybrid model's


class TenantStats(msgspec.Struct, kw_only=True):
    """One ``cache_salt`` tenant's share of the pool, by its tag (``keys.tenant_tag``); ``name``:
    its label in ``server.tenant_quotas`` ("" for a tenant not there; a salt is never sent)."""

    tenant: str
    name: str = ""
    pieces: int = 0
    bytes_used: int = 0
    quota_bytes: int | None = None


# ---------------------------------------------------------------------------- reading the schema


@functools.cache
def sections() -> tuple[tuple[str, type[Stats]], ...]:
    """``(name, struct)`` of every section of ``ServerStats``, in order."""
    out: list[tuple[str, type[Stats]]] = []
    for field in msgspec.inspect.type_info(ServerStats).fields:  # type: ignore[attr-defined]
        kind = field.type
        types = kind.types if isinstance(kind, msgspec.inspect.UnionType) else (kind,)
        [struct] = [t.cls for t in types if isinstance(t, msgspec.inspect.StructType)]
        out.append((field.name, struct))  # type: ignore[arg-type]  # every section is a Stats
    return tuple(out)


@functools.cache
def declared(struct: type[Stats]) -> tuple[Figure, ...]:
    """The declaration of every field of ``struct``; a field declared neither ``counter`` nor
    ``gauge`` is a mistake this refuses (it would be shown nowhere)."""
    out = []
    for field in msgspec.inspect.type_info(struct).fields:  # type: ignore[attr-defined]
        meta = field.type
        extra = meta.extra if isinstance(meta, msgspec.inspect.Metadata) else None
        if not extra or "kind" not in extra:
            raise TypeError(f"{struct.__name__}.{field.name} is declared neither counter nor gauge")
        out.append(Figure(field=field.name, kind=extra["kind"], metric=extra["metric"] or field.name,
                          help=meta.extra_json_schema["description"], label=extra["label"],
                          tier=extra["tier"], total_of=extra["total_of"]))
    return tuple(out)


def flat(section: Stats) -> dict[str, Any]:
    """One section's fields by their flat names (its ``prefix`` before each): the names SERVER_INFO
    used before it was nested, which ``lmcache stats --json`` keeps."""
    return {section.prefix + name: value for name, value in msgspec.structs.asdict(section).items()}


def flat_all(stats: ServerStats) -> dict[str, Any]:
    """Every section's ``flat`` fields (a section not configured: its defaults)."""
    out: dict[str, Any] = {}
    for name, struct in sections():
        section = getattr(stats, name)
        out.update(flat(section if section is not None else struct()))
    return out
