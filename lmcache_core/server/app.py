"""``CacheServer``: builds the pool, engine, registry and transport from a config, and runs them.

Its parts are built in dependency order, each given what it needs in its constructor: the pool,
the KV-event publisher, the tiers (told of their pieces' events), the engine over them, the
registry (with what opens a worker's mapping), the transport (with whom to tell of a closed
connection), the checksum lanes (made, closed and reaped here), the handlers (with their hooks:
the transport's copy threads, the supervisor's failure), the server's own views (SERVER_INFO,
LIST_CHUNKS: with every component's figures and the urls as bound), LMCache's front end (with the
chunk size and the engine's store). ``start()`` gives the transport the routes it serves and the
tiers' writers what they write from (the engine's store, built after them: one of the two that
speak to each other has to come second).

Lifecycle (what ``lmcache serve`` drives): ``start()`` binds and starts serving; a housekeeping thread
expires lookup locks past their TTL and reaps workers that died; ``stop()`` answers new requests with
SHUTTING_DOWN, lets in-flight copies finish, closes the engine (its own threads), unmaps every worker's
shared memory and closes the socket.

Supervision: every long-lived thread (transport loop, copy workers, housekeeper, tier writers) is
spawned through one ``Supervisor``. When any of them dies, ``failed`` is set and ``wait()`` returns,
with the reason in ``failure``; ``lmcache serve`` then exits non-zero so that it is restarted.

Lower tiers come from the config's optional ``disk`` and ``remote`` sections; with either, lookups run
on the worker pool (they may read disk or wait on Redis, bounded by ``timeouts.lookup_ms``) and the
pool gets two more threads for them. ``start()`` starts the tiers' writer threads, ``stop()`` drains
their queues (bounded) after the transport has stopped.

Operators (unless ``server.http_url`` is off): an ``HttpListener`` serves ``/metrics`` (the
``ServerMetrics`` registry: a collector reading the counters at scrape time, and the transport's
per-request latency histogram), ``/healthz`` (``health``: every supervised thread alive) and
``/readyz`` (``readiness``: started and not stopping; degraded tiers named in the body).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from lmcache_core.config import LMCacheConfig
from lmcache_core.config_parse import parse_mooncake_url
from lmcache_core.engine import CacheEngine
from lmcache_core.protocol.codec import Limits
from lmcache_core.protocol.ops import RequestType
from lmcache_core.server.events import KVEventPublisher
from lmcache_core.server.handlers import CacheHandlers
from lmcache_core.server.http import HttpListener
from lmcache_core.server.listing import ServerViews
from lmcache_core.server.lmcache.front import LMCacheFrontEnd
from lmcache_core.server.metrics import ServerCollector, ServerMetrics
from lmcache_core.server.registry import KVRegistry, MappingOpener
from lmcache_core.server.segments import sweep_stale_segments
from lmcache_core.storage.checksum_lanes import ChecksumLanes
from lmcache_core.storage.disk import DiskTier
from lmcache_core.storage.pool import MemoryPool
from lmcache_core.supervision import Supervisor
from lmcache_core.transport.server import MessageQueueServer, Route

if TYPE_CHECKING:
    from lmcache_core.events import KVEventSink
    from lmcache_core.storage.remote_tier import RemoteTier

logger = logging.getLogger(__name__)
HOUSEKEEPING_INTERVAL_S = 1.0


def one_thread_per_copy() -> None:
    """Make this process's torch copy on the calling thread only (one intra-op thread): what
    ``lmcache serve`` does before it builds the server. Its copies already run side by side on
    the copy workers (``server.workers``). With torch's default (a thread per core), each
    worker's copy forks an OpenMP team, and the teams and workers fight for the cores: on 2 cores,
    2 workers ran 4 threads, and a 2 MiB chunk's scatter took 1.1-2.6 ms of wall time for 0.5-0.8
    ms of CPU. With one thread it took 0.32-0.37 ms for as much CPU, and a hybrid model's hit
    went from 54-64 to 44-46 ms (``scripts/profile_hit.py --with-vllm-cache``). Memory-bound
    copies gain little from a team anyway: one 8 MiB scatter ran at 5.4 GB/s on 1 thread and
    5.0 on 2."""
    import torch

    torch.set_num_threads(1)


class CacheServer:
    """One ``lmcache serve`` instance."""

    def __init__(self, config: LMCacheConfig, context: zmq.Context[Any] | None = None) -> None:
        self.config = config
        server = config.server
        self.pool = MemoryPool(server.pool_bytes, server.slab_bytes)
        self.events = KVEventPublisher.from_config(config, context)  # None unless server.events_url
        self.disk, self.remote = build_tiers(config, self.events, self.pool)
        self.engine = CacheEngine(self.pool, config.chunk_size,
                                  lock_ttl_s=config.timeouts.lock_ttl_s, disk=self.disk,
                                  remote=self.remote, events=self.events,
                                  quotas=server.quota_bytes,
                                  tenant_quotas=server.tenant_quota_bytes,
                                  max_pinned_bytes=server.max_pinned_bytes)
        tiered = self.engine.tiers is not None
        self._done = threading.Event()  # a stop was asked for, or a thread died
        self.supervisor = Supervisor(on_failure=lambda _reason: self._done.set())
        self.metrics = ServerMetrics() if server.http_address is not None else None
        self.registry = KVRegistry(MappingOpener(config, self.pool).open, server.reap_timeout_s)
        self.transport = MessageQueueServer(
            server.url, context=context, workers=server.workers + (2 if tiered else 0),
            limits=Limits(server.max_request_bytes, server.max_keys_per_request),
            supervisor=self.supervisor,
            observe=self.metrics.observe if self.metrics is not None else None,
            on_disconnect=self.registry.disconnected)  # a killed GPU worker
        self.checksum_lanes = ChecksumLanes()  # stores' pieces hashed there, off their reply
        started = time.monotonic()
        self.handlers = CacheHandlers(
            config, self.engine, self.registry, self.checksum_lanes, started=started,
            add_copy_threads=self.transport.add_workers,  # more per GPU registered
            copies_stalled=self.supervisor.fail)  # the GPU left copies in flight
        self.views = ServerViews(
            config, self.engine, self.pool, self.registry, disk=self.disk, remote=self.remote,
            transport_stats=self.transport.stats,
            events_stats=self.events.stats if self.events is not None else None,
            url=lambda: self.url, http_url=lambda: self.http_url, started=started)
        # LMCache's clients: its wire and routes, on the same pipeline as ours.
        self.lmcache = LMCacheFrontEnd(self.handlers, self.registry, self.engine.store,
                                       config.chunk_size, tiered=tiered, post=self.transport.post,
                                       limits=self.transport.limits)
        self._stop = threading.Event()
        self._housekeeper: threading.Thread | None = None
        self._populator: threading.Thread | None = None  # server.prefault: maps the pool's pages
        self._ready = threading.Event()  # started, and not stopping
        self.http: HttpListener | None = None
        if self.metrics is not None:
            self.metrics.watch(ServerCollector(self.views.server_stats, self.engine,
                                               self.registry))

    @property
    def url(self) -> str:
        return self.transport.bound_url

    def start(self) -> str:
        """Bind and serve; returns the bound url."""
        sweep_stale_segments(self.config.server.allowed_uids)  # dead workers' leftover names
        if self.events is not None:
            self.events.start(self.supervisor)
        self._start_http()  # first: a port in use stops the start before anything else runs
        routes: dict[RequestType | str, Route] = {
            op: route for part in (self.handlers.routes(), self.views.routes(),
                                   self.lmcache.routes()) for op, route in part.items()}
        try:
            url = self.transport.start(routes, wires=[self.lmcache.wire])
        except BaseException:
            if self.http is not None:
                self.http.stop()
            raise
        if self.engine.tiers is not None:
            self.engine.tiers.start(self.supervisor)
        self._housekeeper = self.supervisor.spawn("lmcache-housekeeping", self._housekeep)
        self._ready.set()
        logger.info("serving on %s", url)
        if self.config.server.prefault:
            self._populator = self.supervisor.spawn("lmcache-pool-populate", self._populate_pool)
        return url

    def _start_http(self) -> None:
        address = self.config.server.http_address
        if self.metrics is None or address is None:
            return
        self.http = HttpListener(address[0], address[1], self.metrics.registry,
                                 {"/healthz": self.health, "/readyz": self.readiness},
                                 self.supervisor)
        self.http.start()
        logger.info("metrics and probes on %s", self.http.url)

    @property
    def http_url(self) -> str | None:
        """The HTTP listener's bound url (real port), or None when off or not started."""
        return self.http.url if self.http is not None else None

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Finish in-flight work, release shared memory, close the socket. Idempotent."""
        if self._stop.is_set():
            return
        self.supervisor.stopping()
        self._ready.clear()
        self._stop.set()
        self._done.set()
        self.transport.stop(drain_timeout_s)
        # After the copy threads (no store begins a hash) and before the tiers (their writers
        # wait for the checksums of what they write): the hashes still running finish, bounded.
        self.checksum_lanes.close(drain_timeout_s)
        if self.http is not None:
            self.http.stop()
        self.engine.close(drain_timeout_s)
        if self.engine.tiers is not None:
            self.engine.tiers.stop(drain_timeout_s)
        if self._housekeeper is not None:
            self._housekeeper.join(drain_timeout_s)
        if self._populator is not None:  # it sees _stop within one step (~0.1 s)
            self._populator.join(drain_timeout_s)
        if self.events is not None:  # after the tiers: publishes what the last work reported
            self.events.stop(drain_timeout_s)
        self.registry.close_all()
        logger.info("stopped")

    def request_stop(self) -> None:
        """Make ``wait()`` return (from a signal handler: the stop itself runs where ``wait`` was)."""
        self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until a stop was requested or a thread died (True), or ``timeout_s`` passed."""
        return self._done.wait(timeout_s)

    @property
    def failure(self) -> str | None:
        """Why the server cannot go on (a thread died), or None."""
        return self.supervisor.failure

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Liveness (``/healthz``): every supervised thread (socket loop, copy workers,
        housekeeper, tier writers, HTTP) runs; else False and why."""
        if self.supervisor.healthy():
            return True, {"status": "ok"}
        return False, {"status": "failed",
                       "reason": self.supervisor.failure or "a server thread is not running"}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Readiness (``/readyz``): started (pool allocated, socket listening) and not stopping.

        A lower tier that is down does not make the server unready (it serves from memory and
        skips the tier until it is back): the body names it under ``degraded``."""
        if self.supervisor.failed:
            return False, {"status": "failed", "reason": self.supervisor.failure}
        if self._stop.is_set():
            return False, {"status": "stopping"}
        if not self._ready.is_set():
            return False, {"status": "starting"}
        tiers = {"memory": "ok"}
        if self.disk is not None:
            tiers["disk"] = "ok"
        if self.remote is not None:
            tiers["remote"] = "down" if self.remote.down else "ok"
        degraded = [tier for tier, state in tiers.items() if state != "ok"]
        return True, {"status": "degraded" if degraded else "ready", "url": self.url,
                      "tiers": tiers, "degraded": degraded}

    def _populate_pool(self) -> None:
        """Map the pool's pages ahead of the first stores (safe beside them: see storage/pool.py);
        a one-shot thread, so its end is expected."""
        try:
            self.pool.populate(self._stop)
        finally:
            self.supervisor.retire(threading.current_thread())

    def _housekeep(self) -> None:
        # No catch-all: an error here is a bug that would otherwise repeat every second while
        # locks and dead workers pile up; ending the thread makes the server exit and restart.
        while not self._stop.wait(HOUSEKEEPING_INTERVAL_S):
            expired = self.engine.store.expire_locks()
            if expired:
                logger.info("released %d lookup lock(s) past their TTL", expired)
            self.checksum_lanes.reap()  # a store's hash stuck past LANE_TIMEOUT_S
            self.registry.reap()


def build_tiers(config: LMCacheConfig, events: KVEventSink | None,
                pool: MemoryPool) -> tuple[DiskTier | None, RemoteTier | None]:
    """The disk and remote tiers the config asks for (None for each it does not), each telling
    ``events`` of the pieces it writes and drops; ``pool``: the memory pool a Mooncake tier reads
    into and writes from in place (registered with its transfer engine)."""
    disk = None
    if config.disk is not None:
        disk = DiskTier(config.disk.path, config.disk.max_bytes, config.disk.write_through,
                        config.disk.queue_size, events=events)
    cfg = config.remote
    if cfg is None:
        return disk, None
    if cfg.kind == "mooncake":
        from lmcache_core.storage.mooncake_tier import MooncakeTier  # imports mooncake: if asked for

        mc = cfg.mooncake
        assert mc is not None  # RemoteConfig fills it in for a mooncake:// url
        host, port = parse_mooncake_url(cfg.url)
        return disk, MooncakeTier(
            f"{host}:{port}", mc.metadata_server or f"http://{host}:8080/metadata",
            memory=(pool.address, pool.nbytes), local_hostname=mc.local_hostname,
            protocol=mc.protocol, device_name=mc.device_name, segment_bytes=mc.segment_bytes,
            replicas=mc.replicas, prefer_local=mc.prefer_local, queue_size=cfg.queue_size,
            timeout_ms=cfg.timeout_ms, key_prefix=cfg.key_prefix,
            retry_interval_s=cfg.retry_interval_s, events=events)
    from lmcache_core.storage.remote import RedisTier  # imports redis: only when asked for

    return disk, RedisTier(cfg.url, cfg.queue_size, cfg.timeout_ms, cfg.key_prefix, cfg.ttl_s,
                           cfg.cluster, cfg.retry_interval_s, events=events)
