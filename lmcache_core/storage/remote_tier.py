"""``RemoteTier``: what the engine sees of the L3 tier shared by every server, whatever holds it
(Redis/Valkey: ``remote.RedisTier``; Mooncake Store: ``mooncake_tier.MooncakeTier``).

Both hold one ``record`` per chunk piece (header with the key, size and xxh3 checksums, then the
bytes) under the same name (``remote_keys``: ``<prefix>:v2:<model>:<layout>:<lo>-<hi>:<hash hex>``),
and both behave alike for the engine; this class is that behaviour, a subclass only how its store
is asked (``_ping``, ``_lengths``, ``_fetch``, ``_put``, ``_delete``, ``count_keys``, ``_close``):

* **Writes** go behind, never on a store's path: ``submit`` puts keys on a bounded queue (a full
  queue drops the write and counts it, ``remote_write_dropped``); a writer thread (a
  ``BackgroundWriter``) holds up to ``MAX_BATCH_BYTES`` of resident pieces (verified against their
  checksums, so not evictable) while the subclass writes them, then lets them go.
* **Lookups** run on this tier's own two threads so the caller can wait at most its budget
  (``Future.result(timeout)``): ``lengths`` asks for every wanted key at once (record length:
  presence and size), ``fetch_checked_into`` reads the prefix's records in batches into the
  caller's slots, verified; a bad value (or one whose header names another key) is counted,
  logged, deleted and never served.
* **Faults:** the first failed call marks the tier down and logs one warning; while down, lookups
  skip it at once and the writer only probes (``_ping``) every ``retry_interval_s``; the first
  success logs one line and resumes. Failures are counted (``remote_errors``), outages too
  (``remote_outages``); writes a fault interrupted are queued again for when it is back.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar, NamedTuple, TypeVar

from lmcache_core.events import REMOTE, KVEventSink
from lmcache_core.keys import ChunkKey
from lmcache_core.log_budget import LogBudget
from lmcache_core.stats import RemoteStats
from lmcache_core.storage import record
from lmcache_core.storage.disk import Source
from lmcache_core.storage.remote_keys import redis_key
from lmcache_core.storage.writer import BackgroundWriter
from lmcache_core.supervision import Supervisor

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BATCH_BYTES = 8 * 2**20  # per batch of reads or writes: big pipelines of big values are slower
MAX_BATCH_KEYS = 64
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")

#: A resident piece the writer holds: ``(key, its bytes, their verified checksum)`` (0: take it).
Held = tuple[ChunkKey, memoryview, int]
#: One key's read: ``(bytes loaded, the piece's checksum)``, a ``RecordError`` (a bad value, to be
#: dropped) or None (absent, or not readable now).
Fetched = tuple[int, int] | record.RecordError | None


class KeyCount(NamedTuple):
    """``RemoteTier.count_keys``: the pattern counted, the keys found, whether the count ran to
    its end, and why it stopped early if it failed ("" otherwise)."""

    pattern: str
    keys: int
    complete: bool
    error: str = ""


def glob_escape(text: str) -> str:
    """``text`` as a glob matching only itself (``*``, ``?``, ``[``, ``]``, ``\\`` escaped)."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


class RemoteTier:
    """A shared store of chunk records with a write-behind queue and an outage breaker."""

    name = "remote"
    #: The store, as log lines and errors name it ("Redis", "Mooncake Store").
    label: ClassVar[str] = "remote store"
    #: The exceptions a subclass's calls raise when the store fails (a fault: the tier goes down).
    faults: ClassVar[tuple[type[BaseException], ...]] = ()

    def __init__(self, display_url: str, queue_size: int, timeout_ms: int, key_prefix: str,
                 retry_interval_s: float, events: KVEventSink | None) -> None:
        """``timeout_ms``: how long one call to the store may take (a wait for an answer allows
        for it); ``events``: told of chunks written and deleted (KV events): the store's own
        expiry and eviction, and other servers' writes, are not seen."""
        self.display_url = display_url
        self.timeout_s = timeout_ms / 1000
        self.key_prefix = f"{key_prefix}:v{record.FORMAT_VERSION}:"
        self.retry_interval_s = retry_interval_s
        self.n = RemoteStats()  # its section of SERVER_INFO
        self.events = events
        self._closed = False
        self._state_lock = threading.Lock()
        self._down = False
        self._down_since = 0.0
        self._failures_in_outage = 0
        self._source: Source | None = None  # the writer's, from ``start``
        # While the store is down the writer takes nothing and probes every retry_interval_s.
        self._writer: BackgroundWriter[ChunkKey] = BackgroundWriter(
            "remote tier", "lmcache-remote-writer", queue_size, self._write_batch,
            batch=MAX_BATCH_KEYS, down=lambda: self.down, probe=self.probe,
            probe_interval_s=retry_interval_s, on_start=self._writer_started)
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmcache-remote")
        self._corrupt = LogBudget(logger=logger)  # anyone with access to the store can write bad values
        self._refused = LogBudget(logger=logger)  # failed writes come in runs

    # ------------------------------------------------------------------ the store (subclasses)

    def _ping(self) -> None:
        """Raise one of ``faults`` unless the store answers."""
        raise NotImplementedError

    def _lengths(self, keys: Sequence[ChunkKey]) -> list[int]:
        """The record length of each key in the store (0: absent)."""
        raise NotImplementedError

    def _fetch(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[Fetched]:
        """Read each key's record, its payload into its ``outs`` slot (exactly its size),
        verified (``record``): per key as ``Fetched``."""
        raise NotImplementedError

    def _put(self, items: Sequence[Held]) -> list[BaseException | None]:
        """Write each piece's record: per item None (written) or why the store refused it."""
        raise NotImplementedError

    def _delete(self, key: ChunkKey) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        """Let go of the store's connection (``stop``, once the writer ended)."""
        raise NotImplementedError

    def count_keys(self, match: str, deadline: float,
                   clock: Callable[[], float] = time.monotonic) -> KeyCount:
        """How many keys match ``<prefix>:v2:`` + ``match`` (a glob), stopping once ``clock()``
        passes ``deadline`` (``complete`` False then: a lower bound)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ health

    def remote_key(self, key: ChunkKey) -> bytes:
        """``<prefix>:v2:<model>:<layout>:<head_lo>-<head_hi>:<hash hex>`` (UTF-8)."""
        return redis_key(self.key_prefix, key)

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
                       "retrying every %.1fs", self.display_url, what, reason(exc),
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
        """Ask the store if it answers; marks the tier up or down. True if it did."""
        try:
            self._ping()
        except self.faults as exc:
            self._fault("ping", exc)
            return False
        self._ok()
        return True

    # ------------------------------------------------------------------ lookup side

    def run(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn(*args)`` on this tier's lookup threads (so a caller can bound its wait)."""
        return self._lookups.submit(fn, *args)

    def lengths(self, keys: Sequence[ChunkKey], deadline: float) -> list[int] | None:
        """Record length of each key in the store (0: absent), asked at once.

        None when the tier is down, the deadline passed before it started, or the call failed.
        """
        if self.down or time.monotonic() >= deadline or not keys:
            return None
        try:
            found = self._lengths(keys)
        except self.faults as exc:
            self._fault("lookup", exc)
            return None
        self._ok()
        return found

    def fetch_checked_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview],
                           deadline: float) -> list[tuple[int, int]]:
        """Read each key's record into its ``outs`` slot, verified: per key ``(bytes loaded, the
        piece's checksum)`` (``(0, 0)``: none).

        In batches of at most ``MAX_BATCH_BYTES`` and ``MAX_BATCH_KEYS``; stops early (zeros for
        the rest) once the deadline has passed or the tier went down.
        """
        loaded = [(0, 0)] * len(keys)
        start = 0
        while start < len(keys):
            if self.down or time.monotonic() >= deadline:
                break
            end = batch_end([out.nbytes for out in outs], start)
            try:
                got = self._fetch(keys[start:end], outs[start:end])
            except self.faults as exc:
                self._fault("fetch", exc)
                break
            self._ok()
            for i, result in enumerate(got, start):
                if isinstance(result, record.RecordError):
                    self._drop(keys[i], result)
                elif result is not None:
                    loaded[i] = result
            start = end
        self.n.add(loaded_chunks=sum(1 for n, _ in loaded if n))
        return loaded

    def _drop(self, key: ChunkKey, exc: record.RecordError) -> None:
        """A bad value: counted, logged, deleted from the store, never served."""
        self.n.add(corrupt=1)
        self._corrupt.log(logging.WARNING, "remote tier: dropped bad value %s: %s",
                          self.remote_key(key).decode(errors="replace"), exc)
        try:
            self._delete(key)
        except self.faults as exc:  # it stays in the store: the next reader drops it again
            self._fault("delete", exc)
        if self.events is not None:
            self.events.removed((key,), REMOTE)

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
        """Write one chunk now (tools and tests); True if the store took it."""
        try:
            results = self._put([(key, payload, 0)])
        except self.faults as exc:
            self._fault("store", exc)
            return False
        return results[0] is None

    def start(self, source: Source, supervisor: Supervisor | None = None) -> None:
        """Start the writer thread (watched by ``supervisor``: a writer that dies fails the
        server), writing what is queued from ``source`` (the engine's pieces, verified)."""
        self._source = source
        self._writer.start(supervisor)

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Write what is queued (for at most ``drain_timeout_s`` while the store is up), then end."""
        self._writer.stop(drain_timeout_s, grace_s=2 * self.timeout_s + 1.0)
        self._lookups.shutdown(wait=False)
        self._closed = True
        self._close()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is done (tests); True if the queue emptied in time."""
        return self._writer.flush(timeout_s)

    def _writer_started(self) -> None:
        if self.probe():  # an unreachable store is reported at start, not at the first request
            logger.info("remote tier: %s, keys %s...", self.display_url, self.key_prefix)

    def _write_batch(self, batch: list[ChunkKey]) -> None:
        """Write the batch's chunks still in memory, ``MAX_BATCH_BYTES`` of them at a time, each
        held (not evictable, checked against its checksum) only while its part is written."""
        source = self._source
        if source is None:
            return
        at = 0
        while at < len(batch):
            with contextlib.ExitStack() as held:
                items, at = self._hold(held, source, batch, at)
                if items and not self._written(items, batch[at:]):
                    return

    def _hold(self, held: contextlib.ExitStack, source: Source, batch: list[ChunkKey],
              at: int) -> tuple[list[Held], int]:
        """From ``batch[at:]``, the resident pieces (in ``held``) up to ``MAX_BATCH_BYTES`` (one at
        least), and where the rest starts. A piece evicted before its turn is skipped; one that
        cannot be read is counted in ``remote_write_failed`` and logged, and the batch goes on."""
        items: list[Held] = []
        size = 0
        while at < len(batch) and size < MAX_BATCH_BYTES:
            key = batch[at]
            at += 1
            try:
                found = held.enter_context(source(key))
            except Exception as exc:  # one bad chunk must not lose the rest of the batch
                self.n.add(write_failed=1)
                self._refused.log(logging.WARNING, "remote tier: could not read %s: %r",
                                  key.short(), exc)
                continue
            if found is not None:
                items.append((key, *found))
                size += found[0].nbytes
        return items, at

    def _written(self, items: list[Held], rest: list[ChunkKey]) -> bool:
        """Write ``items``, counting what the store took and refused; False (``items`` and
        ``rest`` queued again) when it failed as a whole: the tier is down."""
        try:
            results = self._put(items)
        except self.faults as exc:
            self._fault("store", exc)
            # The store is away: retry these (by key) once it is back, as far as the queue has room.
            self.submit([key for key, _, _ in items] + rest)
            return False
        self._ok()
        refused = [r for r in results if r is not None]
        if refused:  # e.g. the store is full
            self.n.add(write_failed=len(refused))
            self._refused.log(logging.WARNING, "remote tier: %s refused %d write(s): %s",
                              self.label, len(refused), refused[0])
        written = [key for (key, _, _), r in zip(items, results, strict=True) if r is None]
        self.n.add(written_chunks=len(written))
        if self.events is not None and written:
            self.events.stored(written, REMOTE)
        return True

    def stats(self) -> RemoteStats:
        """Its section of SERVER_INFO, read now."""
        return self.n.copy(queued=self._writer.queued, up=int(not self.down))


def batch_end(sizes: Sequence[int], start: int) -> int:
    """Where the batch from ``start`` ends: at most ``MAX_BATCH_KEYS`` items and
    ``MAX_BATCH_BYTES`` bytes of ``sizes``, one item at least."""
    end, size = start, 0
    while end < len(sizes) and end - start < MAX_BATCH_KEYS and (
            end == start or size + sizes[end] <= MAX_BATCH_BYTES):
        size += sizes[end]
        end += 1
    return end


def reason(exc: BaseException) -> str:
    """``ErrorType: first line of its message`` (or just the type), for a log line."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
