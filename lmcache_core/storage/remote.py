"""The L3 remote tier in Redis or Valkey (one node or a cluster): ``RedisTier``, a ``RemoteTier``
(``remote_tier``: the write-behind queue, the lookup threads, the outage breaker and the record
checks it shares with Mooncake Store's tier).

Each value is one chunk piece's ``record`` under its ``remote_keys`` name::

    <prefix>:v2:<model>:<layout>:<head_lo>-<head_hi>:<hash hex>

so servers on different machines (and at different tensor-parallel sizes) that use the same Redis
find each other's chunks; keys of format v1 are never read.

* **Writes:** a batch's records are encoded into the writer's reused buffers and SET in one
  pipeline (with ``ttl_s``, if set).
* **Lookups:** ``_lengths`` is one pipelined STRLEN (presence and size at once), ``_fetch`` a
  pipelined GET whose values are verified before their payload is copied into the slots.
* **Faults:** every client call has socket timeouts (``timeout_ms``) and one immediate retry on a
  connection error (a connection that a Redis restart left dead is replaced transparently); a
  down Redis is probed with PING.
* **Counting** (``count_keys``, ``lmcache inspect-chunks``): SCAN in steps, never a blocking KEYS.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import redis

from lmcache_core.config_parse import parse_remote_url
from lmcache_core.events import KVEventSink
from lmcache_core.keys import ChunkKey
from lmcache_core.storage import record
from lmcache_core.storage.record import Buffer
from lmcache_core.storage.remote_client import FAULTS, make_client
from lmcache_core.storage.remote_client import without_password as _without_password
from lmcache_core.storage.remote_tier import (
    Fetched,
    Held,
    KeyCount,
    RemoteTier,
    glob_escape,
    reason,
)

#: Keys one SCAN step looks at (``count_keys``): a step costs Redis well under a millisecond, so
#: it never holds other clients up, and the deadline is checked that often.
SCAN_STEP = 1000


class RedisTier(RemoteTier):
    """The remote tier in Redis/Valkey, through one redis-py client."""

    label: ClassVar[str] = "Redis"
    faults: ClassVar[tuple[type[BaseException], ...]] = FAULTS

    def __init__(self, url: str, queue_size: int = 256, timeout_ms: int = 500,
                 key_prefix: str = "lmcache", ttl_s: int | None = None, cluster: bool = False,
                 retry_interval_s: float = 1.0, client_options: dict[str, Any] | None = None, *,
                 events: KVEventSink | None = None) -> None:
        super().__init__(_without_password(url), queue_size, timeout_ms, key_prefix,
                         retry_interval_s, events)
        self.url, url_cluster = parse_remote_url(url)
        self.cluster = cluster or url_cluster
        self.ttl_s = ttl_s
        self._client_options = dict(client_options or {})
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._buffers: list[bytearray] = []  # the writer's reused value buffers (one per batch slot)

    def redis_key(self, key: ChunkKey) -> bytes:
        """``<prefix>:v2:<model>:<layout>:<head_lo>-<head_hi>:<hash hex>`` (UTF-8)."""
        return self.remote_key(key)

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

    def _ping(self) -> None:
        self.client().ping()

    def _lengths(self, keys: Sequence[ChunkKey]) -> list[int]:
        """One pipelined STRLEN: presence and size at once."""
        pipe = self.client().pipeline(transaction=False)
        for key in keys:
            pipe.strlen(self.redis_key(key))
        return [int(n) for n in pipe.execute()]

    def _fetch(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[Fetched]:
        """One pipelined GET; each value verified before its payload is copied into its slot."""
        pipe = self.client().pipeline(transaction=False)
        for key in keys:
            pipe.get(self.redis_key(key))
        values = pipe.execute(raise_on_error=False)
        got: list[Fetched] = []
        for key, value, out in zip(keys, values, outs, strict=True):
            if not isinstance(value, bytes | bytearray):
                got.append(None)
                continue
            try:
                got.append(record.decode_checked_into(value, key, out))
            except record.RecordError as exc:
                got.append(exc)
        return got

    def _delete(self, key: ChunkKey) -> None:
        self.client().delete(self.redis_key(key))

    def count_keys(self, match: str, deadline: float,
                   clock: Callable[[], float] = time.monotonic) -> KeyCount:
        """How many keys match ``<prefix>:v2:`` + ``match`` (a Redis glob), by SCAN in steps of
        ``SCAN_STEP`` keys (on a cluster, on every primary in turn), never a blocking KEYS:
        between steps the count stops once ``clock()`` passes ``deadline`` (then ``complete`` is
        False: a lower bound). SCAN may return a key twice while Redis rehashes: about, not exact."""
        pattern = glob_escape(self.key_prefix) + match
        if self.down:
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
        except FAULTS as exc:
            self._fault("count", exc)
            return KeyCount(pattern, count, False, reason(exc))
        self._ok()
        return KeyCount(pattern, count, True)

    def _scan_nodes(self) -> list[Any]:
        """Clients to SCAN: the one client, or one per primary of a cluster (a cluster's SCAN
        walks one node's keys)."""
        client = self.client()
        if not self.cluster:
            return [client]
        return [client.get_redis_connection(node) for node in client.get_primaries()]

    def _close(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*FAULTS):
                client.close()

    # ------------------------------------------------------------------ write side

    def _put(self, items: Sequence[Held]) -> list[BaseException | None]:
        """The records SET in one pipeline (a record that cannot be encoded is refused alone)."""
        results: list[BaseException | None] = [None] * len(items)
        values: list[tuple[int, bytes, Buffer]] = []
        try:
            for i, (key, payload, payload_xxh3) in enumerate(items):
                try:
                    values.append((i, self.redis_key(key),
                                   self._encode(key, payload, payload_xxh3, len(values))))
                except ValueError as exc:  # a key no record can hold
                    results[i] = exc
            replies = self._set_many([(rkey, value) for _, rkey, value in values]) if values else []
        finally:
            _release([value for _, _, value in values])  # views of the reused buffers
        for (i, _, _), reply in zip(values, replies, strict=True):
            if isinstance(reply, Exception):  # e.g. Redis is full (maxmemory, noeviction)
                results[i] = reply
        return results

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

    def _set_many(self, values: list[tuple[bytes, Buffer]]) -> list[Any]:
        pipe = self.client().pipeline(transaction=False)
        for rkey, value in values:
            pipe.set(rkey, value, ex=self.ttl_s)
        results: list[Any] = pipe.execute(raise_on_error=False)
        for r in results:  # a connection fault inside the pipeline: raise it as one
            if isinstance(r, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
                raise r
        return results


def _release(values: list[Buffer]) -> None:
    """Release the memoryviews among ``values`` (a bytearray cannot grow while one is exported)."""
    for view in (value for value in values if isinstance(value, memoryview)):
        view.release()
