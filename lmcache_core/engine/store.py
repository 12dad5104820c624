"""``PieceStore``: the one owner of the engine's state: the pool, the index of pieces, their locks,
pins and lifecycle (no sockets, no layouts, no wire structs).

Callers copy bytes in and out of pool views; the store decides which allocation holds which piece,
who may see it and when it may go. Its lock is private: every other part of the engine (the
tiers, the integrity guard, the async lookups, ``CacheEngine``'s admin views) works through its
methods, each taking the lock briefly for dict work; the copies and all I/O run outside it, between
``begin_*`` and ``finish_*`` (or ``reserve_loads`` and ``commit_loaded``). A piece's states and
every move between them are one table (``lifecycle``): writing, resident (locked, being read),
dropped while read, freed.

Checksums: a big store commits its pieces as soon as their bytes are in, their checksums still
being taken from their slots (``finish_store(checksums_pending=True)``); each piece is then held
by its hash, as a reader, until ``record_checksums``. What relies on a checksum waits for it
(``wait_checksums``: tier writes and verified retrieves, through ``verify``), and a store short of
room waits, bounded, for those hashes to end before it gives up (``_await_hashes``).

Keys (``keys.ChunkKey``) name pieces: (model, layout fingerprint, head range, chunk hash). A lookup
for world size W counts a chunk only when its pieces cover every rank's head range; a retrieve of a
rank copies its range from whichever pieces hold it. Pieces of another layout are never seen.

LRU order: hits are touched (and new pieces committed) from the last chunk to the first, so a
prefix's head is the most recently used and eviction eats prefixes from the tail. Eviction works
across every model (``eviction``: it takes only the room a store needs); optional per-model
``quotas`` and per-tenant ``tenant_quotas`` (bytes, by ``keys.tenant_tag`` of a cache_salt) bound
each one's share: a piece under both fits both.

Hooks, given at construction: ``on_stored(keys)`` after a store committed (outside the lock: the
tiers queue their writes), ``on_evicted(key)`` for each piece evicted (under the lock: no I/O), and
``events`` (KV events for routers) of every piece that enters or leaves memory.

Its state is private: its figures are ``snapshot`` (the typed ``stats.EngineStats``), and
``inspect`` reads the rest at one moment (``Inspection``: every piece's state, locks, readers,
pins and retention, each lookup's locks, what is being written) for tests and debugging.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from lmcache_core.engine import eviction
from lmcache_core.engine.index import (
    GroupTarget,
    Hits,
    Holder,
    Pair,
    Piece,
    PieceIndex,
    cover,
    find_group_hits,
    find_hits,
    find_holders,
    touch_hits,
)
from lmcache_core.engine.lifecycle import Event, State, advance
from lmcache_core.engine.locks import LockTable
from lmcache_core.engine.plans import Counters, RetrievePlan, StorePlan
from lmcache_core.engine.retention import (
    PLAIN,
    Retention,
    RetentionBook,
    eviction_order,
    pinned_now,
)
from lmcache_core.engine.writing import Writing
from lmcache_core.errors import IncompatibleError, PinLimitError, ProtocolError
from lmcache_core.events import KVEventSink
from lmcache_core.keys import ChunkKey, HeadRange
from lmcache_core.stats import EngineStats
from lmcache_core.storage.checksum_lanes import LANE_TIMEOUT_S
from lmcache_core.storage.integrity import ABANDONED, PENDING
from lmcache_core.storage.pool import MemoryPool

MEMORY_TIER = "memory"
#: (model, layout) pairs ``holders`` looks through per hold of the lock: 64 pairs x the 128
#: probes an explain may carry is ~8k dict look-ups (about a millisecond), so lookups and stores
#: wait that long at most behind it, however many models the server holds.
PAIRS_PER_HOLD = 64


class PieceRow(NamedTuple):
    """One piece as a listing shows it (``PieceStore.rows``; the server's listing makes the disk's
    too, and the wire rows)."""

    chunk_hash: bytes
    model_name: str
    layout: str
    head_lo: int
    head_hi: int
    nbytes: int
    age_s: float
    locks: int = 0
    hits: int = 0
    pinned: bool = False
    expires_in_s: float | None = None  # what is left of its TTL (None: it has none)
    priority: int = 0
    tier: str = MEMORY_TIER


class PieceView(NamedTuple):
    """One piece as ``PieceStore.inspect`` read it (``index.Piece``'s fields, frozen)."""

    state: State
    handle: int
    nbytes: int
    checksum: int
    tenant: str
    locks: int
    readers: int
    hits: int
    pinned: bool
    expires: float  # when its TTL ends, on the store's clock (math.inf: none)
    priority: int

    @classmethod
    def of(cls, piece: Piece) -> PieceView:
        return cls(piece.state, piece.handle, piece.nbytes, piece.checksum, piece.tenant,
                   piece.locks, piece.readers, piece.hits, piece.pinned, piece.expires,
                   piece.priority)


class Inspection(NamedTuple):
    """A read-only snapshot of a store's state, read at one moment (``PieceStore.inspect``): for
    tests and debugging; the server reports ``stats`` (``snapshot``) and the admin views."""

    #: The resident pieces (visible to lookups), least recently used first.
    pieces: dict[ChunkKey, PieceView]
    #: The pieces being written (a store copying in, a tier load filling); None: a key claimed,
    #: no room yet.
    writing: dict[ChunkKey, PieceView | None]
    #: The pieces each lookup id holds locks on.
    locks: dict[str, list[ChunkKey]]
    #: The entries of the locks' TTL heap (live and stale ones: it is compacted, so bounded).
    lock_deadlines: int
    #: Per model and per tenant tag, the resident pieces and bytes; the bytes being written.
    models: dict[str, tuple[int, int]]
    tenants: dict[str, tuple[int, int]]
    writing_models: dict[str, int]
    writing_tenants: dict[str, int]
    #: Resident pieces with a TTL, pin or priority of their own (retention's bookkeeping).
    hinted: int
    #: The counters and gauges (``snapshot``): pool usage, locks held, pins, checksums pending.
    stats: EngineStats

    def resident(self, key: ChunkKey) -> bool:
        """Whether the piece ``key`` is committed (visible to lookups)."""
        return key in self.pieces

    def locks_of(self, lookup_id: str) -> list[ChunkKey]:
        """The pieces ``lookup_id`` holds a lock on."""
        return self.locks.get(lookup_id, [])


class PieceStore:
    """Pieces of chunks in one ``MemoryPool``; thread-safe."""

    def __init__(self, pool: MemoryPool, chunk_size: int, lock_ttl_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, *,
                 events: KVEventSink | None = None,
                 quotas: Mapping[str, int] | None = None,
                 tenant_quotas: Mapping[str, int] | None = None,
                 max_pinned_bytes: int | None = None,
                 on_stored: Callable[[Sequence[ChunkKey]], None] | None = None,
                 on_evicted: Callable[[ChunkKey], None] | None = None) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if lock_ttl_s <= 0:
            raise ValueError(f"lock_ttl_s must be positive, got {lock_ttl_s}")
        self._pool = pool
        self.chunk_size = chunk_size
        self.lock_ttl_s = lock_ttl_s
        self._quotas = dict(quotas or {})
        self._tenant_quotas = dict(tenant_quotas or {})  # tenant tag -> bytes
        self._clock = clock
        self._mutex = threading.Lock()
        # Notified whenever checksums are recorded (``record_checksums``): what waits for one (a
        # tier write, a verified retrieve, a store short of room) waits on it.
        self._hashed = threading.Condition(self._mutex)
        self._hashing = 0  # pieces whose checksum is being taken (each held by the hash)
        # The state below is this store's alone, read and changed only by its methods (under
        # ``_mutex``); ``inspect`` gives a read-only snapshot of it (tests, debugging).
        self._index = PieceIndex()
        self._locks = LockTable(lock_ttl_s)
        self._writing = Writing()  # key -> its piece while a store or a tier load fills it
        self._counters = Counters()
        # Pins, TTLs, priorities asked for by requests; pins take at most a quarter of the pool
        # unless told otherwise.
        self._retention = RetentionBook(pool.nbytes // 4 if max_pinned_bytes is None
                                       else max_pinned_bytes)
        self._events = events
        self._on_stored = on_stored
        self._on_evicted = on_evicted

    # ------------------------------------------------------------------ lookup

    def lookup(self, model_name: str, groups: Sequence[GroupTarget],
               chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool = True,
               readers: int = 1, shared: int = 1, earlier_hits: int | None = None) -> int:
        """How many leading chunks can be restored from resident pieces: for one full-attention
        group (a model of one layout), the chunks whose pieces cover every head range in its
        ``ranges`` (one per rank); for a hybrid model's KV-cache groups, the chunks at whose end
        every group can be restored (``index.find_group_hits``). When ``lock``, every piece of
        the hit is locked for ``lookup_id`` (each lock going with the ``readers``-th read by
        each of the ``shared`` ranks reading its range: ``set_lock_readers``; each group's
        retrieve releases its own). A locking re-lookup under the same id replaces that id's
        previous locks. Hits are LRU-touched and counted; ``earlier_hits``: this is the
        re-lookup after the tiers loaded pieces, of a lookup that found that many: the chunks
        found since count as its hits, not as a new lookup."""
        if not groups or any(not group.ranges for group in groups):
            raise ProtocolError("a lookup needs at least one head range in each KV-cache group")
        asked = len(chunk_hashes)
        with self._mutex:
            now = self._clock()
            if self._locks.due(now):
                self._counters.locks_expired += self._locks.expire(now)
            hits = self._find(model_name, groups, chunk_hashes)
            chunks = hits.count
            if chunks:
                touch_hits(self._index, hits)
            if lock and chunks:
                self._locks.hold(lookup_id, hits.held, now)
                if readers != 1 or shared != 1:
                    self._locks.set_readers(lookup_id, readers, shared)
            elif lock:  # a miss holds nothing, and drops what this id held before
                self._locks.release_all(lookup_id)
            n = self._counters
            if earlier_hits is None:
                n.lookups += 1
                n.lookup_hit_chunks += chunks
                n.lookup_miss_chunks += asked - chunks
            else:
                n.lookup_hit_chunks += chunks - earlier_hits
                n.lookup_miss_chunks -= chunks - earlier_hits
        return chunks

    def _find(self, model_name: str, groups: Sequence[GroupTarget],
              chunk_hashes: Sequence[bytes]) -> Hits:
        """The hit of ``groups`` (under the lock). One full-attention group, every lookup of a
        model of one layout (the scheduler's hot path), takes ``find_hits``' one-layout walk;
        a hybrid model's groups the rule of ``find_group_hits``."""
        if len(groups) == 1:
            group = groups[0]
            if group.full:
                return find_hits(self._index, model_name, group.layout, group.ranges,
                                 chunk_hashes)
        return find_group_hits(self._index, model_name, groups, chunk_hashes)

    def held(self, model_name: str, groups: Sequence[GroupTarget],
             chunk_hashes: Sequence[bytes]) -> int:
        """How many leading chunks ``lookup`` would find in resident pieces, touching nothing
        (no LRU move, no hit or lookup counted, no lock): to compare candidate layouts, and a
        peek without tiers."""
        with self._mutex:
            return self._find(model_name, groups, chunk_hashes).count

    def uncovered(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
                  chunk_hashes: Sequence[bytes]) -> list[list[HeadRange]]:
        """Per chunk, the ranges of ``ranges`` that resident pieces do not cover."""
        out: list[list[HeadRange]] = []
        with self._mutex:
            chunks_of = self._index.chunks.get
            for chunk_hash in chunk_hashes:
                pieces = chunks_of((model_name, layout, chunk_hash)) or []
                out.append([(lo, hi) for lo, hi in ranges
                            if not pieces or cover(pieces, lo, hi) is None])
        return out

    def layouts(self, model_name: str) -> list[str]:
        """The layouts of ``model_name`` that have resident pieces (a lookup by a client that
        names no layout tries these)."""
        with self._mutex:
            return [layout for (model, layout) in self._index.layout_chunks if model == model_name]

    def pairs(self) -> list[Pair]:
        """Every (model, layout) with resident pieces."""
        with self._mutex:
            return list(self._index.layout_chunks)

    def holders(self, chunk_hashes: Sequence[bytes], first_model: str,
                max_pairs: int) -> tuple[list[Holder], bool]:
        """Which (model, layout) pairs hold each of ``chunk_hashes`` in memory, touching nothing
        (``lmcache lookup --explain``): ``first_model``'s pairs first, at most ``max_pairs`` in
        all (True beside the finds when there were more). The pairs are looked through
        ``PAIRS_PER_HOLD`` at a time, the lock held for one batch only."""
        pairs = sorted(self.pairs(), key=lambda pair: pair[0] != first_model)
        found: list[Holder] = []
        for start in range(0, min(len(pairs), max_pairs), PAIRS_PER_HOLD):
            batch = pairs[start:min(start + PAIRS_PER_HOLD, max_pairs)]
            with self._mutex:
                found += find_holders(self._index, batch, chunk_hashes, MEMORY_TIER)
        return found, len(pairs) > max_pairs

    def model_tenants(self, model_name: str) -> tuple[int, dict[str, int]]:
        """``model_name``'s resident pieces, and how many of them each tenant tag stored."""
        with self._mutex:
            tenants = self._index.model_tenants.get(model_name)
            return (self._index.models.pieces.get(model_name, 0),
                    dict(tenants.pieces) if tenants is not None else {})

    # ------------------------------------------------------------------ locks

    def expire_locks(self) -> int:
        """Release every lock older than ``lock_ttl_s``; returns how many piece locks went."""
        with self._mutex:
            now = self._clock()
            expired = self._locks.expire(now)
            self._counters.locks_expired += expired
            self._retention.lapse(now)  # pins whose TTL ended: ordinary pieces again
            return expired

    def free_lookup_locks(self, lookup_id: str) -> int:
        """Release whatever ``lookup_id`` still locks (its chunks that were not retrieved)."""
        with self._mutex:
            return self._locks.release_all(lookup_id)

    def set_lock_readers(self, lookup_id: str, readers: int, shared: int = 1) -> bool:
        """Each lock ``lookup_id`` holds (per head range and chunk) goes with the ``readers``-th
        retrieve of it by each of the ``shared`` ranks reading that range (LMCache's
        ``num_kv_readers``; MLA's world size); called right after the lookup. False if it
        holds none."""
        with self._mutex:
            return self._locks.set_readers(lookup_id, readers, shared)

    def release_lookup_reads(self, lookup_id: str, chunk_hashes: Collection[bytes],
                             reads: int, heads: HeadRange | None = None) -> int:
        """Count ``reads`` reads of every range (or of ``heads`` only) of ``lookup_id``'s locks
        on the chunks ``chunk_hashes`` name, releasing those with none left to wait for
        (LMCache's ``free_lookup_locks`` over a range); how many piece locks went."""
        with self._mutex:
            return self._locks.release_chunks(lookup_id, chunk_hashes, reads, heads)

    # ------------------------------------------------------------------ store

    def begin_store(self, keys: Sequence[ChunkKey], nbytes: int,
                    retention: Retention = PLAIN, tenant: str = "") -> StorePlan:
        """Reserve pool bytes for each piece not yet held, evicting as needed.

        A key whose head range resident pieces already cover, or that is being written, counts as
        ``already_present`` (covering pieces get ``retention`` too, are touched as hits and never
        evicted for this store's room); keys no room can be found for count as ``skipped_full``
        (earlier keys, the prefix's head, get room first). Never raises for a full pool.
        ``retention``: the request's TTL, pin and priority (``retention``); ``tenant``: its
        cache_salt tenant (``keys.tenant_tag``), whose quota applies too."""
        if not self._pool.fits(nbytes):
            raise IncompatibleError(
                f"a chunk piece of {nbytes} bytes does not fit the pool's "
                f"{self._pool.max_alloc_bytes} bytes (raise server.pool_size)")
        plan = StorePlan(nbytes, [], retention=retention, tenant=tenant)
        with self._mutex:
            now = self._clock()
            if self._locks.due(now):
                self._counters.locks_expired += self._locks.expire(now)
            claimed = self._claim(keys, nbytes, plan)
            self._counters.stores += 1
            self._counters.store_skipped_full += plan.skipped_full
            self._counters.store_skipped_quota += plan.skipped_quota
        view = self._pool.view
        plan.writes = [(index, key, view(handle, nbytes))
                       for (index, key), handle in zip(claimed, plan.handles, strict=True)]
        return plan

    def _claim(self, keys: Sequence[ChunkKey], nbytes: int,
               plan: StorePlan) -> list[tuple[int, ChunkKey]]:
        """Claim the keys not held yet and give them pool bytes, into ``plan``; the (request
        index, key) pairs that got room."""
        new: list[tuple[int, ChunkKey]] = []
        present: list[Piece] = []  # the resident pieces holding keys already present
        writing = self._writing
        for position, key in enumerate(keys):
            covering = None if key in writing else self._index.covering(key)
            if covering is None and key not in writing:
                writing.claim(key)
                new.append((position, key))
                continue
            plan.already_present += 1
            present += covering or ()
        if not plan.retention.plain:  # the pieces it found get its retention too
            plan.pin_refused += self._retention.keep(present, plan.retention, self._clock())
        # The present pieces are part of what this store keeps: touched as a hit (the prefix's
        # head most recent) and held while room is made, so its evictions never take them.
        for piece in reversed(present):
            self._index.touch(piece)
            self._add_reader(piece)
        try:
            got = self._room(new, nbytes, plan)
        finally:
            for piece in present:
                self._release_reader(piece)
        for _, key in new:
            writing.unclaim(key)
        plan.skipped_full += len(new) - len(got) - plan.skipped_quota
        return got

    def _room(self, new: Sequence[tuple[int, ChunkKey]], nbytes: int,
              plan: StorePlan) -> list[tuple[int, ChunkKey]]:
        """``_claim``'s allocations, in request order until the pool is full (quotas skip keys)."""
        got: list[tuple[int, ChunkKey]] = []
        deadline = time.monotonic() + LANE_TIMEOUT_S  # the longest it waits for hashes, in all
        for position, key in new:
            while True:
                fits = self._quota_room(key.model_name, nbytes, plan.tenant)
                handle = self._allocate(nbytes, len(new) - len(got)) if fits else None
                if handle is not None or not fits or not self._await_hashes(deadline):
                    break  # (else again: checksums were recorded, the lock released meanwhile)
            if not fits:
                plan.skipped_quota += 1
                continue
            if handle is None:
                break
            self._writing.reserve(key, handle, nbytes, plan.tenant)
            plan.keys.append(key)
            plan.handles.append(handle)
            got.append((position, key))
        return got

    def _quota_room(self, model_name: str, nbytes: int, tenant: str = "") -> bool:
        """Whether a piece of ``model_name`` for ``tenant`` fits both their quotas (with the
        pieces being written, this request's and others', counted), evicting their own oldest
        pieces if that makes it fit; nothing is evicted when it cannot."""
        limits = eviction.quota_limits(self._index, self._writing, self._quotas, self._tenant_quotas,
                                       nbytes, model_name, tenant)
        if not limits:
            return True
        now = self._clock()
        victims = eviction.over_quotas(
            lambda: eviction_order(self._index, self._retention, now), now, limits)
        if victims is None:
            return False
        self._evict(victims)
        return True

    def _allocate(self, nbytes: int, wanted: int) -> int | None:
        """Pool bytes for one piece, evicting (pieces of any model) only what it needs."""
        handle = self._pool.allocate(nbytes)
        if handle is None:
            now = self._clock()
            order = eviction_order(self._index, self._retention, now)
            room = eviction.victims_for(self._index, self._pool, order, now, nbytes, wanted)
            self._evict(room.victims)
            if room.first_unit is not None:  # an extent: in the window emptied for it
                return self._pool.allocate_at(nbytes, room.first_unit)
            handle = self._pool.allocate(nbytes)
        return handle

    def finish_store(self, plan: StorePlan, ok: bool = True, *,
                     checksums_pending: bool = False) -> None:
        """Commit the plan's pieces (visible to lookups from now on), or free them when not ``ok``.
        ``checksums_pending``: their checksums are still being taken (from their slots, which
        they hold) and come by ``record_checksums``; until then each piece is held by its hash
        (``lifecycle``: being read) and its checksum is ``PENDING``, which whatever relies on it
        waits out (``wait_checksums``). Calling it twice for one plan does nothing the second
        time."""
        with self._mutex:
            if plan.done:
                return
            plan.done = True
            if ok:  # pins it refuses: counted next
                self._commit(plan.keys, plan.checksums, plan, checksums_pending)
            else:
                for key in plan.keys:
                    self._abort(key)
            self._counters.store_pin_refused += plan.pin_refused
            if not ok:
                return
            self._counters.stored_chunks += len(plan.keys)
            self._counters.stored_bytes += plan.nbytes * len(plan.keys)
        if plan.keys and self._on_stored is not None:  # the tiers' queues: outside the lock
            self._on_stored(plan.keys)

    def _commit(self, keys: Sequence[ChunkKey], checksums: Sequence[int],
                plan: StorePlan | None = None, pending: bool = False) -> None:
        """Make written pieces resident, tail first, with the store ``plan``'s retention (a tier
        load has none) and their ``checksums`` (none: 0; ``pending``: being taken, each piece
        held by its hash until ``record_checksums``)."""
        now, add = self._clock(), self._index.add
        retention = plan.retention if plan is not None else PLAIN
        sums = [PENDING] * len(keys) if pending else checksums or [0] * len(keys)
        for key, checksum in zip(reversed(keys), reversed(sums), strict=True):
            piece = self._writing.release(key)
            advance(piece, Event.COMMIT)
            piece.created, piece.checksum = now, checksum
            add(piece)
            if pending:
                assert plan is not None
                self._add_reader(piece)  # the hash reads its slot: not evicted nor reused
                plan.hashing.append(piece)
                self._hashing += 1
            if (plan is not None and not retention.plain
                    and not self._retention.apply(piece, retention, now, True)):
                plan.pin_refused += 1
        if pending and plan is not None:
            plan.hashing.reverse()  # in the order of ``keys``, as the digests come
        if self._events is not None and keys:
            self._events.stored(list(keys), MEMORY_TIER)

    def record_checksums(self, plan: StorePlan, digests: Sequence[int] | None) -> None:
        """The checksums of a store committed with ``checksums_pending``, one per piece, taken from
        their slots: each is kept on its piece and the hash's hold released (a piece dropped
        meanwhile is freed now), and whoever waits for them is woken. None: they could not be
        taken (the hash got stuck, or the server stopped first): the pieces are dropped
        (``checksums_abandoned``), never served as verified nor written to a tier without one.
        Calling it twice for one plan does nothing the second time."""
        with self._mutex:
            pieces, plan.hashing = plan.hashing, []
            if not pieces:
                return
            if digests is None:
                gone = [piece for piece in pieces if self._index.get(piece.key) is piece]
                for piece in gone:
                    self._drop(piece)  # freed below, by the hash's release
                self._counters.checksums_abandoned += len(pieces)
                if self._events is not None and gone:
                    self._events.removed([piece.key for piece in gone], MEMORY_TIER)
            for piece, digest in zip(pieces, digests or [ABANDONED] * len(pieces), strict=True):
                piece.checksum = digest
                self._release_reader(piece)
            self._hashing -= len(pieces)
            self._hashed.notify_all()

    def wait_checksums(self, pieces: Sequence[Piece], timeout_s: float = LANE_TIMEOUT_S) -> bool:
        """Wait until none of ``pieces`` (held by the caller) has its checksum ``PENDING``, for at
        most ``timeout_s``; whether none has. (A checksum given up is ``ABANDONED``.)"""
        with self._mutex:
            return self._hashed.wait_for(
                lambda: all(piece.checksum != PENDING for piece in pieces), timeout_s)

    def _await_hashes(self, deadline: float) -> bool:
        """A store found no room while pieces are held by their hash (unevictable until it is
        done, or dropped and freed only then): wait (the lock released) until some checksums
        are recorded, before ``deadline`` (monotonic); whether it is worth trying again."""
        if not self._hashing:
            return False
        left = deadline - time.monotonic()
        return left > 0 and self._hashed.wait(left)

    def _abort(self, key: ChunkKey) -> None:
        piece = self._writing.release(key)
        advance(piece, Event.ABORT)
        self._pool.free(piece.handle)

    # ------------------------------------------------------------------ retrieve

    def begin_retrieve(self, model_name: str, layout: str, heads: HeadRange,
                       chunk_hashes: Sequence[bytes], lookup_id: str = "") -> RetrievePlan:
        """For each chunk, the resident pieces covering ``heads``, held (a reader count) so
        nothing frees them mid-copy; chunks not covered are ``missing``."""
        plan = RetrievePlan(lookup_id, heads, [], [])
        lo, hi = heads
        view = self._pool.view
        with self._mutex:
            chunks_of = self._index.chunks.get
            for position, chunk_hash in enumerate(chunk_hashes):
                chunk = (model_name, layout, chunk_hash)
                pieces = chunks_of(chunk)
                covering = cover(pieces, lo, hi) if pieces else None
                if covering is None:
                    plan.missing.append(position)
                    continue
                for piece in covering:
                    self._add_reader(piece)
                plan.pieces.append(covering)
                plan.chunks.append(chunk)
                plan.found.append((position, [(view(p.handle, p.nbytes), p.key.head_lo,
                                               p.key.head_hi) for p in covering]))
            move = self._index.lru.move_to_end
            for covering in reversed(plan.pieces):
                for piece in covering:
                    move(piece.key)
            n = self._counters
            n.retrieves += 1
            n.retrieved_chunks += len(plan.found)
            n.retrieved_bytes += sum(p.nbytes for c in plan.pieces for p in c)
            n.retrieve_missing += len(plan.missing)
        return plan

    def finish_retrieve(self, plan: RetrievePlan, copied: int | None = None) -> None:
        """Release the plan's pieces and ``plan.lookup_id``'s locks of its head range on the
        chunks read. ``copied``: how many of ``plan.found`` (a prefix) were copied when a
        deadline cut the rest (counted late, not retrieved); None: all. Idempotent."""
        with self._mutex:
            if plan.done:
                return
            plan.done = True
            for covering in plan.pieces:
                for piece in covering:
                    self._release_reader(piece)
            if copied is not None and copied < len(plan.pieces):
                late = plan.pieces[copied:]
                n = self._counters
                n.retrieve_late_chunks += len(late)
                n.retrieved_chunks -= len(late)
                n.retrieved_bytes -= sum(p.nbytes for c in late for p in c)
            if plan.lookup_id:
                self._locks.release_read(plan.lookup_id, plan.heads, plan.chunks)

    def retire_corrupt(self, plan: RetrievePlan, bad_at: Sequence[int],
                       corrupt: Sequence[Piece], unchecked: int = 0) -> list[int]:
        """The integrity guard found the ``corrupt`` pieces among those of ``plan.found`` at
        positions ``bad_at`` (and ``unchecked`` pieces there it could not check: their checksum
        was not taken in time): those chunks move to ``plan.missing`` (their pieces released) and
        the corrupt pieces are dropped; the others count as verified. The request indexes that
        moved."""
        with self._mutex:
            n = self._counters
            n.integrity_verified_chunks += (sum(len(pieces) for pieces in plan.pieces)
                                            - len(corrupt) - unchecked)
            if not bad_at:
                return []
            moved = [plan.found[at][0] for at in bad_at]
            for at in sorted(bad_at, reverse=True):
                pieces = plan.pieces.pop(at)
                plan.found.pop(at)
                for piece in pieces:
                    self._release_reader(piece)
                n.retrieved_chunks -= 1
                n.retrieved_bytes -= sum(piece.nbytes for piece in pieces)
                n.retrieve_missing += 1
            plan.missing = sorted(plan.missing + moved)
            self._condemn(corrupt)
        return moved

    # ------------------------------------------------------------------ readers and drops

    def _add_reader(self, piece: Piece) -> None:
        advance(piece, Event.READ)
        piece.readers += 1

    def _release_reader(self, piece: Piece) -> None:
        """A reader of ``piece`` is done; the last one frees a dropped piece."""
        piece.readers -= 1
        if piece.state is State.DROPPED and not piece.readers:
            advance(piece, Event.LAST_READ_DONE)
            self._pool.free(piece.handle)
        else:
            advance(piece, Event.READ_DONE)

    def _drop(self, piece: Piece) -> None:
        """Take ``piece`` out of the index; its bytes are freed now, or by its last reader
        (``_release_reader``) when one is still copying out of it."""
        self._index.remove(piece)
        self._retention.forget(piece)
        if piece.readers:
            advance(piece, Event.DROP_READ)
        else:
            advance(piece, Event.DROP)
            self._pool.free(piece.handle)

    def _evict(self, victims: Sequence[Piece]) -> None:
        """Every eviction passes here (under the lock: no I/O)."""
        for piece in victims:
            self._drop(piece)
            self._counters.evictions += 1
            if self._on_evicted is not None:
                self._on_evicted(piece.key)
        if self._events is not None and victims:
            self._events.removed([piece.key for piece in victims], MEMORY_TIER)

    def condemn(self, pieces: Sequence[Piece]) -> int:
        """Drop ``pieces`` found corrupt (those still indexed), counted as integrity failures;
        how many were."""
        with self._mutex:
            return self._condemn(pieces)

    def _condemn(self, pieces: Sequence[Piece]) -> int:
        dropped: list[ChunkKey] = []
        for piece in dict.fromkeys(pieces):  # a piece serving two ranges is dropped once
            if self._index.get(piece.key) is not piece:
                continue  # gone already (another check dropped it)
            self._drop(piece)  # one being read is freed by its last reader
            dropped.append(piece.key)
        self._counters.integrity_failures += len(dropped)
        if self._events is not None and dropped:
            self._events.removed(dropped, MEMORY_TIER)
        return len(dropped)

    def count_late_store(self, chunks: int) -> None:
        """A store of ``chunks`` came past its ``copy_by_ns`` and was not copied."""
        with self._mutex:
            self._counters.stores += 1
            self._counters.store_late += chunks

    def count_verified(self, pieces: int) -> None:
        """``pieces`` were checked against their checksums and found intact."""
        with self._mutex:
            self._counters.integrity_verified_chunks += pieces

    # ------------------------------------------------------------------ for the lower tiers
    # ``tiered.TieredStorage`` loads pieces into memory through these: room is reserved under the
    # lock (as a store does), filled outside it, and committed under it again.

    def reserve_loads(self, items: Sequence[tuple[ChunkKey, int]]
                      ) -> list[tuple[ChunkKey, int, int]]:
        """Pool bytes for the ``(key, nbytes)`` pieces neither resident nor being written, in
        order as far as the pool allows (evicting as a store does): ``(key, handle, nbytes)``.
        They are being written until ``commit_loaded``."""
        out: list[tuple[ChunkKey, int, int]] = []
        with self._mutex:
            for key, nbytes in items:
                if key in self._writing or key in self._index.lru or not self._pool.fits(nbytes):
                    continue
                # Loaded pieces have no tenant (tier records carry none; ``commit_loaded``
                # leaves them untagged): only the model's quota applies.
                if not self._quota_room(key.model_name, nbytes):
                    continue
                handle = self._allocate(nbytes, 1)
                if handle is None:
                    break
                self._writing.reserve(key, handle, nbytes)
                out.append((key, handle, nbytes))
        return out

    def commit_loaded(self, items: Sequence[tuple[ChunkKey, int, int]], got: Sequence[int],
                      checksums: Sequence[int] = ()) -> list[ChunkKey]:
        """Make the reserved pieces whose load got all their bytes resident, with their verified
        ``checksums`` (the records' ``payload_xxh3``); free the others."""
        with self._mutex:
            sums = checksums or [0] * len(items)
            whole = [(item[0], s) for item, n, s in zip(items, got, sums, strict=True)
                     if n == item[2]]
            for (key, _handle, nbytes), n in zip(items, got, strict=True):
                if n != nbytes:
                    self._abort(key)
            self._commit([key for key, _ in whole], [s for _, s in whole])
        return [key for key, _ in whole]

    def coldest(self, limit: int, ahead_bytes: int,
                saved: Callable[[ChunkKey], bool]) -> list[ChunkKey]:
        """Up to ``limit`` pieces not ``saved`` among the next in line for eviction, holding
        ``ahead_bytes - free pool bytes``: eviction's own order (``retention.eviction_order``:
        LRU, unless TTLs, pins or priorities reorder it), past pinned pieces, which eviction never
        takes (saving them ahead would spend disk writes on nothing). ``saved`` runs under the
        lock: a dict lookup."""
        out: list[ChunkKey] = []
        with self._mutex:
            at_risk = ahead_bytes - self._pool.bytes_free
            if at_risk <= 0:  # nothing due: skip the order (with hints, a sort of the index)
                return out
            now = self._clock()
            for piece in eviction_order(self._index, self._retention, now):
                if at_risk <= 0 or len(out) >= limit:
                    break
                if pinned_now(piece, now):
                    continue
                at_risk -= piece.nbytes
                if not saved(piece.key):
                    out.append(piece.key)
        return out

    def memory(self, handle: int, nbytes: int) -> memoryview:
        """A pool allocation's bytes as a memoryview (no copy)."""
        return self._pool.view(handle, nbytes).numpy().data

    @contextmanager
    def reading(self, key: ChunkKey) -> Iterator[tuple[Piece, memoryview] | None]:
        """A resident piece and its bytes, held (not evictable) for the ``with`` block; None if
        gone. (The tiers' writers take bytes through it, checked against that piece's checksum.)"""
        with self._mutex:
            piece = self._index.get(key)
            if piece is not None:
                self._add_reader(piece)
        if piece is None:
            yield None
            return
        try:
            yield piece, self.memory(piece.handle, piece.nbytes)
        finally:
            with self._mutex:
                self._release_reader(piece)

    # ------------------------------------------------------------------ pins (lmcache pin/unpin)

    def pin(self, model_name: str, groups: Sequence[GroupTarget],
            chunk_hashes: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Pin the pieces a hit of the prefix needs (``lookup``'s: of a hybrid model every
        group's, of the windows only their last chunks), until unpinned or for ``ttl_s``; how
        many pieces are pinned now. All or none: PinLimitError, pinning nothing, when that
        would pass ``max_pinned_bytes``."""
        with self._mutex:
            now = self._clock()
            pieces = self._find(model_name, groups, chunk_hashes).pieces()
            book = self._retention
            more = sum(piece.nbytes for piece in pieces if not piece.pinned)
            if book.pinned_bytes + more > book.max_pinned_bytes:
                raise PinLimitError(
                    f"pinning {len(pieces)} piece(s) ({more} more bytes) would hold "
                    f"{book.pinned_bytes + more} bytes pinned, over server.max_pinned "
                    f"({book.max_pinned_bytes}); unpin others or raise it")
            hint = Retention(ttl_s=ttl_s, pin=True)
            for piece in pieces:
                # The pin's TTL replaces the piece's (none: pinned until unpinned, whatever TTL
                # it had); its priority stays (the hint has none).
                book.apply(piece, hint, now, fresh=False, replace_ttl=ttl_s is not None)
        return len(pieces)

    def unpin(self, model_name: str, groups: Sequence[GroupTarget],
              chunk_hashes: Sequence[bytes]) -> int:
        """Unpin the pieces of the named chunks; how many were pinned. Of one full-attention
        group, the pieces covering its ranges of the leading chunks held; of a hybrid model's
        groups, every group's pieces of the named chunks, not only a leading run (a pinned
        window's earlier chunks may be gone)."""
        with self._mutex:
            if len(groups) == 1 and groups[0].full:
                pieces = self._find(model_name, groups, chunk_hashes).pieces()
            else:
                chunks_of = self._index.chunks.get
                pieces = [piece for group in groups for chunk_hash in chunk_hashes
                          for piece in chunks_of((model_name, group.layout, chunk_hash), ())]
            return sum(self._retention.unpin(piece) for piece in pieces)

    # ------------------------------------------------------------------ admin

    def __len__(self) -> int:
        return len(self._index)

    def clear(self, force: bool = False) -> tuple[int, int]:
        """Drop resident pieces; returns ``(removed, kept)``. Unforced, locked and pinned pieces
        stay; forced, they go with their locks and pins. Pieces being read always stay, but not
        for their hash alone: one whose checksum is being taken goes, freed once it is taken."""
        removed = kept = 0
        dropped: list[ChunkKey] = []
        with self._mutex:
            for piece in list(self._index):
                read = piece.readers - (piece.checksum == PENDING)  # readers besides its hash
                if read or ((piece.locks or piece.pinned) and not force):
                    kept += 1
                else:
                    self._drop(piece)
                    dropped.append(piece.key)
                    removed += 1
            if self._events is not None and dropped:
                self._events.removed(dropped, MEMORY_TIER)
            if force:
                self._locks.purge(self._index.lru)
        return removed, kept

    def snapshot(self) -> EngineStats:
        """The store's counters and gauges, read at one moment (SERVER_INFO's engine section)."""
        with self._mutex:
            return self._snapshot()

    def _snapshot(self) -> EngineStats:
        pool = self._pool
        return self._counters.copy(
            lookup_hit_tokens=self._counters.lookup_hit_chunks * self.chunk_size,
            chunks=len(self._index), bytes_used=self._index.nbytes,
            pool_capacity_bytes=pool.nbytes, pool_bytes_allocated=pool.bytes_allocated,
            pool_slabs=pool.num_slabs, pool_slabs_free=pool.free_slabs,
            pool_pinned_bytes=pool.pinned_bytes, locks_held=self._locks.held_count(),
            pinned_pieces=len(self._retention.pinned), pinned_bytes=self._retention.pinned_bytes,
            checksums_pending=self._hashing)

    def inspect(self) -> Inspection:
        """The store's state, read at one moment (``Inspection``): for tests and debugging, never
        on a request's path (it copies every piece's fields)."""
        with self._mutex:
            index, writing, locks = self._index, self._writing, self._locks
            return Inspection(
                pieces={key: PieceView.of(piece) for key, piece in index.lru.items()},
                writing={key: None if piece is None else PieceView.of(piece)
                         for key, piece in writing.pieces.items()},
                locks={lookup_id: locks.keys_of(lookup_id) for lookup_id in locks.sets},
                lock_deadlines=locks.deadlines(), models=index.model_counts(),
                tenants=index.tenant_counts(), writing_models=dict(writing.models.bytes),
                writing_tenants=dict(writing.tenants.bytes), hinted=self._retention.special,
                stats=self._snapshot())

    def model_counts(self) -> dict[str, tuple[int, int, list[str]]]:
        """Per model: (pieces, bytes, its layouts held, sorted)."""
        with self._mutex:
            counts = self._index.model_counts()
            layouts: dict[str, list[str]] = {}
            for model, layout in self._index.layout_chunks:
                layouts.setdefault(model, []).append(layout)
        return {model: (pieces, nbytes, sorted(layouts.get(model, [])))
                for model, (pieces, nbytes) in counts.items()}

    def tenant_counts(self) -> dict[str, tuple[int, int]]:
        """Per tenant tag: (pieces, bytes)."""
        with self._mutex:
            return self._index.tenant_counts()

    def rows(self, model_name: str | None = None) -> list[PieceRow]:
        """Every resident piece (of ``model_name`` if given), unsorted."""
        with self._mutex:
            now = self._clock()
            return [PieceRow(piece.key.chunk_hash, piece.key.model_name, piece.key.layout,
                             piece.key.head_lo, piece.key.head_hi, piece.nbytes,
                             now - piece.created, piece.locks,
                             piece.hits, piece.pinned,
                             None if piece.expires == math.inf else max(0.0, piece.expires - now),
                             piece.priority)
                    for piece in self._index
                    if model_name is None or piece.key.model_name == model_name]
