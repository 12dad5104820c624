"""The L3 remote tier: chunks in Redis or Valkey (one node or a cluster), shared by every server.

Each value is one chunk piece (``ChunkKey``: KV heads ``[head_lo, head_hi)`` of one chunk). Keys
carry the record format version, the model, the layout fingerprint, the head range and the chunk
hash in hex (``redis_key``; ``remote_keys`` names and parses them)::

    <prefix>:v2:<model>:<layout>:<head_lo>-<head_hi>:<hash hex>

so servers on different machines (and at different tensor-parallel sizes) that use the same Redis
find each other's chunks; keys of format v1 are never read. Values are ``record``s (header with
the key, size and xxh3 checksums, then the bytes): a bad value, or one whose header names
another key (another head range, say), is counted, logged, deleted and never served.

* **Writes** go behind, never on a store's path: ``submit`` puts keys on a bounded queue (a full
  queue drops the write and counts it, ``remote_write_dropped``); a writer thread (a
  ``BackgroundWriter``) pins each chunk in memory only while it builds the value, then pipelines
  SETs.
* **Lookups** run on this tier's own two threads so the caller can wait at most its budget
  (``Future.result(timeout)``): ``lengths`` asks for every wanted key in one pipelined round trip
  (STRLEN: presence and size at once), ``fetch_checked_into`` GETs the values of the prefix in pipelined
  batches, verifies them and copies them into the caller's slots.
* **Faults:** every client call has socket timeouts (``timeout_ms``) and one immediate retry on a
  connection error (a connection that a Redis restart left dead is replaced transparently). The
  first failure marks the tier down and logs one warning; while down, lookups skip it at once and
  the writer only probes (PING) every ``retry_interval_s``; the first success logs one line and
  resumes. Failures are counted (``remote_errors``), outages too (``remote_outages``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import redis

from lmcache_core.config_parse import parse_remote_url
from lmcache_core.events import REMOTE, KVEventSink
from lmcache_core.keys import ChunkKey
from lmcache_core.log_budget import LogBudget
from lmcache_core.stats import RemoteStats
from lmcache_core.storage import record
from lmcache_core.storage.disk import Source
from lmcache_core.storage.record import Buffer
from lmcache_core.storage.remote_client import FAULTS as _FAULTS
from lmcache_core.storage.remote_client import make_client
from lmcache_core.storage.remote_client import reason as _reason
from lmcache_core.storage.remote_client import without_password as _without_password
from lmcache_core.storage.remote_keys import key_of, redis_key
from lmcache_core.storage.writer import BackgroundWriter
from lmcache_core.supervision import Supervisor

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BATCH_BYTES = 8 * 2**20  # per pipelined GET/SET batch: big pipelines of big values are slower
MAX_BATCH_KEYS = 64
#: Keys one SCAN step looks at (``count_keys``): a step costs Redis well under a millisecond, so
#: it never holds other clients up, and the deadline is checked that often.
SCAN_STEP = 1000
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


class KeyCount(NamedTuple):
    """``RemoteTier.count_keys``: the pattern counted, the keys found, whether the count ran to
    its end, and why it stopped early if it failed ("" otherwise)."""

    pattern: str
    keys: int
    complete: bool
    error: str = ""


def glob_escape(text: str) -> str:
    """``text`` as a Redis glob matching only itself (``*``, ``?``, ``[``, ``]``, ``\\`` escaped)."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


class RemoteTier:
    """A Redis/Valkey client with a write-behind queue and an outage breaker."""

    name = "remote"

    def __init__(self, url: str, queue_size: int = 256, timeout_ms: int = 500,
                 key_prefix: str = "lmcache", ttl_s: int | None = None, cluster: bool = False,
                 retry_interval_s: float = 1.0, client_options: dict[str, Any] | None = None, *,
                 events: KVEventSink | None = None) -> None:
        """``events``: told of chunks written and deleted (KV events). Redis's own expiry and
        eviction, and other servers' writes, are not seen."""
        self.url, url_cluster = parse_remote_url(url)
        self.display_url = _without_password(url)
        self.cluster = cluster or url_cluster
        self.timeout_s = timeout_ms / 1000
        self.key_prefix = f"{key_prefix}:v{record.FORMAT_VERSION}:"
        self.ttl_s = ttl_s
        self.retry_interval_s = retry_interval_s
        self._client_options = dict(client_options or {})
        self.n = RemoteStats()  # its section of SERVER_INFO
        self._client: Any = None
        self._closed = False
        self._client_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._down = False
        self._down_since = 0.0
        self._failures_in_outage = 0
        self._source: Source | None = None  # the writer's, from ``start``
        self.events = events
        # While Redis is down the writer takes nothing and PINGs every retry_interval_s.
        self._writer: BackgroundWriter[ChunkKey] = BackgroundWriter(
            "remote tier", "lmcache-remote-writer", queue_size, self._write_batch,
            batch=MAX_BATCH_KEYS, down=lambda: self._down, probe=self.probe,
            probe_interval_s=retry_interval_s, on_start=self._writer_started)
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmcache-remote")
        self._corrupt = LogBudget(logger=logger)  # anyone with Redis access can write bad values
        self._refused = LogBudget(logger=logger)  # failed writes come in runs
        self._buffers: list[bytearray] = []  # the writer's reused value buffers (one per batch slot)

    # ------------------------------------------------------------------ client and health

    def redis_key(self, key: ChunkKey) -> bytes:
        """``<prefix>:v2:<model>:<layout>:<head_lo>-<head_hi>:<hash hex>`` (UTF-8)."""
        return redis_key(self.key_prefix, key)

    def client(self) -> Any:
        """The redis-py client, made on first use (a cluster client connects when made)."""
        client = self._client
        if client is not None:
            return client
        with self._client_lock:
            if self._closed:
                raise redis.exceptions.ConnectionError("the remote tier is stopped")
            if self._client is None:
                self._client = make_client(self.url, self.cluster, self.timeout_s, self._client_options)
            return self._client

    @property
    def down(self) -> bool:
        return self._down

    def _fault(self, what: str, exc: BaseException) -> None:
        if self._closed:
            return
        with self._state_lock:
            self.n.add(errors=1)
            if self._down:
                self._failures_in_outage += 1
                return
            self._down = True
            self._down_since = time.monotonic()
            self._failures_in_outage = 1
            self.n.add(outages=1)
        logger.warning("remote tier %s unavailable (%s: %s); serving from memory and disk, "
                       "retrying every %.1fs", self.display_url, what, _reason(exc),
                       self.retry_interval_s)

    def _ok(self) -> None:
        if not self._down:
            return
        with self._state_lock:
            if not self._down:
                return
            self._down = False
            outage = time.monotonic() - self._down_since
            failures = self._failures_in_outage
        logger.info("remote tier %s reachable again after %.1fs (%d failed call(s) meanwhile)",
                    self.display_url, outage, failures)

    def probe(self) -> bool:
        """PING; marks the tier up or down. True if Redis answered."""
        try:
            self.client().ping()
        except _FAULTS as exc:
            self._fault("ping", exc)
            return False
        self._ok()
        return True

    # ------------------------------------------------------------------ lookup side

    def run(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on this tier's lookup threads (so a caller can bound its wait)."""
        return self._lookups.submit(fn, *args)

    def lengths(self, keys: Sequence[ChunkKey], deadline: float) -> list[int] | None:
        """Record length of each key in Redis (0: absent), in one pipelined round trip.

        None when the tier is down, the deadline passed before it started, or the call failed.
        """
        if self._down or time.monotonic() >= deadline or not keys:
            return None
        try:
            pipe = self.client().pipeline(transaction=False)
            for key in keys:
                pipe.strlen(self.redis_key(key))
            found = pipe.execute()
        except _FAULTS as exc:
            self._fault("lookup", exc)
            return None
        self._ok()
        return [int(n) for n in found]

    def fetch_checked_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview],
                           deadline: float) -> list[tuple[int, int]]:
        """GET each key's record into its ``outs`` slot, verified: per key ``(bytes loaded, the
        piece's checksum)`` (``(0, 0)``: none).

        Pipelined in batches of at most ``MAX_BATCH_BYTES``; stops early (zeros for the rest) once
        the deadline has passed or the tier went down.
        """
        loaded = [(0, 0)] * len(keys)
        start = 0
        while start < len(keys):
            if self._down or time.monotonic() >= deadline:
                break
            end, size = start, 0
            while end < len(keys) and (end == start or size + outs[end].nbytes <= MAX_BATCH_BYTES):
                size += outs[end].nbytes
                end += 1
            rkeys = [self.redis_key(k) for k in keys[start:end]]
            try:
                pipe = self.client().pipeline(transaction=False)
                for rkey in rkeys:
                    pipe.get(rkey)
                values = pipe.execute(raise_on_error=False)
            except _FAULTS as exc:
                self._fault("fetch", exc)
                break
            self._ok()
            for i, value in enumerate(values, start):
                if isinstance(value, bytes | bytearray):
                    loaded[i] = self._decode(keys[i], rkeys[i - start], value, outs[i])
            start = end
        self.n.add(loaded_chunks=sum(1 for n, _ in loaded if n))
        return loaded

    def _decode(self, key: ChunkKey, rkey: bytes, value: bytes | bytearray,
                out: memoryview) -> tuple[int, int]:
        try:
            return record.decode_checked_into(value, key, out)
        except record.RecordError as exc:
            self.n.add(corrupt=1)
            self._corrupt.log(logging.WARNING, "remote tier: dropped bad value %s: %s",
                              rkey.decode(errors="replace"), exc)
            with contextlib.suppress(*_FAULTS):
                self.client().delete(rkey)
            if self.events is not None:
                self.events.removed((key,), REMOTE)
            return 0, 0

    def count_keys(self, match: str, deadline: float,
                   clock: Callable[[], float] = time.monotonic) -> KeyCount:
        """How many keys match ``<prefix>:v2:`` + ``match`` (a Redis glob), by SCAN in steps of
        ``SCAN_STEP`` keys (on a cluster, on every primary in turn), never a blocking KEYS:
        between steps the count stops once ``clock()`` passes ``deadline`` (then ``complete`` is
        False: a lower bound). SCAN may return a key twice while Redis rehashes: about, not exact."""
        pattern = glob_escape(self.key_prefix) + match
        if self._down:
            return KeyCount(pattern, 0, False, "the remote tier is down")
        count = 0
        try:
            for node in self._scan_nodes():
                cursor = 0
                while True:
                    if clock() >= deadline:
                        return KeyCount(pattern, count, False)
                    cursor, keys = node.scan(cursor=cursor, match=pattern, count=SCAN_STEP)
                    count += len(keys)
                    if not int(cursor):
                        break
        except _FAULTS as exc:
            self._fault("count", exc)
            return KeyCount(pattern, count, False, _reason(exc))
        self._ok()
        return KeyCount(pattern, count, True)

    def _scan_nodes(self) -> list[Any]:
        """Clients to SCAN: the one client, or one per primary of a cluster (a cluster's SCAN
        walks one node's keys)."""
        client = self.client()
        if not self.cluster:
            return [client]
        return [client.get_redis_connection(node) for node in client.get_primaries()]

    def count_lookup_timeout(self) -> None:
        self.n.add(lookup_timeouts=1)

    # ------------------------------------------------------------------ write side

    def submit(self, keys: Iterable[ChunkKey]) -> int:
        """Queue keys to be written behind; a full queue drops (and counts) the rest. Never blocks."""
        dropped = self._writer.submit(keys)
        if dropped:
            self.n.add(write_dropped=dropped)
        return dropped

    def put(self, key: ChunkKey, payload: memoryview) -> bool:
        """Write one chunk now (tools and tests); True if Redis took it."""
        try:
            self._set_many([(self.redis_key(key), record.encode(key, payload))])
        except _FAULTS as exc:
            self._fault("store", exc)
            return False
        return True

    def start(self, source: Source, supervisor: Supervisor | None = None) -> None:
        """Start the writer thread (watched by ``supervisor``: a writer that dies fails the
        server), writing what is queued from ``source`` (the engine's pieces, verified)."""
        self._source = source
        self._writer.start(supervisor)

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Write what is queued (for at most ``drain_timeout_s`` while Redis is up), then end."""
        self._writer.stop(drain_timeout_s, grace_s=2 * self.timeout_s + 1.0)
        self._lookups.shutdown(wait=False)
        with self._client_lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*_FAULTS):
                client.close()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is done (tests); True if the queue emptied in time."""
        return self._writer.flush(timeout_s)

    def _writer_started(self) -> None:
        if self.probe():  # an unreachable Redis is reported at start, not at the first request
            logger.info("remote tier: %s, keys %s...", self.display_url, self.key_prefix)

    def _write_batch(self, batch: list[ChunkKey]) -> None:
        """SET the batch's chunks still in memory, ``MAX_BATCH_BYTES`` of values at a time."""
        source = self._source
        if source is None:
            return
        values: list[tuple[bytes, Buffer]] = []
        size = 0
        for i, key in enumerate(batch):
            value = self._value_of(source, key, len(values))
            if value is not None:
                values.append((self.redis_key(key), value))
                size += len(value)
            if values and (size >= MAX_BATCH_BYTES or i == len(batch) - 1):
                try:
                    if not self._flush_values(values, batch[i + 1:]):
                        return
                finally:
                    _release(values)  # views of the reused buffers: the next key may grow them
                values, size = [], 0

    def _value_of(self, source: Source, key: ChunkKey, index: int) -> Buffer | None:
        """``key``'s record (in buffer ``index``), or None: evicted before its turn, or it could
        not be encoded (counted in ``remote_write_failed`` and logged; the batch goes on)."""
        try:
            with source(key) as found:
                if found is None:  # evicted before its turn: nothing to write
                    return None
                return self._encode(key, *found, index)
        except Exception as exc:  # one bad chunk must not lose the rest of the batch
            self.n.add(write_failed=1)
            self._refused.log(logging.WARNING, "remote tier: could not encode %s: %r", key.short(), exc)
            return None

    def _encode(self, key: ChunkKey, payload: memoryview, payload_xxh3: int,
                index: int) -> Buffer:
        """The record (with the payload's verified checksum), in the writer's reused buffer
        ``index`` when the packer sends buffers as they are (no fresh pages per chunk, no second
        copy); a bytes object otherwise."""
        if self.cluster:
            return record.encode(key, payload, payload_xxh3)
        while len(self._buffers) <= index:
            self._buffers.append(bytearray())
        size = record.encode_into(key, payload, self._buffers[index], payload_xxh3)
        return memoryview(self._buffers[index])[:size]

    def _flush_values(self, values: list[tuple[bytes, Buffer]], rest: list[ChunkKey]) -> bool:
        try:
            results = self._set_many(values)
        except _FAULTS as exc:
            self._fault("store", exc)
            # Redis is away: retry these (by key) once it is back, as far as the queue has room.
            redo = [self._key_of(rkey) for rkey, _ in values] + rest
            self.submit(k for k in redo if k is not None)
            return False
        self._ok()
        failed = sum(1 for r in results if isinstance(r, Exception))
        if failed:  # e.g. Redis is full (maxmemory, noeviction)
            self.n.add(write_failed=failed)
            self._refused.log(logging.WARNING, "remote tier: Redis refused %d write(s): %s", failed,
                              next(r for r in results if isinstance(r, Exception)))
        self.n.add(written_chunks=len(results) - failed)
        if self.events is not None:
            self.events.stored(self._written_keys(values, results), REMOTE)
        return True

    def _written_keys(self, values: list[tuple[bytes, Buffer]], results: list[Any]) -> list[ChunkKey]:
        """The chunks of a pipelined SET that Redis took (for KV events)."""
        written = [self._key_of(rkey) for (rkey, _), result in zip(values, results, strict=True)
                   if not isinstance(result, Exception)]
        return [key for key in written if key is not None]

    def _set_many(self, values: list[tuple[bytes, Buffer]]) -> list[Any]:
        pipe = self.client().pipeline(transaction=False)
        for rkey, value in values:
            pipe.set(rkey, value, ex=self.ttl_s)
        results: list[Any] = pipe.execute(raise_on_error=False)
        for r in results:  # a connection fault inside the pipeline: raise it as one
            if isinstance(r, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
                raise r
        return results

    def _key_of(self, rkey: bytes) -> ChunkKey | None:
        """The key ``redis_key`` made ``rkey`` of; None for anything else (``remote_keys.key_of``)."""
        return key_of(self.key_prefix, rkey)

    def stats(self) -> RemoteStats:
        """Its section of SERVER_INFO, read now."""
        return self.n.copy(queued=self._writer.queued, up=int(not self._down))


def _release(values: list[tuple[bytes, Buffer]]) -> None:
    """Release the memoryviews among ``values`` (a bytearray cannot grow while one is exported)."""
    for view in (value for _, value in values if isinstance(value, memoryview)):
        view.release()
