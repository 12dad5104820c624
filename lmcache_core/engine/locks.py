"""Lookup locks: what each lookup id holds for its coming retrieves, released by them or a TTL.

A lookup for world size W locks, for each rank's head range, the pieces that cover it; the retrieve
of that rank releases its range's locks on each chunk it read (whichever pieces it used), so a piece
serving two ranks (a TP=1 piece read by TP=2) stays locked until both have read it. Locked pieces are
never evicted. A lookup may expect several readers of each rank's range (LMCache's
``num_kv_readers``: ``set_readers``): a (range, chunk) lock then goes with its last expected read,
or when ``release_chunks`` releases the reads left. Not thread-safe: the engine calls it under its
lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterable, Mapping

from lmcache_core.engine.index import ChunkId, Held, Piece
from lmcache_core.keys import ChunkKey, HeadRange


class LockSet:
    """The pieces one lookup id locked: per head range, per chunk."""

    __slots__ = ("held", "readers", "reads", "seq", "shared")

    def __init__(self, seq: int) -> None:
        self.held: dict[HeadRange, dict[ChunkId, list[Piece]]] = {}
        self.seq = seq
        self.readers = 1  # reads per rank of each (range, chunk) its lock waits for
        self.shared = 1  # ranks reading each range (MLA: every rank reads the one range)
        self.reads: dict[tuple[HeadRange, ChunkId], int] = {}  # reads so far, while < expected

    def read(self, heads: HeadRange, chunk: ChunkId, reads: int) -> list[Piece]:
        """``reads`` reads of ``heads`` on ``chunk``: the pieces whose lock they end (none while
        reads are still expected, or when it holds no such lock)."""
        held = self.held.get(heads)
        if held is None or chunk not in held:
            return []
        expected = self.readers * self.shared
        if expected > 1:
            done = self.reads.get((heads, chunk), 0) + reads
            if done < expected:
                self.reads[(heads, chunk)] = done
                return []
            self.reads.pop((heads, chunk), None)
        pieces = held.pop(chunk)
        if not held:
            del self.held[heads]
        return pieces

    def count(self) -> int:
        return sum(len(pieces) for chunks in self.held.values() for pieces in chunks.values())


class LockTable:
    """lookup id -> LockSet, with a min-heap of TTL deadlines."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.sets: dict[str, LockSet] = {}
        self._expiry: list[tuple[float, int, str]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.sets)

    def hold(self, lookup_id: str, held: Held, now: float) -> None:
        """Lock the pieces ``held`` (``index.Hits.held``, handed over: kept as it is) for
        ``lookup_id``, replacing what it held."""
        self.release_all(lookup_id)
        lock_set = LockSet(next(self._seq))
        lock_set.held = held
        for chunks in held.values():
            for pieces in chunks.values():
                for piece in pieces:
                    piece.locks += 1
        self.sets[lookup_id] = lock_set
        heapq.heappush(self._expiry, (now + self.ttl_s, lock_set.seq, lookup_id))
        if len(self._expiry) > 2 * len(self.sets) + 64:
            self._compact()

    def release_all(self, lookup_id: str) -> int:
        """Drop every lock of ``lookup_id``; how many piece locks went."""
        lock_set = self.sets.pop(lookup_id, None)
        if lock_set is None:
            return 0
        released = 0
        for chunks in lock_set.held.values():
            for pieces in chunks.values():
                for piece in pieces:
                    piece.locks -= 1
                released += len(pieces)
        return released

    def release_read(self, lookup_id: str, heads: HeadRange, chunks: Iterable[ChunkId]) -> None:
        """A retrieve of range ``heads`` read ``chunks``: one read of each; a lock goes with the
        last read its lookup expects (``set_readers``; one by default)."""
        lock_set = self.sets.get(lookup_id)
        if lock_set is None:
            return
        for chunk in chunks:
            for piece in lock_set.read(heads, chunk, 1):
                piece.locks -= 1
        if not lock_set.held:
            del self.sets[lookup_id]

    def set_readers(self, lookup_id: str, readers: int, shared: int = 1) -> bool:
        """Each (range, chunk) lock of ``lookup_id`` waits for ``readers`` reads by each of the
        ``shared`` ranks that read its range (set right after its lookup, before any read);
        False if it holds none."""
        lock_set = self.sets.get(lookup_id)
        if lock_set is None:
            return False
        lock_set.readers, lock_set.shared = max(1, readers), max(1, shared)
        return True

    def release_chunks(self, lookup_id: str, chunk_hashes: Collection[bytes], reads: int,
                       only: HeadRange | None = None) -> int:
        """Count ``reads`` reads by every rank (or by the one reading the range ``only``) on the
        chunks named by ``chunk_hashes`` (whatever their model and layout); how many piece locks
        went."""
        lock_set = self.sets.get(lookup_id)
        if lock_set is None:
            return 0
        released = 0
        per_range = reads if only is not None else reads * lock_set.shared
        for heads, held in list(lock_set.held.items()):
            if only is not None and heads != only:
                continue
            for chunk in [c for c in held if c[2] in chunk_hashes]:
                for piece in lock_set.read(heads, chunk, per_range):
                    piece.locks -= 1
                    released += 1
        if not lock_set.held:
            del self.sets[lookup_id]
        return released

    def due(self, now: float) -> bool:
        return bool(self._expiry) and self._expiry[0][0] <= now

    def expire(self, now: float) -> int:
        """Release the lock sets past their TTL; how many piece locks went."""
        expired = 0
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, seq, lookup_id = heapq.heappop(expiry)
            lock_set = self.sets.get(lookup_id)
            if lock_set is not None and lock_set.seq == seq:
                expired += self.release_all(lookup_id)
        return expired

    def purge(self, alive: Mapping[ChunkKey, Piece]) -> None:
        """Forget locks on pieces no longer indexed (after a forced clear)."""
        for lookup_id, lock_set in list(self.sets.items()):
            for heads, chunks in list(lock_set.held.items()):
                for chunk, pieces in list(chunks.items()):
                    kept = [p for p in pieces if alive.get(p.key) is p]
                    if kept:
                        chunks[chunk] = kept
                    else:
                        del chunks[chunk]
                if not chunks:
                    del lock_set.held[heads]
            if not lock_set.held:
                del self.sets[lookup_id]

    def keys_of(self, lookup_id: str) -> list[ChunkKey]:
        lock_set = self.sets.get(lookup_id)
        if lock_set is None:
            return []
        return list(dict.fromkeys(p.key for chunks in lock_set.held.values()
                                  for pieces in chunks.values() for p in pieces))

    def held_count(self) -> int:
        return sum(lock_set.count() for lock_set in self.sets.values())

    def deadlines(self) -> int:
        """The entries of the TTL heap, live and stale (compacted: bounded by the lock sets)."""
        return len(self._expiry)

    def _compact(self) -> None:
        live = {lookup_id: lock_set.seq for lookup_id, lock_set in self.sets.items()}
        self._expiry = [item for item in self._expiry if live.get(item[2]) == item[1]]
        heapq.heapify(self._expiry)
