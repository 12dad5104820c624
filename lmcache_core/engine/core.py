"""``CacheEngine``: index, locks and eviction of chunk pieces over one pool (no sockets, no layouts).

Callers copy bytes in and out of pool views; the engine decides which allocation holds which piece,
who may see it and when it may go. One lock guards everything and is held only for dict work; the
copies run outside it, between ``begin_*`` and ``finish_*``. A piece's life:

* **writing**: ``begin_store`` reserved its pool bytes. Invisible to lookups and retrieves, never
  evicted; a second store of the same key counts as already present.
* **resident**: ``finish_store(ok=True)`` committed it; lookups see it from that moment.
* **locked**: a lookup holds it for a coming retrieve (``locks.LockTable``, with a TTL).
* **being read**: a retrieve or a tier writer copies out of it (a reader count).

Keys (``keys.ChunkKey``) name pieces: (model, layout fingerprint, head range, chunk hash). A lookup
for world size W counts a chunk only when its pieces cover every rank's head range; a retrieve of a
rank copies its range from whichever pieces hold it. Pieces of another layout are never seen.

LRU order: hits are touched (and new pieces committed) from the last chunk to the first, so a
prefix's head is the most recently used and eviction eats prefixes from the tail. Eviction works
across every model (``eviction``); optional per-model ``quotas`` and per-tenant ``tenant_quotas``
(bytes, by ``keys.tenant_tag`` of a cache_salt) bound each one's share: a piece under both fits both.

The lower tiers (``tiered.TieredStorage``) and the in-process async lookups (``async_lookup``) are
composed around the engine and use only its public methods (``engine.tier_api``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from lmcache_core.engine import eviction
from lmcache_core.engine.index import Piece, PieceIndex, cover, find_hits, touch_hits
from lmcache_core.engine.locks import LockTable
from lmcache_core.engine.plans import Counters, RetrievePlan, StorePlan
from lmcache_core.engine.retention import PLAIN, Retention, RetentionBook, eviction_order
from lmcache_core.engine.writing import Writing
from lmcache_core.errors import IncompatibleError, ProtocolError
from lmcache_core.events import KVEventSink
from lmcache_core.keys import ChunkKey, HeadRange
from lmcache_core.storage.pool import MemoryPool

MEMORY_TIER = "memory"


class CacheCore:
    """Pieces of chunks in one ``MemoryPool``; thread-safe."""

    def __init__(self, pool: MemoryPool, chunk_size: int, lock_ttl_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, *,
                 events: KVEventSink | None = None,
                 quotas: Mapping[str, int] | None = None,
                 tenant_quotas: Mapping[str, int] | None = None,
                 max_pinned_bytes: int | None = None) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if lock_ttl_s <= 0:
            raise ValueError(f"lock_ttl_s must be positive, got {lock_ttl_s}")
        self.pool = pool
        self.chunk_size = chunk_size
        self.lock_ttl_s = lock_ttl_s
        self.quotas = dict(quotas or {})
        self.tenant_quotas = dict(tenant_quotas or {})  # tenant tag -> bytes
        self.clock = clock
        self.mutex = threading.Lock()
        self.index = PieceIndex()
        self.locks = LockTable(lock_ttl_s)
        self.writing = Writing()  # key -> pool handle while a store or a tier load fills it
        self.counters = Counters()
        # Pins, TTLs, priorities asked for by requests; pins take at most a quarter of the pool
        # unless told otherwise.
        self.retention = RetentionBook(pool.nbytes // 4 if max_pinned_bytes is None
                                       else max_pinned_bytes)
        # Told of every piece that enters or leaves memory, under the lock (KV events for routers).
        self.events = events
        # The tiers' hooks: told of the keys a store committed (after it, outside the lock) and of
        # each key evicted (under the lock: no I/O).
        self.on_stored: Callable[[Sequence[ChunkKey]], None] | None = None
        self.on_evicted: Callable[[ChunkKey], None] | None = None

    # ------------------------------------------------------------------ lookup

    def lookup(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
               chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool = True) -> int:
        """How many leading chunks have pieces covering every head range in ``ranges`` (one per
        rank); lock them for ``lookup_id`` when ``lock``. A locking re-lookup under the same id
        replaces that id's previous locks. Hits are LRU-touched and counted."""
        if not ranges:
            raise ProtocolError("a lookup needs at least one head range")
        with self.mutex:
            chunks = self.lookup_locked(model_name, layout, ranges, chunk_hashes, lookup_id, lock)
            n = self.counters
            n.lookups += 1
            n.lookup_hit_chunks += chunks
            n.lookup_miss_chunks += len(chunk_hashes) - chunks
        return chunks

    def lookup_locked(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
                      chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool) -> int:
        """``lookup``'s work (caller holds ``mutex``), without its counters."""
        now = self.clock()
        if self.locks.due(now):
            self.counters.locks_expired += self.locks.expire(now)
        hits = find_hits(self.index, model_name, layout, ranges, chunk_hashes)
        if hits.count:
            touch_hits(self.index, hits)
        if lock and hits.count:
            self.locks.hold(lookup_id, hits.held, now)
        elif lock:  # a miss holds nothing, and drops what this id held before
            self.locks.release_all(lookup_id)
        return hits.count

    def expire_locks(self) -> int:
        """Release every lock older than ``lock_ttl_s``; returns how many piece locks went."""
        with self.mutex:
            now = self.clock()
            expired = self.locks.expire(now)
            self.counters.locks_expired += expired
            self.retention.lapse(now)  # pins whose TTL ended: ordinary pieces again
            return expired

    def free_lookup_locks(self, lookup_id: str) -> int:
        """Release whatever ``lookup_id`` still locks (its chunks that were not retrieved)."""
        with self.mutex:
            return self.locks.release_all(lookup_id)

    def end_session(self, lookup_id: str) -> int:
        """A request is over: release its remaining locks (unlike LMCache, which keeps them)."""
        return self.free_lookup_locks(lookup_id)

    # ------------------------------------------------------------------ store

    def begin_store(self, keys: Sequence[ChunkKey], nbytes: int,
                    retention: Retention = PLAIN, tenant: str = "") -> StorePlan:
        """Reserve pool bytes for each piece not yet held, evicting as needed.

        A key whose head range resident pieces already cover, or that is being written, counts as
        ``already_present`` (covering pieces get ``retention`` too, are touched as hits and never
        evicted for this store's room); keys no room can be found for
        count as ``skipped_full`` (earlier keys, the prefix's head, get room first). Never raises
        for a full pool. ``retention``: the request's TTL, pin and priority (``retention``);
        ``tenant``: its cache_salt tenant (``keys.tenant_tag``), whose quota applies too."""
        if not self.pool.fits(nbytes):
            raise IncompatibleError(
                f"a chunk piece of {nbytes} bytes does not fit the pool's "
                f"{self.pool.max_alloc_bytes} bytes (raise server.pool_size)")
        plan = StorePlan(nbytes, [], retention=retention, tenant=tenant)
        with self.mutex:
            now = self.clock()
            if self.locks.due(now):
                self.counters.locks_expired += self.locks.expire(now)
            claimed = self.claim(keys, nbytes, plan)
            self.counters.stores += 1
            self.counters.store_skipped_full += plan.skipped_full
            self.counters.store_skipped_quota += plan.skipped_quota
        view = self.pool.view
        plan.writes = [(index, key, view(handle, nbytes))
                       for (index, key), handle in zip(claimed, plan.handles, strict=True)]
        return plan

    def claim(self, keys: Sequence[ChunkKey], nbytes: int,
              plan: StorePlan) -> list[tuple[int, ChunkKey]]:
        """Under the lock: claim the keys not held yet and give them pool bytes, into ``plan``;
        the (request index, key) pairs that got room."""
        new: list[tuple[int, ChunkKey]] = []
        present: list[Piece] = []  # the resident pieces holding keys already present
        writing = self.writing
        for position, key in enumerate(keys):
            covering = None if key in writing else self.index.covering(key)
            if covering is None and key not in writing:
                writing.claim(key)
                new.append((position, key))
                continue
            plan.already_present += 1
            present += covering or ()
        if not plan.retention.plain:  # the pieces it found get its retention too
            plan.pin_refused += self.retention.keep(present, plan.retention, self.clock())
        # The present pieces are part of what this store keeps: touched as a hit (the prefix's
        # head most recent) and held while room is made, so its evictions never take them.
        for piece in reversed(present):
            self.index.touch(piece)
            piece.readers += 1
        try:
            got = self._room(new, nbytes, plan)
        finally:
            for piece in present:
                self.release_reader(piece)
        for _, key in new:
            writing.unclaim(key)
        plan.skipped_full += len(new) - len(got) - plan.skipped_quota
        return got

    def _room(self, new: Sequence[tuple[int, ChunkKey]], nbytes: int,
              plan: StorePlan) -> list[tuple[int, ChunkKey]]:
        """``claim``'s allocations, in request order until the pool is full (quotas skip keys)."""
        got: list[tuple[int, ChunkKey]] = []
        for position, key in new:
            if not self.quota_room(key.model_name, nbytes, plan.tenant):
                plan.skipped_quota += 1
                continue
            handle = self.allocate(nbytes, len(new) - len(got))
            if handle is None:
                break
            self.writing.reserve(key, handle, nbytes, plan.tenant)
            plan.keys.append(key)
            plan.handles.append(handle)
            got.append((position, key))
        return got

    def quota_room(self, model_name: str, nbytes: int, tenant: str = "") -> bool:
        """Whether a piece of ``model_name`` for ``tenant`` fits both their quotas (with the
        pieces being written, this request's and others', counted), evicting their own oldest
        pieces if that makes it fit; nothing is evicted when it cannot."""
        limits = eviction.quota_limits(self.index, self.writing, self.quotas, self.tenant_quotas,
                                       nbytes, model_name, tenant)
        if not limits:
            return True
        now = self.clock()
        victims = eviction.over_quotas(
            lambda: eviction_order(self.index, self.retention, now), now, limits)
        if victims is None:
            return False
        self._evict(victims)
        return True

    def allocate(self, nbytes: int, wanted: int) -> int | None:
        """Pool bytes for one piece, evicting LRU pieces (of any model) as needed."""
        handle = self.pool.allocate(nbytes)
        if handle is None:
            now = self.clock()
            order = eviction_order(self.index, self.retention, now)
            room = eviction.victims_for(self.index, self.pool, order, now, nbytes, wanted)
            self._evict(room.victims)
            if room.first_unit is not None:  # an extent: in the window emptied for it
                return self.pool.allocate_at(nbytes, room.first_unit)
            handle = self.pool.allocate(nbytes)
        return handle

    def finish_store(self, plan: StorePlan, ok: bool = True) -> None:
        """Commit the plan's pieces (visible to lookups from now on), or free them when not ``ok``.
        Calling it twice for one plan does nothing the second time."""
        with self.mutex:
            if plan.done:
                return
            plan.done = True
            if not ok:
                for key in plan.keys:
                    self.pool.free(self.writing.release(key))
                self.counters.store_pin_refused += plan.pin_refused
                return
            self.commit([(key, handle, plan.nbytes)
                         for key, handle in zip(plan.keys, plan.handles, strict=True)],
                        plan)
            self.counters.store_pin_refused += plan.pin_refused
            self.counters.stored_chunks += len(plan.keys)
            self.counters.stored_bytes += plan.nbytes * len(plan.keys)
        if plan.keys and self.on_stored is not None:  # the tiers' queues: outside the lock
            self.on_stored(plan.keys)

    def commit(self, items: Sequence[tuple[ChunkKey, int, int]],
               plan: StorePlan | None = None, checksums: Sequence[int] = ()) -> None:
        """Under the lock: make written ``(key, handle, nbytes)`` pieces resident, tail first,
        with the store ``plan``'s retention and checksums (or ``checksums``; none: 0)."""
        now, writing, add = self.clock(), self.writing, self.index.add
        retention = plan.retention if plan is not None else PLAIN
        tenant = plan.tenant if plan is not None else ""  # tier loads: records carry no tenant
        sums = checksums or (plan.checksums if plan is not None else ()) or [0] * len(items)
        for (key, handle, nbytes), checksum in zip(reversed(items), reversed(sums), strict=True):
            writing.release(key)
            piece = Piece(key, handle, nbytes, now, checksum, tenant)
            add(piece)
            if (plan is not None and not retention.plain
                    and not self.retention.apply(piece, retention, now, True)):
                plan.pin_refused += 1
        if self.events is not None and items:
            self.events.stored([key for key, _, _ in items], MEMORY_TIER)

    # ------------------------------------------------------------------ eviction

    def _evict(self, victims: Sequence[Piece]) -> None:
        """Every eviction passes here (under the lock: no I/O)."""
        for piece in victims:
            self.drop(piece)
            self.counters.evictions += 1
            if self.on_evicted is not None:
                self.on_evicted(piece.key)
        if self.events is not None and victims:
            self.events.removed([piece.key for piece in victims], MEMORY_TIER)

    def release_reader(self, piece: Piece) -> None:
        """Under the lock: a reader of ``piece`` is done; the last one frees a dropped piece."""
        piece.readers -= 1
        if piece.dropped and not piece.readers:
            piece.dropped = False
            self.pool.free(piece.handle)

    def drop(self, piece: Piece) -> None:
        """Under the lock: take ``piece`` out of the index; its bytes are freed now, or by its
        last reader (``release_reader``) when one is still copying out of it."""
        self.index.remove(piece)
        self.retention.forget(piece)
        if piece.readers:
            piece.dropped = True
        else:
            self.pool.free(piece.handle)

    # ------------------------------------------------------------------ retrieve

    def begin_retrieve(self, model_name: str, layout: str, heads: HeadRange,
                       chunk_hashes: Sequence[bytes], lookup_id: str = "") -> RetrievePlan:
        """For each chunk, the resident pieces covering ``heads``, pinned (a reader count) so
        nothing frees them mid-copy; chunks not covered are ``missing``."""
        plan = RetrievePlan(lookup_id, heads, [], [])
        lo, hi = heads
        view = self.pool.view
        with self.mutex:
            chunks_of = self.index.chunks.get
            for position, chunk_hash in enumerate(chunk_hashes):
                chunk = (model_name, layout, chunk_hash)
                pieces = chunks_of(chunk)
                covering = cover(pieces, lo, hi) if pieces else None
                if covering is None:
                    plan.missing.append(position)
                    continue
                for piece in covering:
                    piece.readers += 1
                plan.pieces.append(covering)
                plan.chunks.append(chunk)
                plan.found.append((position, [(view(p.handle, p.nbytes), p.key.head_lo,
                                               p.key.head_hi) for p in covering]))
            move = self.index.lru.move_to_end
            for covering in reversed(plan.pieces):
                for piece in covering:
                    move(piece.key)
            n = self.counters
            n.retrieves += 1
            n.retrieved_chunks += len(plan.found)
            n.retrieved_bytes += sum(p.nbytes for c in plan.pieces for p in c)
            n.retrieve_missing += len(plan.missing)
        return plan

    def finish_retrieve(self, plan: RetrievePlan, copied: int | None = None) -> None:
        """Unpin the plan's pieces and release ``plan.lookup_id``'s locks of its head range on
        the chunks read. ``copied``: how many of ``plan.found`` (a prefix) were copied when a
        deadline cut the rest (counted late, not retrieved); None: all. Idempotent."""
        with self.mutex:
            if plan.done:
                return
            plan.done = True
            for covering in plan.pieces:
                for piece in covering:
                    self.release_reader(piece)
            if copied is not None and copied < len(plan.pieces):
                late = plan.pieces[copied:]
                n = self.counters
                n.retrieve_late_chunks += len(late)
                n.retrieved_chunks -= len(late)
                n.retrieved_bytes -= sum(p.nbytes for c in late for p in c)
            if plan.lookup_id:
                self.locks.release_read(plan.lookup_id, plan.heads, plan.chunks)

    # ------------------------------------------------------------------ for the lower tiers
    # ``tiered.TieredStorage`` loads pieces into memory through these: room is reserved under the
    # lock (as a store does), filled outside it, and committed under it again.

    def commit_loaded(self, items: Sequence[tuple[ChunkKey, int, int]], got: Sequence[int],
                      checksums: Sequence[int] = ()) -> list[ChunkKey]:
        """Make the reserved pieces whose load got all their bytes resident, with their verified
        ``checksums`` (the records' ``payload_xxh3``); free the others."""
        with self.mutex:
            sums = checksums or [0] * len(items)
            whole = [(item, s) for item, n, s in zip(items, got, sums, strict=True) if n == item[2]]
            for (key, _handle, nbytes), n in zip(items, got, strict=True):
                if n != nbytes:
                    self.pool.free(self.writing.release(key))
            self.commit([item for item, _ in whole], checksums=[s for _, s in whole])
        return [item[0] for item, _ in whole]

    def memory(self, handle: int, nbytes: int) -> memoryview:
        """A pool allocation's bytes as a memoryview (no copy)."""
        return self.pool.view(handle, nbytes).numpy().data

    @contextmanager
    def reading(self, key: ChunkKey) -> Iterator[tuple[Piece, memoryview] | None]:
        """A resident piece and its bytes, held (not evictable) for the ``with`` block; None if
        gone. (The tiers' writers take bytes through it, checked against that piece's checksum.)"""
        with self.mutex:
            piece = self.index.get(key)
            if piece is not None:
                piece.readers += 1
        if piece is None:
            yield None
            return
        try:
            yield piece, self.memory(piece.handle, piece.nbytes)
        finally:
            with self.mutex:
                self.release_reader(piece)
