"""Prometheus metrics of one server: its counters, read at scrape time, and request latencies.

Nothing here runs on a request's path but ``ServerMetrics.observe``, which the transport calls once
per request (a ``perf_counter`` pair there, one ``Histogram.observe`` here: about 1 us). Everything
else is read when Prometheus scrapes, by ``ServerCollector``: the engine's ``stats()`` (one short hold
of its lock, the tiers' counters included) and ``model_stats()`` (each model's share of the pool),
the registry's workers per model, and the transport's request and error counts and in-flight
requests. Names follow Prometheus conventions (``lmcache_``
prefix, base units, ``_total`` counters); label values come from small fixed sets (op, error code,
tier, model name: never a hash or a request id). The library's process and Python collectors add
``process_*`` and ``python_*``. README.md lists every name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Histogram,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lmcache_core import __version__
from lmcache_core.engine import CacheEngine
from lmcache_core.errors import ErrorCode
from lmcache_core.protocol.ops import RequestType
from lmcache_core.server.registry import KVRegistry
from lmcache_core.transport.server import MessageQueueServer

#: Request latencies from 100 us (a lookup of a few chunks) to 10 s (a large copy under load).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)
#: Model names become label values; beyond this many the rest are summed under "other".
MAX_MODEL_LABELS = 32

# (metric name without lmcache_ and _total, ServerStats counter, help)
_ENGINE_COUNTERS = (
    ("lookups", "lookups", "Lookup requests served."),
    ("lookup_hit_chunks", "lookup_hit_chunks",
     "Chunks lookups found (the leading chunks every tensor-parallel rank holds)."),
    ("lookup_miss_chunks", "lookup_miss_chunks", "Chunks lookups asked for and did not find."),
    ("stores", "stores", "Store requests served."),
    ("stored_chunks", "stored_chunks", "Chunks copied into the pool by stores."),
    ("stored_bytes", "stored_bytes", "Bytes copied into the pool by stores."),
    ("store_skipped_full_chunks", "store_skipped_full",
     "Chunk pieces stores skipped: no pool space could be freed (every piece locked or being read)."),
    ("store_skipped_quota_chunks", "store_skipped_quota",
     "Chunk pieces stores skipped: their model or tenant was at its quota (server.quotas, "
     "server.tenant_quotas) and none of its own pieces could be evicted."),
    ("retrieves", "retrieves", "Retrieve requests served."),
    ("retrieved_chunks", "retrieved_chunks", "Chunks copied out of the pool by retrieves."),
    ("retrieved_bytes", "retrieved_bytes", "Bytes copied out of the pool by retrieves."),
    ("retrieve_missing_chunks", "retrieve_missing", "Chunks retrieves asked for and did not find."),
    ("retrieve_late_chunks", "retrieve_late_chunks",
     "Chunks retrieves did not copy because their load deadline passed (vLLM recomputes them)."),
    ("evictions", "evictions", "Chunks evicted from the pool (least recently used first)."),
    ("store_pin_refused_chunks", "store_pin_refused",
     "Chunk pieces stored unpinned although their store asked for a pin: server.max_pinned would "
     "have been passed."),
    ("lock_expirations", "locks_expired",
     "Chunk locks released by their TTL (a lookup whose retrieve never came)."),
    ("integrity_failures", "integrity_failures",
     "Chunk pieces in the pool whose bytes no longer matched the checksum taken at their store "
     "(found before a tier write or a verified retrieve): dropped, never served."),
    ("integrity_verified_chunks", "integrity_verified_chunks",
     "Chunk pieces checked against their checksum and found intact (tier writes; retrieves with "
     "integrity.verify_on_retrieve)."),
)
# (metric name, ServerStats field of the disk tier, of the remote tier, help); a tier label each.
_TIER_COUNTERS = (
    ("tier_read_chunks", "disk_loaded_chunks", "remote_loaded_chunks",
     "Chunks lookups loaded from a lower tier into the pool."),
    ("tier_written_chunks", "disk_written_chunks", "remote_written_chunks",
     "Chunks written behind to a lower tier."),
    ("tier_dropped_writes", "disk_write_dropped", "remote_write_dropped",
     "Chunk writes dropped because the tier's write queue was full."),
    ("tier_corrupt_chunks", "disk_corrupt", "remote_corrupt",
     "Chunks read back from a tier whose checksum did not match (dropped, never served)."),
    ("tier_errors", "disk_errors", "remote_errors", "I/O errors of a tier."),
)
_DISK_COUNTERS = (
    ("disk_evicted_unsaved_chunks", "disk_evicted_unsaved",
     "Chunks evicted from the pool before the disk tier had written them."),
    ("disk_deleted_chunks", "disk_deleted", "Chunk files deleted to stay within disk.max_size."),
)
_REMOTE_COUNTERS = (
    ("remote_failed_writes", "remote_write_failed", "Chunk writes Redis refused or timed out."),
    ("remote_outages", "remote_outages", "Times Redis was found down (then skipped and probed)."),
    ("remote_lookup_timeouts", "remote_lookup_timeouts",
     "Lookups that stopped waiting on Redis at their deadline."),
)


class ServerMetrics:
    """The registry ``/metrics`` serves, and the latency histogram the transport feeds."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        latency = Histogram(
            "lmcache_request_duration_seconds",
            "Time serving a request (decode, handler, encode; not the wait in the queue), by op.",
            ["op"], buckets=LATENCY_BUCKETS, registry=self.registry)
        # One child per op of ours made now: every op's series exists from the start, and
        # observe() does no label lookup. LMCache's ops (a fixed set of names) get theirs at first.
        self._latency = latency
        self._observers: dict[RequestType | str, Callable[[float], None]] = {
            op: latency.labels(op=op_label(op)).observe for op in RequestType}
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)

    def observe(self, op: RequestType | str, seconds: float, _error_code: str) -> None:
        """One served request (the transport's ``observe`` hook); a str op is LMCache's."""
        observer = self._observers.get(op)
        if observer is None:
            observer = self._observers[op] = self._latency.labels(op=op_label(op)).observe
        observer(seconds)

    def watch(self, collector: Collector) -> None:
        """Add a collector read at every scrape (the server's ``ServerCollector``)."""
        self.registry.register(collector)


def op_label(op: RequestType | str) -> str:
    """``lmc.store`` -> ``store``; LMCache's ``store`` (its op name) -> ``lmcache.store``."""
    if isinstance(op, RequestType):
        return op.value.removeprefix("lmc.")
    return "lmcache." + op


#: (metric name without ``lmcache_``/``_total``, publisher field, help) of the KV events.
_EVENT_COUNTERS = (
    ("kv_events_batches", "events_batches", "KV-event batches published."),
    ("kv_events_dropped", "events_dropped",
     "Reported keys dropped because the KV-event queue was full (routers miss them)."),
    ("kv_events_replays", "events_replays", "KV-event replay requests answered."),
    ("kv_events_bad_replays", "events_bad_replays", "Malformed KV-event replay requests."),
)


class ServerCollector(Collector):
    """Reads one server's counters when Prometheus scrapes; holds no state of its own."""

    def __init__(self, engine: CacheEngine, registry: KVRegistry, transport: MessageQueueServer,
                 chunk_size: int, *, disk: bool = False, remote: bool = False,
                 events: Callable[[], dict[str, int]] | None = None) -> None:
        self._engine = engine
        self._events = events  # the KV-event publisher's counters (server.events_url)
        self._registry = registry
        self._transport = transport
        self._chunk_size = chunk_size
        self._disk = disk
        self._remote = remote

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the names depend on the tiers configured: no check at registration

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        yield from self._requests()
        for name, field, help_text in _ENGINE_COUNTERS:
            yield _counter(name, help_text, stats[field])
        yield _counter("lookup_hit_tokens", "Tokens of the chunks lookups found.",
                       stats["lookup_hit_chunks"] * self._chunk_size)
        pool = self._engine.pool
        yield _gauge("pool_capacity_bytes", "Bytes of the memory pool (preallocated).", pool.nbytes)
        yield _gauge("pool_used_bytes", "Bytes of chunk pieces resident in the pool.",
                     stats["bytes_used"])
        yield _gauge("pool_allocated_bytes",
                     "Bytes of the pool's allocations (resident pieces and those being written, "
                     "each rounded up to its size class).", stats["pool_bytes_allocated"])
        yield _gauge("pool_slabs", "Slabs of the pool (each holds pieces of one size class).",
                     stats["pool_slabs"])
        yield _gauge("pool_free_slabs", "Slabs of the pool assigned to no size class.",
                     stats["pool_slabs_free"])
        yield _gauge("pool_chunks",
                     "Chunk pieces resident in the pool (visible to lookups; a piece is some KV "
                     "heads of one chunk).", stats["chunks"])
        yield _gauge("pinned_chunks", "Chunk pieces pinned now (never evicted until their TTL).",
                     stats["pinned_pieces"])
        yield _gauge("pinned_bytes", "Bytes of the chunk pieces pinned now.", stats["pinned_bytes"])
        yield from self._models()
        yield from self._tenants()
        if self._events is not None:
            yield from self._kv_events(self._events())
        yield _gauge("lookup_locks",
                     "Chunk locks lookups hold for coming retrieves (a chunk locked by two lookups "
                     "counts twice); locked chunks are never evicted.", stats["locks_held"])
        yield from self._workers()
        if self._disk or self._remote:
            yield from self._tiers(stats)
        info = GaugeMetricFamily("lmcache_build_info", "The lmcache version serving (always 1).",
                                 labels=["version"])
        info.add_metric([__version__], 1)
        yield info

    def _requests(self) -> Iterator[Metric]:
        counters = self._transport.counters
        yield _counter("requests", "Requests received (every frame set, answered or rejected).",
                       counters.requests)
        errors = CounterMetricFamily("lmcache_errors", "Error replies sent, by error code.",
                                     labels=["code"])
        by_code = dict.fromkeys((code.value for code in ErrorCode), 0)
        by_code.update(counters.errors_by_code)
        for code, count in sorted(by_code.items()):
            errors.add_metric([code], count)
        yield errors
        yield _gauge("requests_in_flight",
                     "Store, retrieve and registration requests (and lookups, with a lower tier) "
                     "queued for or running on the copy workers.", self._transport.in_flight)

    def _models(self) -> Iterator[Metric]:
        """Each model's share of the pool, by model (the largest first; beyond MAX_MODEL_LABELS
        the rest summed under "other"), and the quotas of those that have one."""
        rows = sorted(self._engine.model_stats(), key=lambda row: (-row.bytes_used, row.model_name))
        used = GaugeMetricFamily("lmcache_model_used_bytes",
                                 "Bytes of a model's chunk pieces resident in the pool, by model.",
                                 labels=["model"])
        pieces = GaugeMetricFamily("lmcache_model_pieces",
                                   "A model's chunk pieces resident in the pool, by model.",
                                   labels=["model"])
        for row in rows[:MAX_MODEL_LABELS]:
            used.add_metric([row.model_name], row.bytes_used)
            pieces.add_metric([row.model_name], row.pieces)
        if len(rows) > MAX_MODEL_LABELS:
            rest = rows[MAX_MODEL_LABELS:]
            used.add_metric(["other"], sum(row.bytes_used for row in rest))
            pieces.add_metric(["other"], sum(row.pieces for row in rest))
        yield used
        yield pieces
        quotas = GaugeMetricFamily("lmcache_model_quota_bytes",
                                   "A model's memory quota (server.quotas), by model.",
                                   labels=["model"])
        for model, quota in sorted(self._engine.quotas.items())[:MAX_MODEL_LABELS]:
            quotas.add_metric([model], quota)
        yield quotas

    def _tenants(self) -> Iterator[Metric]:
        """Each cache_salt tenant's bytes and quota, labelled by its label in
        server.tenant_quotas, else its tag (``keys.tenant_tag``): the named ones, then the
        largest others up to MAX_MODEL_LABELS in all."""
        rows = self._engine.tenant_stats()[:MAX_MODEL_LABELS]
        used = GaugeMetricFamily("lmcache_tenant_used_bytes",
                                 "Bytes of a cache_salt tenant's chunk pieces resident in the pool, "
                                 "by tenant (its label in server.tenant_quotas, else its tag).",
                                 labels=["tenant"])
        quotas = GaugeMetricFamily("lmcache_tenant_quota_bytes",
                                   "A cache_salt tenant's memory quota (server.tenant_quotas), by "
                                   "tenant.", labels=["tenant"])
        for row in rows:
            used.add_metric([row.name or row.tenant], row.bytes_used)
            if row.quota_bytes is not None:
                quotas.add_metric([row.name or row.tenant], row.quota_bytes)
        yield used
        yield quotas

    def _workers(self) -> Iterator[Metric]:
        models = self._registry.models()
        workers = GaugeMetricFamily("lmcache_registered_workers",
                                    "KV caches registered (one per worker rank), by model.",
                                    labels=["model"])
        ranked = sorted(models.items(), key=lambda item: (-item[1], item[0]))
        for model, count in ranked[:MAX_MODEL_LABELS]:
            workers.add_metric([model], count)
        if len(ranked) > MAX_MODEL_LABELS:
            workers.add_metric(["other"], sum(count for _, count in ranked[MAX_MODEL_LABELS:]))
        yield workers
        yield _gauge("registered_models", "Models with at least one registered KV cache.",
                     len(models))
        yield _counter("reaped_workers",
                       "Registered KV caches dropped because their worker died or went silent.",
                       self._registry.reaped)

    @staticmethod
    def _kv_events(stats: dict[str, int]) -> Iterator[Metric]:
        for name, field, help_text in _EVENT_COUNTERS:
            yield _counter(name, help_text, stats[field])
        yield _gauge("kv_events_pending", "Reported keys waiting for the next KV-event batch.",
                     stats["events_pending"])

    def _tiers(self, stats: dict[str, int]) -> Iterator[Metric]:
        tiers = [t for t, on in (("disk", self._disk), ("remote", self._remote)) if on]
        for name, disk_field, remote_field, help_text in _TIER_COUNTERS:
            family = CounterMetricFamily(f"lmcache_{name}", help_text, labels=["tier"])
            for tier in tiers:
                family.add_metric([tier], stats.get(disk_field if tier == "disk" else remote_field, 0))
            yield family
        queued = GaugeMetricFamily("lmcache_tier_queued_writes",
                                   "Chunk writes waiting in a tier's write-behind queue.",
                                   labels=["tier"])
        for tier in tiers:
            queued.add_metric([tier], stats.get(f"{tier}_queued", 0))
        yield queued
        if self._disk:
            yield _gauge("disk_used_bytes", "Bytes of chunk files on disk.", stats.get("disk_bytes", 0))
            yield _gauge("disk_chunks", "Chunk files on disk.", stats.get("disk_chunks", 0))
            for name, field, help_text in _DISK_COUNTERS:
                yield _counter(name, help_text, stats.get(field, 0))
        if self._remote:
            yield _gauge("remote_up", "1 while Redis answers, 0 during an outage (lookups and writes "
                         "skip it then).", 1 - stats.get("remote_down", 0))
            for name, field, help_text in _REMOTE_COUNTERS:
                yield _counter(name, help_text, stats.get(field, 0))


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"lmcache_{name}", help_text, value=value)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"lmcache_{name}", help_text, value=value)
