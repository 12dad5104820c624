"""The L3 remote tier in a Mooncake Store pool: ``MooncakeTier``, a ``RemoteTier`` (``remote_tier``:
the write-behind queue, the lookup threads, the outage breaker and the record checks it shares with
Redis's tier).

Mooncake Store pools the nodes' own memory behind a master: every ``lmcache serve`` that uses it
mounts ``segment_size`` bytes of its host's RAM as its *global segment*, the master places each
object's replicas in the nodes' segments, and the bytes move with Mooncake's transfer engine (TCP
here, RDMA on clusters) between a node's registered memory and another's segment. So this tier
registers the server's whole memory pool with the transfer engine (``register_buffer``) and moves a
chunk's bytes straight between its pool slot and the pool, never through Python bytes:

* **write** (the writer thread, pieces held): ``batch_put_from_multi_buffers``, one object per
  piece made of two registered buffers: its record header (written into a small registered arena)
  and its payload, in place in the memory pool; ``replicas`` copies on distinct nodes, the first
  in this node's own segment while it has room (``prefer_local``: a local copy, no network).
* **read** (a lookup's load): ``batch_get_into_multi_buffers`` into the header arena and the
  reserved pool slot; then the header and the payload checksum are verified in place. The slot is
  only made visible by the engine's commit when the check passed: a bad value's bytes land in a
  slot that is freed, never served (and the value is removed from the pool).
* **lookup** (sizes): ``batch_is_exist``, then ``batch_get_replica_desc`` of those present (one
  round trip each; asking the descriptors of absent keys logs an error in the client per key).

Objects have the same names and record format as in Redis (``remote_keys``, ``record``). The pool
cannot list keys, so ``count_keys`` (``lmcache inspect-chunks``) says so; ``lmcache lookup`` asks
for exact keys and sees it.

Faults: a master that is down makes each client call wait about 4 s before it fails (its RPC
retries), so every call first asks the client's own view of the master (``health_check``, no round
trip: its heartbeat thread keeps it) and fails at once while that is bad; the writer probes the
master every ``retry_interval_s`` with a real round trip (``health_check`` alone says 0 at times
while its client reconnects to a master that is away). The client is set up on the writer thread
(``setup`` waits for a master that is away), so a server starts at once and counts the tier down
until it joined. When the master comes back (restarted: its index is empty) the client mounts its
segment again by itself.

Imports ``mooncake.store`` (the optional extra ``pip install lmcache-toolkit[mooncake]``) when
made: a missing one is a ``ConfigError`` naming what to install.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from lmcache_core.errors import ConfigError, RemoteTierError
from lmcache_core.events import KVEventSink
from lmcache_core.keys import ChunkKey
from lmcache_core.storage import record
from lmcache_core.storage.remote_tier import MAX_BATCH_KEYS, Fetched, Held, KeyCount, RemoteTier

logger = logging.getLogger(__name__)

#: The client's own staging buffer (``local_buffer_size``): only the calls that take Python bytes
#: use it, and this tier makes none of them.
LOCAL_BUFFER_BYTES = 16 * 2**20
#: Record headers of one batch go into one arena (a header is ~100-300 bytes: 64 of them fit many
#: times over); one arena per thread that may call at once: two lookup threads, the writer, a tool.
ARENA_BYTES = 256 * 2**10
ARENAS = 4
#: A stop waits this long for the client to close: with the master away its unmount takes ~13 s.
CLOSE_TIMEOUT_S = 3.0
#: Mooncake's error codes this tier tells apart (``mooncake-store/include/types.h``).
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
#: Setup attempts of the client (``MC_STORE_CLIENT_SETUP_RETRIES``, default 20 of ~4.4 s each
#: against a master that is away): one, since the writer's probe tries again anyway.
SETUP_RETRIES = "1"


def store_module() -> Any:
    """``mooncake.store``, or a ConfigError naming what is missing."""
    # Its client logs every step of its life at INFO (~15 lines per join) into the server's
    # output; this tier logs joins and outages itself. MC_LOG_LEVEL set by the operator wins.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        import mooncake.store as store
    except ImportError as exc:
        raise ConfigError(
            f"remote.url is mooncake:// but mooncake.store cannot be imported ({exc}): install the "
            "extra (pip install lmcache-toolkit[mooncake]; GPU clusters: [mooncake-cuda]) and, on "
            "Debian/Ubuntu, its libraries "
            "(apt-get install libibverbs1 librdmacm1)") from None
    return store


def address(view: memoryview) -> int:
    """The address of ``view``'s first byte (a buffer of this process: the pool, an arena)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class MooncakeTier(RemoteTier):
    """The remote tier in a Mooncake Store pool, this server one of its nodes."""

    label: ClassVar[str] = "Mooncake Store"
    faults: ClassVar[tuple[type[BaseException], ...]] = (RemoteTierError,)

    def __init__(self, master: str, metadata_server: str, *, memory: tuple[int, int],
                 local_hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 segment_bytes: int = 2**30, replicas: int = 1, prefer_local: bool = True,
                 queue_size: int = 256,
                 timeout_ms: int = 500, key_prefix: str = "lmcache", retry_interval_s: float = 1.0,
                 events: KVEventSink | None = None) -> None:
        """``master``: ``HOST:PORT``; ``memory``: ``(address, bytes)`` of the memory pool, the
        buffer every read lands in and every write comes from (registered with the engine)."""
        self._api = store_module()
        super().__init__(f"mooncake://{master}", queue_size, timeout_ms, key_prefix,
                         retry_interval_s, events)
        self.master = master
        self.metadata_server = metadata_server
        self.local_hostname = local_hostname
        self.protocol = protocol
        self.device_name = device_name
        self.segment_bytes = segment_bytes
        self.replicas = replicas
        self.prefer_local = prefer_local
        self._memory = memory
        self._replicate = self._api.ReplicateConfig()
        self._replicate.replica_num = replicas
        self._store: Any = None  # the client once set up (by the writer's first probe)
        self._node = ""  # its name in the pool once set up (``node``)
        self._connect_lock = threading.Lock()
        self._arenas: queue.Queue[np.ndarray] = queue.Queue()
        self._arena_memory = [np.zeros(ARENA_BYTES, dtype=np.uint8) for _ in range(ARENAS)]

    @property
    def down(self) -> bool:
        """Down during an outage, and until the client has joined the pool."""
        return self._down or self._store is None

    # ------------------------------------------------------------------ the client

    def _connect(self) -> Any:
        """Set the client up: join the pool (mount the segment), register the memory pool and
        the header arenas. Raises RemoteTierError when it cannot."""
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", SETUP_RETRIES)
        store = self._api.MooncakeDistributedStore()
        code = store.setup(self.local_hostname, self.metadata_server, self.segment_bytes,
                           LOCAL_BUFFER_BYTES, self.protocol, self.device_name, self.master)
        if code != 0:
            raise RemoteTierError(f"could not join the pool of master {self.master} (setup: {code})")
        for at, nbytes in [self._memory] + [(a.ctypes.data, a.nbytes) for a in self._arena_memory]:
            code = store.register_buffer(at, nbytes)
            if code != 0:  # leave the pool again: a node that cannot move bytes holds none
                store.close()
                raise RemoteTierError(f"register_buffer of {nbytes} bytes failed ({code})")
        for arena in self._arena_memory:
            self._arenas.put(arena)
        self._node = str(store.get_hostname())
        if self.prefer_local:  # the master tries this segment first, the others once it is full
            self._replicate.preferred_segment = self._node
        logger.info("remote tier: joined Mooncake Store at %s as %s (segment %d MiB, %d "
                    "replica(s), %s)", self.master, store.get_hostname(), self.segment_bytes >> 20,
                    self.replicas, self.protocol)
        return store

    @property
    def node(self) -> str:
        """This server's name in the pool (``HOST:PORT``, its segment's transfer endpoint, as
        replica descriptors name it); "" until it joined."""
        return self._node

    def _client(self) -> Any:
        """The client, when set up and its master answers its heartbeats; else RemoteTierError."""
        store = self._store
        if store is None:
            raise RemoteTierError("not joined to the pool yet")
        code = store.health_check()
        if code != 0:  # 1: closed, 2: the master does not answer
            raise RemoteTierError(f"the master {self.master} does not answer (health_check {code})")
        return store

    def _ping(self) -> None:
        """Join the pool if not yet; then one round trip to the master. Not ``health_check``
        alone: while the client reconnects to a master that is away it reports 0 at times, and a
        probe that believed it would put the tier up, each lookup then waiting on a dead master."""
        if self._store is None:
            with self._connect_lock:
                if self._closed:
                    raise RemoteTierError("the remote tier is stopped")
                if self._store is None:
                    self._store = self._connect()
        (code,) = self._client().batch_is_exist([self.key_prefix + "probe"])
        if code < 0:
            raise RemoteTierError(f"the master {self.master} does not answer ({code})")

    @contextlib.contextmanager
    def _arena(self) -> Iterator[np.ndarray]:
        """A registered header arena, for the ``with`` block."""
        try:
            arena = self._arenas.get(timeout=self.timeout_s)
        except queue.Empty:
            raise RemoteTierError("no header arena free in time") from None
        try:
            yield arena
        finally:
            self._arenas.put(arena)

    def name_of(self, key: ChunkKey) -> str:
        """The object's name: the remote key (``remote_keys``), as Redis would name it."""
        return self.remote_key(key).decode()

    # ------------------------------------------------------------------ lookups

    def _lengths(self, keys: Sequence[ChunkKey]) -> list[int]:
        store = self._client()
        names = [self.name_of(key) for key in keys]
        present = store.batch_is_exist(names)
        if any(code < 0 for code in present):
            raise RemoteTierError(f"batch_is_exist failed ({min(present)})")
        asked = [name for name, code in zip(names, present, strict=True) if code == 1]
        replicas = store.batch_get_replica_desc(asked) if asked else {}
        return [_object_size(replicas.get(name, ())) for name in names]

    def _fetch(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[Fetched]:
        store = self._client()
        got: list[Fetched] = [None] * len(keys)
        with self._arena() as arena:
            for start, end, offsets in _arena_groups(keys, arena.nbytes):
                names, pointers, sizes, index = [], [], [], []
                for i in range(start, end):
                    hlen = record.header_bytes(keys[i])
                    at = offsets[i - start]
                    if at + hlen > arena.nbytes:  # never read past the arena
                        self.n.add(errors=1)
                        continue
                    names.append(self.name_of(keys[i]))
                    pointers.append([arena.ctypes.data + at, address(outs[i])])
                    sizes.append([hlen, outs[i].nbytes])
                    index.append(i)
                if not names:
                    continue
                codes = store.batch_get_into_multi_buffers(names, pointers, sizes)
                if codes and all(code == RPC_FAIL for code in codes):
                    raise RemoteTierError("batch_get_into_multi_buffers: the master did not answer")
                for i, code in zip(index, codes, strict=True):
                    if code > 0:
                        got[i] = _verified(keys[i], arena, offsets[i - start], outs[i])
                    elif code != OBJECT_NOT_FOUND:  # another size than asked, a failed transfer
                        self.n.add(errors=1)
        return got

    def _delete(self, key: ChunkKey) -> None:
        # force: a read takes a lease on the object (the master's default_kv_lease_ttl), which
        # would keep a bad value readable for that long.
        self._client().remove(self.name_of(key), True)

    def count_keys(self, match: str, deadline: float,
                   clock: Callable[[], float] = time.monotonic) -> KeyCount:
        return KeyCount(self.key_prefix + match, 0, False,
                        "Mooncake Store cannot list keys (lmcache lookup asks for exact ones)")

    # ------------------------------------------------------------------ writes

    def _put(self, items: Sequence[Held]) -> list[BaseException | None]:
        store = self._client()
        results: list[BaseException | None] = [None] * len(items)
        keys = [key for key, _, _ in items]
        with self._arena() as arena:
            for start, end, offsets in _arena_groups(keys, arena.nbytes):
                names, pointers, sizes, index = [], [], [], []
                for i in range(start, end):
                    key, payload, payload_xxh3 = items[i]
                    try:
                        header = record.encode_header(key, payload, payload_xxh3)
                    except ValueError as exc:  # a key no record can hold
                        results[i] = exc
                        continue
                    at = offsets[i - start]
                    if at + len(header) > arena.nbytes:
                        results[i] = RemoteTierError(f"a {len(header)}-byte record header")
                        continue
                    arena[at:at + len(header)] = np.frombuffer(header, dtype=np.uint8)
                    names.append(self.name_of(key))
                    pointers.append([arena.ctypes.data + at, address(payload)])
                    sizes.append([len(header), payload.nbytes])
                    index.append(i)
                if not names:
                    continue
                codes = store.batch_put_from_multi_buffers(names, pointers, sizes, self._replicate)
                if codes and all(code == RPC_FAIL for code in codes):
                    raise RemoteTierError("batch_put_from_multi_buffers: the master did not answer")
                for i, name, code in zip(index, names, codes, strict=True):
                    if code != 0:  # e.g. no room in the pool (-200)
                        results[i] = RemoteTierError(f"put of {name}: {code}")
        return results

    def _close(self) -> None:
        """Close the client (leave the pool: its segment unmounted) on a helper thread, waited for
        at most ``CLOSE_TIMEOUT_S``: with the master away it would take ~13 s."""
        with self._connect_lock:
            store, self._store = self._store, None
        if store is None:
            return
        closer = threading.Thread(target=store.close, name="lmcache-mooncake-close", daemon=True)
        closer.start()
        closer.join(CLOSE_TIMEOUT_S)


def _object_size(replicas: Sequence[Any]) -> int:
    """An object's size from its replica descriptors: the first complete memory replica's."""
    for replica in replicas:
        if replica.is_memory_replica() and str(replica.status).endswith("COMPLETE"):
            return int(replica.get_memory_descriptor().buffer_descriptor.size)
    return 0


def _arena_groups(keys: Sequence[ChunkKey], arena_bytes: int
                  ) -> Iterator[tuple[int, int, list[int]]]:
    """``keys`` cut into runs whose record headers fit one arena: ``(start, end, offsets)``, each
    header at a 64-byte aligned offset. A header larger than the arena (a model name of many KiB)
    gets a run of its own and fails its call (counted like any refused write or failed read)."""
    start = 0
    while start < len(keys):
        offsets: list[int] = []
        at = 0
        end = start
        while end < len(keys) and end - start < MAX_BATCH_KEYS:
            size = record.header_bytes(keys[end])
            if offsets and at + size > arena_bytes:
                break
            offsets.append(at)
            at += -(-size // 64) * 64
            end += 1
        yield start, end, offsets
        start = end


def _verified(key: ChunkKey, arena: np.ndarray, at: int, out: memoryview) -> Fetched:
    """``(nbytes, payload checksum)`` of the record read into the arena at ``at`` and ``out``, or
    the RecordError that makes it a bad value."""
    try:
        header = record.parse_header(arena.data[at:at + record.header_bytes(key)])
        record.verify(header, out, key)
    except record.RecordError as exc:
        return exc
    return header.nbytes, header.payload_xxh3
