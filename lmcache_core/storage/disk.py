"""The L2 disk tier: one self-checking file per chunk piece in one directory, capped, LRU-deleted.

A file holds one piece (``ChunkKey``: KV heads ``[head_lo, head_hi)`` of one chunk of one model and
layout) and is named ``<hash hex>.<head_lo>-<head_hi>.<tag>.lmkv``, ``tag`` being the first 6 bytes
(12 hex digits) of blake3(model name 0x00 layout) (``file_name``). ``pieces_of`` lists the pieces
of one chunk on disk (a secondary index, kept with the main one).

Files are written behind, never on a request's path: a writer thread (a ``BackgroundWriter``)
takes chunk keys from a bounded queue (every store when ``write_through``; a full queue drops the
write and counts it) and, in any mode, keeps the part of the memory pool next in line for
eviction saved ahead of it (``spill``; in eviction's own order, pinned pieces left out), so that
when memory evicts a chunk its bytes are already here and eviction never waits on a disk write.
The writer pins the memory entry while it copies (``source``), so the bytes cannot change under
it.

A file is written to a temp name in the same directory and renamed over its final name, so a reader
never sees half a file; each holds a ``record`` (header with key, size and xxh3 checksums, then the
payload); ``disk_files`` names, scans, reads and writes them. At start the directory is re-indexed
from the headers (size checked against the header; leftover temp files deleted). The payload
checksum is checked on every read, into the destination slot, before the chunk is committed: a
truncated or corrupted file is deleted, counted (``disk_corrupt``), logged, and reported as a miss,
never served.

The index is an in-memory LRU (``contains`` is a dict lookup, safe to call under the engine's lock);
file I/O and unlinks happen outside this tier's own lock, which only guards dict work, except the
rare unlink of a bad file or of one ``remove`` drops: done with its index change, since a file's name
is fixed per key and the writer may save the key again right after it is unindexed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from lmcache_core.errors import ConfigError
from lmcache_core.events import DISK, KVEventSink
from lmcache_core.keys import ChunkKey, HeadRange
from lmcache_core.stats import DiskStats
from lmcache_core.storage import record
from lmcache_core.storage.disk_files import SUFFIX as SUFFIX
from lmcache_core.storage.disk_files import TMP_PREFIX as TMP_PREFIX
from lmcache_core.storage.disk_files import DiskFile, read_payload, scan, unlink, write_file
from lmcache_core.storage.disk_files import file_name as file_name
from lmcache_core.storage.disk_files import iter_files as iter_files
from lmcache_core.storage.writer import BackgroundWriter
from lmcache_core.supervision import Supervisor

logger = logging.getLogger(__name__)

#: A chunk, all of whose pieces share it: (model name, layout, chunk hash) (``ChunkKey.chunk``).
Chunk = tuple[str, str, bytes]

_MAX_LOGGED_AT_START = 10

#: ``source(key)``: the resident piece's bytes and their checksum, verified (held for the ``with``
#: block; the record takes that checksum without hashing the bytes again), or None when gone.
Source = Callable[[ChunkKey], AbstractContextManager[tuple[memoryview, int] | None]]
#: The memory chunks nearest eviction that are not on disk yet (at most ``limit``).
ColdKeys = Callable[[int], list[ChunkKey]]


class DiskTier:
    """Chunk files under ``path``, at most ``max_bytes`` of them (file sizes), LRU-deleted."""

    name = "disk"

    def __init__(self, path: str | os.PathLike[str], max_bytes: int, write_through: bool = False,
                 queue_size: int = 1024, *, events: KVEventSink | None = None) -> None:
        """``events``: told of files indexed and dropped, under this tier's lock (KV events)."""
        if max_bytes <= 0:
            raise ConfigError(f"disk.max_size must be positive, got {max_bytes}")
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"disk.path: cannot create {self.path}: {exc.strerror}") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise ConfigError(f"disk.path: {self.path} is not writable")
        self.max_bytes = max_bytes
        self.write_through = write_through
        self.n = DiskStats()  # its section of SERVER_INFO
        self._mutex = threading.Lock()
        self._index: OrderedDict[ChunkKey, DiskFile] = OrderedDict()  # front = least recently used
        # The pieces of each chunk in ``_index`` (insertion-ordered sets), changed with it.
        self._chunks: dict[Chunk, dict[ChunkKey, None]] = {}
        # Chunks per (model, layout) in ``_chunks``, changed with it: what an explain looks
        # through (``holders``) without a walk over every file.
        self._pairs: dict[tuple[str, str], int] = {}
        self._bytes = 0  # file bytes indexed plus bytes reserved by writes in progress
        self._writer: BackgroundWriter[ChunkKey] = BackgroundWriter(
            "disk tier", "lmcache-disk-writer", queue_size, self._write_batch, idle=self._spill)
        self._source: Source | None = None  # the writer's, from ``start``
        self._cold: ColdKeys | None = None
        self._failing = False  # a write error was logged; log the next only after a success
        self.events = events
        self.reindex()

    # ------------------------------------------------------------------ index

    def reindex(self) -> int:
        """(Re)build the index from the directory's headers; returns how many chunks it holds."""
        bad = 0

        def on_bad(name: str, exc: record.RecordError) -> None:  # counted, logged, then deleted
            nonlocal bad
            bad += 1
            self.n.add(corrupt=1)
            if bad <= _MAX_LOGGED_AT_START:
                logger.warning("disk tier: dropping %s: %s", self.path / name, exc)

        found = scan(self.path, on_bad)
        if bad > _MAX_LOGGED_AT_START:
            logger.warning("disk tier: dropped %d bad files in %s in all", bad, self.path)
        with self._mutex:
            self._index = OrderedDict((key, meta) for _, key, meta in found)
            self._chunks, self._pairs = {}, {}
            for key in self._index:
                self._index_chunk(key)
            self._bytes = sum(meta.size for _, _, meta in found)
            victims = self._over_cap(0)
        self._delete(victims)
        if found:
            logger.info("disk tier: %d chunks (%.1f MiB) indexed in %s", len(self._index),
                        self._bytes / 2**20, self.path)
        return len(self._index)

    def _index_chunk(self, key: ChunkKey) -> None:
        """Add ``key`` to the chunk index (under the lock, as ``_index`` gains it)."""
        pieces = self._chunks.get(key.chunk)
        if pieces is None:
            pieces = self._chunks[key.chunk] = {}
            pair = (key.model_name, key.layout)
            self._pairs[pair] = self._pairs.get(pair, 0) + 1
        pieces[key] = None

    def _unindex(self, key: ChunkKey) -> None:
        """Drop ``key`` from the chunk index (under the lock, as ``_index`` loses it)."""
        chunk = key.chunk
        pieces = self._chunks.get(chunk)
        if pieces is not None:
            pieces.pop(key, None)
            if not pieces:
                del self._chunks[chunk]
                pair = (key.model_name, key.layout)
                self._pairs[pair] -= 1
                if not self._pairs[pair]:
                    del self._pairs[pair]

    def pairs(self) -> list[tuple[str, str]]:
        """Every (model, layout) with chunks on disk (no I/O)."""
        with self._mutex:
            return list(self._pairs)

    def holders(self, chunk_hashes: Sequence[bytes], first_model: str, max_pairs: int,
                per_hold: int = 64) -> tuple[list[tuple[int, str, str, list[HeadRange]]], bool]:
        """Which (model, layout) pairs hold each of ``chunk_hashes`` on disk, as ``(probe index,
        model, layout, head ranges)``, from the index alone (no I/O): ``first_model``'s pairs
        first, at most ``max_pairs`` (True beside the finds when there were more), this tier's
        lock held for ``per_hold`` pairs at a time."""
        pairs = sorted(self.pairs(), key=lambda pair: pair[0] != first_model)
        found: list[tuple[int, str, str, list[HeadRange]]] = []
        for start in range(0, min(len(pairs), max_pairs), per_hold):
            with self._mutex:
                for model_name, layout in pairs[start:min(start + per_hold, max_pairs)]:
                    for probe, chunk_hash in enumerate(chunk_hashes):
                        pieces = self._chunks.get((model_name, layout, chunk_hash))
                        if pieces:
                            found.append((probe, model_name, layout, sorted(
                                {(key.head_lo, key.head_hi) for key in pieces})))
        return found, len(pairs) > max_pairs

    def pieces_of(self, model_name: str, layout: str, chunk_hash: bytes) -> list[tuple[ChunkKey, int]]:
        """The pieces of chunk ``(model_name, layout, chunk_hash)`` on disk, with their payload
        nbytes, by head range (no I/O; O(pieces))."""
        with self._mutex:
            pieces = self._chunks.get((model_name, layout, chunk_hash))
            if not pieces:
                return []
            found = [(key, self._index[key].nbytes) for key in pieces]
        found.sort(key=lambda item: (item[0].head_lo, item[0].head_hi))
        return found

    def contains(self, key: ChunkKey) -> bool:
        """Whether a file for ``key`` is indexed (a dict lookup: no I/O, no lock)."""
        return key in self._index

    def nbytes_of(self, key: ChunkKey) -> int | None:
        """The payload size of ``key``'s file, or None when there is none."""
        meta = self._index.get(key)
        return None if meta is None else meta.nbytes

    def __len__(self) -> int:
        return len(self._index)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def listing(self, model_name: str | None = None) -> list[tuple[ChunkKey, int, float]]:
        """The indexed pieces (of ``model_name`` if given) as ``(key, payload nbytes, written at
        (wall clock))``, most recently used first: for ``inspect-chunks``, from the index alone
        (no I/O; one pass under this tier's lock, which guards only dict work)."""
        with self._mutex:
            return [(key, meta.nbytes, meta.mtime) for key, meta in reversed(self._index.items())
                    if model_name is None or key.model_name == model_name]

    def lru_keys(self) -> list[ChunkKey]:
        """The indexed keys, least recently used first."""
        with self._mutex:
            return list(self._index)

    # ------------------------------------------------------------------ read

    def read_into(self, key: ChunkKey, out: memoryview) -> int:
        """Load ``key``'s payload into ``out``; its byte count, or 0 for a miss (``load_into``)."""
        return self.load_into(key, out)[0]

    def load_into(self, key: ChunkKey, out: memoryview) -> tuple[int, int]:
        """Load ``key``'s payload into ``out``: ``(byte count, the piece's checksum)``, verified
        against the record's ``payload_xxh3``; ``(0, 0)`` for a miss.

        A missing file is a quiet miss; a bad one is dropped (deleted, counted, logged). ``out`` may
        hold garbage after a failed read: the caller only commits a slot whose read returned > 0.
        """
        with self._mutex:
            meta = self._index.get(key)
            if meta is None:
                return 0, 0
            self._index.move_to_end(key)
        if meta.nbytes > out.nbytes:
            return 0, 0
        path = self.path / meta.name
        try:
            payload_xxh3 = read_payload(path, meta, key, out)
        except FileNotFoundError:
            self._forget(key, meta)
            return 0, 0
        except record.RecordError as exc:
            self._drop_bad(key, meta, str(exc))
            return 0, 0
        except OSError as exc:
            self._io_error(f"cannot read {path}", exc)
            return 0, 0
        with contextlib.suppress(OSError):
            os.utime(path)  # so a restart's re-index keeps the LRU order
        self.n.add(loaded_chunks=1)
        return meta.nbytes, payload_xxh3

    def _forget(self, key: ChunkKey, meta: DiskFile, delete: bool = False) -> bool:
        """Unindex ``key`` if ``meta`` is still its file; True if it was. ``delete``: unlink the
        file too, under the lock: once unindexed, the writer may save the key again under the same
        name, and an unlink after that would delete the fresh file while it is indexed."""
        with self._mutex:
            if self._index.get(key) is not meta:
                return False
            del self._index[key]
            self._unindex(key)
            self._bytes -= meta.size
            if self.events is not None:
                self.events.removed((key,), DISK)
            if delete:
                unlink(self.path / meta.name)
            return True

    def _drop_bad(self, key: ChunkKey, meta: DiskFile, why: str) -> None:
        if self._forget(key, meta, delete=True):
            self.n.add(corrupt=1)
            logger.warning("disk tier: dropped %s (%s): %s", self.path / meta.name, key.short(), why)

    # ------------------------------------------------------------------ write

    def write(self, key: ChunkKey, payload: memoryview, payload_xxh3: int = 0) -> bool:
        """Write ``key``'s file now (temp file, then an atomic rename); True once it is indexed.
        ``payload_xxh3``: the payload's checksum, verified by the caller (0: taken here)."""
        if key in self._index:
            return True
        nbytes = payload.nbytes
        header = record.encode_header(key, payload, payload_xxh3)
        size = len(header) + nbytes
        if size > self.max_bytes:
            return False
        with self._mutex:
            victims = self._over_cap(size)
            self._bytes += size  # reserved, so concurrent writers respect the cap too
        self._delete(victims)
        name = file_name(key)
        tmp = self.path / f"{TMP_PREFIX}{uuid.uuid4().hex}{SUFFIX}"
        try:
            write_file(tmp, self.path / name, header, payload)
        except OSError as exc:
            with self._mutex:
                self._bytes -= size
            unlink(tmp)
            self._io_error(f"cannot write {self.path / name}", exc)
            return False
        with self._mutex:
            old = self._index.pop(key, None)
            if old is not None:
                self._bytes -= old.size
            self._index[key] = DiskFile(name, len(header), nbytes, size)
            self._index_chunk(key)
            if self.events is not None:
                self.events.stored((key,), DISK)
        self.n.add(written_chunks=1)
        if self._failing:
            self._failing = False
            logger.info("disk tier: writing to %s again", self.path)
        return True

    def _over_cap(self, incoming: int) -> list[DiskFile]:
        """Pop LRU files until ``incoming`` more bytes fit (under the lock); the caller unlinks."""
        victims: list[DiskFile] = []
        gone: list[ChunkKey] = []
        index = self._index
        while index and self._bytes + incoming > self.max_bytes:
            key, meta = index.popitem(last=False)
            self._unindex(key)
            self._bytes -= meta.size
            victims.append(meta)
            gone.append(key)
        if self.events is not None and gone:
            self.events.removed(gone, DISK)
        return victims

    def _delete(self, victims: Iterable[DiskFile]) -> None:
        for meta in victims:
            unlink(self.path / meta.name)
            self.n.add(deleted=1)

    def _io_error(self, what: str, exc: OSError) -> None:
        self.n.add(errors=1)
        if not self._failing:
            self._failing = True
            logger.warning("disk tier: %s: %s (further errors are only counted until it works)",
                           what, exc.strerror or exc)

    def remove(self, key: ChunkKey) -> bool:
        """Delete ``key``'s file if there is one."""
        meta = self._index.get(key)
        return meta is not None and self._forget(key, meta, delete=True)

    # ------------------------------------------------------------------ writer thread

    def submit(self, keys: Iterable[ChunkKey]) -> int:
        """Queue keys to be written behind; a full queue drops (and counts) the rest. Never blocks."""
        index = self._index
        dropped = self._writer.submit(key for key in keys if key not in index)
        if dropped:
            self.n.add(write_dropped=dropped)
        return dropped

    def notify(self) -> None:
        """Memory filled up a bit: let the writer save what is nearest eviction (after its current
        write, or at its next idle tick)."""
        self._writer.request_idle()

    def count_evicted_unsaved(self) -> None:
        self.n.add(evicted_unsaved=1)

    def start(self, source: Source, cold: ColdKeys | None = None,
              supervisor: Supervisor | None = None) -> None:
        """Start the writer thread (watched by ``supervisor``: a writer that dies fails the
        server), writing what is queued from ``source`` (the engine's pieces, verified), and,
        when idle, what ``cold`` says is nearest eviction."""
        self._source = source
        self._cold = cold
        self._writer.start(supervisor)

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Write what is queued (for at most ``drain_timeout_s``), then end the writer."""
        self._writer.stop(drain_timeout_s, grace_s=1.0)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the queue is written (tests, shutdown); True if it emptied in time."""
        return self._writer.flush(timeout_s)

    def _write_batch(self, keys: list[ChunkKey]) -> None:
        for key in keys:
            self._write_from_source(key)

    def _spill(self) -> None:
        if self._cold is None:
            return
        for key in self._cold(64):
            if self._writer.stopping:
                return
            self._write_from_source(key)

    def _write_from_source(self, key: ChunkKey) -> None:
        if key in self._index or self._source is None:
            return
        with self._source(key) as found:
            if found is not None:
                self.write(key, *found)

    def stats(self) -> DiskStats:
        """Its section of SERVER_INFO, read now."""
        return self.n.copy(chunks=len(self._index), bytes=self._bytes, queued=self._writer.queued)

