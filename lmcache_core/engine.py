"""CacheEngine: the cache's index and policy over the L1 memory pool (no sockets, no KV layouts).

Callers copy bytes in and out of slot views; the engine decides which slot holds which chunk, who
may see it and when it may go. One lock guards everything and is held only for dict work; the
copies run outside it, between ``begin_*`` and ``finish_*``. An entry's life:

* **writing**: ``begin_store`` reserved a slot. Invisible to lookups and retrieves, never evicted,
  and a second store of the same key counts as already present.
* **resident**: ``finish_store(ok=True)`` committed it; lookups see it from that moment.
* **locked**: a lookup holds it for a coming retrieve (one lock per lookup id, with a TTL). Locked
  entries are never evicted, so all ranks of a reported prefix stay until the retrieve.
* **being read**: ``begin_retrieve`` pinned it (a reader count) until ``finish_retrieve``; neither
  eviction nor ``clear(force=True)`` takes it mid-copy.

LRU order: hits are touched (and new chunks committed) from the last chunk to the first, so a
prefix's head is the most recently used and eviction eats prefixes from the tail, which keeps what
remains of a prefix usable.

Lower tiers (optional ``disk``/``remote``) live in ``storage.tiered.TieredStorage``: committed
stores are queued for them (write-behind, never blocking); ``lookup_tiers`` loads the rest of a
prefix from them into reserved slots outside the lock and commits and locks it before answering. The
engine lends it a few index operations (the "index operations for the lower tiers" section). Without
tiers the engine holds no ``TieredStorage`` and every path above is unchanged.

The in-process async lookup (``async_lookup_and_prefetch``, ``cleanup_memory_objs``, the scheduler's
side being ``lmcache_core.lookup_client``) lives in ``async_lookup.AsyncLookups``; ``close`` shuts
down its prefetch threads.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache_core.async_lookup import AsyncLookups
from lmcache_core.errors import IncompatibleError, ProtocolError
from lmcache_core.keys import ChunkKey
from lmcache_core.protocol.messages import ChunkInfo
from lmcache_core.storage.pool import MemoryPool
from lmcache_core.storage.tiered import TieredStorage

if TYPE_CHECKING:
    import torch

    from lmcache_core.events import KVEventSink
    from lmcache_core.storage.disk import DiskTier
    from lmcache_core.storage.remote import RemoteTier

SORTS = ("age", "hits", "size", "key")
_Key = tuple[str, int, int, bytes]  # a ChunkKey is one; lookup probes with plain tuples
MEMORY_TIER = "memory"


class _Entry:
    """One resident chunk: where it lives and who holds it."""

    __slots__ = ("created", "hits", "key", "locks", "nbytes", "readers", "slot")

    def __init__(self, key: ChunkKey, slot: int, nbytes: int, created: float) -> None:
        self.key = key
        self.slot = slot
        self.nbytes = nbytes
        self.created = created
        self.locks = 0  # lookup ids holding a lock on it
        self.readers = 0  # retrieves copying out of it right now
        self.hits = 0


class _LockSet:
    """The entries one lookup id has locked, and the generation that may expire them."""

    __slots__ = ("entries", "seq")

    def __init__(self, entries: dict[ChunkKey, _Entry], seq: int) -> None:
        self.entries = entries
        self.seq = seq


@dataclass(slots=True)
class _Counters:
    """The monotonically growing counters ``stats()`` reports (names as in ``ServerStats``)."""

    lookups: int = 0
    lookup_hit_chunks: int = 0
    lookup_miss_chunks: int = 0
    stores: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    store_skipped_full: int = 0
    retrieves: int = 0
    retrieved_chunks: int = 0
    retrieved_bytes: int = 0
    retrieve_missing: int = 0
    retrieve_late_chunks: int = 0
    evictions: int = 0
    locks_expired: int = 0


@dataclass(slots=True, eq=False)
class StorePlan:
    """What ``begin_store`` reserved: write into ``writes`` (index, key, slot view), then finish.

    ``stored``/``already_present``/``skipped_full`` fill a ``StoreReply`` directly.
    """

    nbytes: int
    writes: list[tuple[int, ChunkKey, torch.Tensor]]
    already_present: int = 0
    skipped_full: int = 0
    keys: list[ChunkKey] = field(default_factory=list, repr=False)
    slots: list[int] = field(default_factory=list, repr=False)
    done: bool = False

    @property
    def stored(self) -> int:
        return len(self.writes)


@dataclass(slots=True, eq=False)
class RetrievePlan:
    """What ``begin_retrieve`` found: copy out of ``found`` (index, key, slot view), then finish.

    ``missing`` are request indexes that are not resident (fills ``RetrieveReply.missing``).
    """

    lookup_id: str
    found: list[tuple[int, ChunkKey, torch.Tensor]]
    missing: list[int]
    entries: list[_Entry] = field(default_factory=list, repr=False)
    done: bool = False

    @property
    def retrieved(self) -> int:
        return len(self.found)


class CacheEngine:
    """Index, locks and LRU eviction of chunks in one ``MemoryPool``; thread-safe."""

    def __init__(self, pool: MemoryPool, chunk_size: int, lock_ttl_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, *, disk: DiskTier | None = None,
                 remote: RemoteTier | None = None, events: KVEventSink | None = None) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if lock_ttl_s <= 0:
            raise ValueError(f"lock_ttl_s must be positive, got {lock_ttl_s}")
        self.pool = pool
        self.chunk_size = chunk_size
        self.lock_ttl_s = lock_ttl_s
        self._clock = clock
        self._mutex = threading.Lock()
        # Resident entries in LRU order (front = least recently used). Keys are ChunkKeys; a plain
        # 4-tuple finds the same entry, which is what lets lookup skip building ChunkKeys.
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        self._writing: dict[ChunkKey, int] = {}  # key -> reserved slot, while a store copies in
        self._locks: dict[str, _LockSet] = {}
        self._expiry: list[tuple[float, int, str]] = []  # min-heap of (deadline, seq, lookup_id)
        self._seq = itertools.count()
        self._bytes_used = 0
        self._n = _Counters()
        # Told of every chunk that enters or leaves memory, under the lock (KV events for routers;
        # None: nothing is reported). The tiers report theirs through the same sink.
        self.events = events
        # Lower tiers (None: memory only, and no code path below touches them).
        self._tiers = (TieredStorage(self, disk, remote)
                       if disk is not None or remote is not None else None)
        self._async = AsyncLookups(self)

    # ------------------------------------------------------------------ lookup

    def lookup(self, model_name: str, world_size: int, chunk_hashes: Sequence[bytes],
               lookup_id: str, lock: bool = True, ranks: Sequence[int] | None = None) -> int:
        """How many leading chunks every rank ``0..world_size-1`` holds; lock them when ``lock``.

        ``ranks`` narrows the check to those ranks (an in-process engine holds only its own rank).

        A locking re-lookup under the same ``lookup_id`` first drops that id's previous locks, so a
        scheduler that asks again never doubles its hold. Hits are LRU-touched and counted.
        """
        if world_size < 1:
            raise ProtocolError(f"world_size must be at least 1, got {world_size}")
        if ranks is None:
            ranks = range(world_size)
        with self._mutex:
            chunks = self._lookup_locked(model_name, world_size, chunk_hashes, lookup_id, lock, ranks)
            total = len(chunk_hashes)
            if chunks < total:
                self._lookup_miss(model_name, world_size, chunk_hashes, chunks)
            n = self._n
            n.lookups += 1
            n.lookup_hit_chunks += chunks
            n.lookup_miss_chunks += total - chunks
        return chunks

    def _lookup_locked(self, model_name: str, world_size: int, chunk_hashes: Sequence[bytes],
                       lookup_id: str, lock: bool, ranks: Sequence[int]) -> int:
        """``lookup``'s work under the lock, without its counters (a tiered re-lookup uses it too)."""
        get = self._entries.get
        hit: list[_Entry] = []
        append = hit.append
        now = self._clock()
        if self._expiry and self._expiry[0][0] <= now:
            self._expire_due(now)
        if lock and lookup_id in self._locks:
            self._release_all(lookup_id)
        chunks = 0
        for chunk_hash in chunk_hashes:
            for rank in ranks:
                entry = get((model_name, world_size, rank, chunk_hash))
                if entry is None:
                    break
                append(entry)
            else:
                chunks += 1
                continue
            break
        del hit[chunks * len(ranks):]
        if hit:
            self._touch_hits(hit, lookup_id if lock else None, now)
        return chunks

    def _touch_hits(self, hit: list[_Entry], lookup_id: str | None, now: float) -> None:
        """LRU-touch and count the hits (tail first); lock them for ``lookup_id`` if given."""
        move = self._entries.move_to_end
        if lookup_id is None:
            for entry in reversed(hit):
                move(entry.key)
                entry.hits += 1
            return
        held: dict[ChunkKey, _Entry] = {}
        for entry in reversed(hit):
            move(entry.key)
            entry.hits += 1
            entry.locks += 1
            held[entry.key] = entry
        if len(held) != len(hit):  # a hash repeated in the request: one lock per key, not two
            for entry in hit:
                entry.locks -= 1
            for entry in held.values():
                entry.locks += 1
        self._hold(lookup_id, held, now)

    def _lookup_miss(self, model_name: str, world_size: int, chunk_hashes: Sequence[bytes],
                     first_missing: int) -> None:
        """Where every lookup miss passes (under the lock, so nothing slow may happen here).

        Lower tiers are not consulted here: ``lookup`` stays memory-only and fast; a caller that may
        wait (the server's lookup route when a tier is configured) calls ``lookup_tiers``, which
        loads from disk and Redis outside the lock.
        """

    # ------------------------------------------------------------------ locks

    def _hold(self, lookup_id: str, held: dict[ChunkKey, _Entry], now: float) -> None:
        seq = next(self._seq)
        self._locks[lookup_id] = _LockSet(held, seq)
        heapq.heappush(self._expiry, (now + self.lock_ttl_s, seq, lookup_id))
        if len(self._expiry) > 2 * len(self._locks) + 64:
            self._compact_expiry()

    def _compact_expiry(self) -> None:
        """Drop heap items of lock sets already released, so the heap tracks live locks only."""
        live = {lookup_id: ls.seq for lookup_id, ls in self._locks.items()}
        self._expiry = [item for item in self._expiry if live.get(item[2]) == item[1]]
        heapq.heapify(self._expiry)

    def _release_all(self, lookup_id: str) -> int:
        held = self._locks.pop(lookup_id, None)
        if held is None:
            return 0
        for entry in held.entries.values():
            entry.locks -= 1
        return len(held.entries)

    def _expire_due(self, now: float) -> int:
        expiry = self._expiry
        expired = 0
        while expiry and expiry[0][0] <= now:
            _, seq, lookup_id = heapq.heappop(expiry)
            held = self._locks.get(lookup_id)
            if held is not None and held.seq == seq:
                expired += self._release_all(lookup_id)
        self._n.locks_expired += expired
        return expired

    def expire_locks(self) -> int:
        """Release every lock older than ``lock_ttl_s``; returns how many key locks went."""
        with self._mutex:
            return self._expire_due(self._clock())

    def free_lookup_locks(self, lookup_id: str) -> int:
        """Release whatever ``lookup_id`` still locks (its chunks that were not retrieved)."""
        with self._mutex:
            return self._release_all(lookup_id)

    def end_session(self, lookup_id: str) -> int:
        """A request is over: release its remaining locks (unlike LMCache, which keeps them)."""
        return self.free_lookup_locks(lookup_id)

    # ------------------------------------------------------------------ store

    def begin_store(self, keys: Sequence[ChunkKey], nbytes: int) -> StorePlan:
        """Reserve a slot for each key not yet present, evicting LRU entries when the pool is full.

        Keys resident or being written count as ``already_present``; keys no slot can be found for
        count as ``skipped_full`` (earlier keys, the prefix's head, get slots first). Never raises
        for a full pool: the caller reports what was stored and vLLM recomputes the rest.
        """
        pool = self.pool
        if not 0 < nbytes <= pool.slot_bytes:
            raise IncompatibleError(
                f"a chunk of {nbytes} bytes does not fit the pool's {pool.slot_bytes}-byte slots")
        plan = StorePlan(nbytes, [])
        with self._mutex:
            now = self._clock()
            if self._expiry and self._expiry[0][0] <= now:
                self._expire_due(now)
            new = self._claim_slots(keys, plan)
            self._n.stores += 1
            self._n.store_skipped_full += plan.skipped_full
        view = pool.view
        plan.writes = [(index, key, view(slot, nbytes))
                      for (index, key), slot in zip(new, plan.slots, strict=True)]
        return plan

    def _claim_slots(self, keys: Sequence[ChunkKey], plan: StorePlan) -> list[tuple[int, ChunkKey]]:
        """Under the lock: claim the keys not yet present and give them slots (evicting LRU
        entries as needed), into ``plan``; the (index, key) pairs that got one."""
        new = self._claim_new(keys, plan)
        shortfall = len(new) - self.pool.num_free
        if shortfall > 0:
            self._make_room(shortfall)
        self._reserve(new, plan)
        return new

    def _claim_new(self, keys: Sequence[ChunkKey], plan: StorePlan) -> list[tuple[int, ChunkKey]]:
        """The (index, key) pairs to write; marks them as being written (slot -1 for now)."""
        entries, writing = self._entries, self._writing
        new: list[tuple[int, ChunkKey]] = []
        for index, key in enumerate(keys):
            if key in writing or key in entries:
                plan.already_present += 1
            else:
                writing[key] = -1
                new.append((index, key))
        return new

    def _reserve(self, new: list[tuple[int, ChunkKey]], plan: StorePlan) -> None:
        """Give each claimed key a slot, in request order; unclaim the ones that got none."""
        allocate, writing = self.pool.allocate, self._writing
        for count, (_, key) in enumerate(new):
            slot = allocate()
            if slot is None:
                for _, rest in new[count:]:
                    del writing[rest]
                plan.skipped_full = len(new) - count
                del new[count:]
                return
            writing[key] = slot
            plan.keys.append(key)
            plan.slots.append(slot)

    def finish_store(self, plan: StorePlan, ok: bool = True) -> None:
        """Commit the plan's chunks (visible to lookups from now on), or free them when not ``ok``.

        Calling it twice for one plan does nothing the second time.
        """
        with self._mutex:
            if plan.done:
                return
            plan.done = True
            writing, pool = self._writing, self.pool
            if not ok:
                for key, slot in zip(plan.keys, plan.slots, strict=True):
                    del writing[key]
                    pool.free(slot)
                return
            now, entries, nbytes = self._clock(), self._entries, plan.nbytes
            for key, slot in zip(reversed(plan.keys), reversed(plan.slots), strict=True):
                del writing[key]
                entries[key] = _Entry(key, slot, nbytes, now)
            if self.events is not None and plan.keys:
                self.events.stored(plan.keys, MEMORY_TIER)
            self._bytes_used += nbytes * len(plan.keys)
            self._n.stored_chunks += len(plan.keys)
            self._n.stored_bytes += nbytes * len(plan.keys)
        if plan.keys and self._tiers is not None:
            self._tiers.stored(plan.keys)

    # ------------------------------------------------------------------ eviction

    def _make_room(self, count: int) -> int:
        """Evict up to ``count`` LRU entries that are neither locked nor being read; one pass."""
        victims: list[_Entry] = []
        for entry in self._entries.values():
            if not entry.locks and not entry.readers:
                victims.append(entry)
                if len(victims) >= count:
                    break
        for entry in victims:
            self._evict_one(entry)
        return len(victims)

    def _evict_one(self, entry: _Entry) -> None:
        """Every eviction passes here (under the lock, so no I/O; the tiers count what they had
        not saved, ``TieredStorage.evicted``)."""
        self._drop(entry)
        self._n.evictions += 1
        if self.events is not None:
            self.events.removed((entry.key,), MEMORY_TIER)
        if self._tiers is not None:
            self._tiers.evicted(entry.key)

    def _drop(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        self.pool.free(entry.slot)
        self._bytes_used -= entry.nbytes

    # ------------------------------------------------------------------ retrieve

    def begin_retrieve(self, keys: Sequence[ChunkKey], lookup_id: str = "") -> RetrievePlan:
        """Find the resident keys and pin them (a reader count) so nothing frees them mid-copy."""
        plan = RetrievePlan(lookup_id, [], [])
        found, missing = plan.entries, plan.missing
        indexes: list[int] = []
        get = self._entries.get
        with self._mutex:
            for index, key in enumerate(keys):
                entry = get(key)
                if entry is None:
                    missing.append(index)
                else:
                    entry.readers += 1
                    found.append(entry)
                    indexes.append(index)
            move = self._entries.move_to_end
            for entry in reversed(found):
                move(entry.key)
            n = self._n
            n.retrieves += 1
            n.retrieved_chunks += len(found)
            n.retrieved_bytes += sum(entry.nbytes for entry in found)
            n.retrieve_missing += len(missing)
        view = self.pool.view
        plan.found = [(index, entry.key, view(entry.slot, entry.nbytes))
                      for index, entry in zip(indexes, found, strict=True)]
        return plan

    def finish_retrieve(self, plan: RetrievePlan, copied: int | None = None) -> None:
        """Unpin the plan's entries and release ``plan.lookup_id``'s lock on exactly those keys.

        ``copied``: how many of ``plan.found`` (a prefix) were copied, when a deadline cut the
        rest (counted late, and not as retrieved); None: all of them.

        The retrieve consumed the lookup's lock for this rank; the other ranks' keys stay locked
        until their own retrieves. Calling it twice for one plan does nothing the second time.
        """
        with self._mutex:
            if plan.done:
                return
            plan.done = True
            for entry in plan.entries:
                entry.readers -= 1
            if copied is not None and copied < len(plan.entries):
                late = plan.entries[copied:]
                n = self._n
                n.retrieve_late_chunks += len(late)
                n.retrieved_chunks -= len(late)
                n.retrieved_bytes -= sum(entry.nbytes for entry in late)
            held = self._locks.get(plan.lookup_id)
            if held is None:
                return
            for entry in plan.entries:
                locked = held.entries.pop(entry.key, None)
                if locked is not None:
                    locked.locks -= 1
            if not held.entries:
                del self._locks[plan.lookup_id]

    # ------------------------------------------------------------------ lower tiers (disk, remote)

    @property
    def has_tiers(self) -> bool:
        """Whether a disk or remote tier is attached (lookups then go through ``lookup_tiers``)."""
        return self._tiers is not None

    @property
    def disk(self) -> DiskTier | None:
        return self._tiers.disk if self._tiers is not None else None

    @property
    def remote(self) -> RemoteTier | None:
        return self._tiers.remote if self._tiers is not None else None

    def lookup_tiers(self, model_name: str, world_size: int, chunk_hashes: Sequence[bytes],
                     lookup_id: str, lock: bool = True, ranks: Sequence[int] | None = None,
                     timeout_s: float = 1.0) -> int:
        """``lookup``, then bring the rest of the prefix from disk and Redis into memory.

        Blocks for at most about ``timeout_s``. The chunks memory lacks right after the hits are
        found in the disk index (no I/O) or asked of Redis in one pipelined round trip; the longest
        prefix available for every rank gets pool slots (evicting as a store would), is read in
        (disk here, Redis on the remote tier's threads at the same time) and checksummed, then
        committed; a final locked re-lookup counts and locks what is resident. So a reported hit
        is always in memory and locked, exactly as after a plain ``lookup``; a load that misses
        the deadline is not counted now and lands in memory (unlocked) when it completes.
        Without tiers it is ``lookup``. (The work: ``TieredStorage.lookup``.)
        """
        if self._tiers is None:
            return self.lookup(model_name, world_size, chunk_hashes, lookup_id, lock, ranks)
        return self._tiers.lookup(model_name, world_size, chunk_hashes, lookup_id, lock, ranks,
                                  timeout_s)

    # ------------------------------------------------------------------ index operations for the lower tiers
    # Used by storage/tiered.py only. Tier I/O never runs under ``_mutex``: a tiered lookup reserves
    # slots under it (as a store does), loads into them outside it, and commits under it again.

    def _not_resident(self, model_name: str, world_size: int, chunk_hashes: Sequence[bytes],
                      ranks: Sequence[int]) -> list[list[ChunkKey]]:
        """Per chunk, the keys of ``ranks`` neither resident nor being written (at most a pool's
        worth of keys: more could not be loaded at once anyway)."""
        budget = self.pool.num_slots
        out: list[list[ChunkKey]] = []
        entries, writing = self._entries, self._writing
        with self._mutex:
            for chunk_hash in chunk_hashes:
                missing = [ChunkKey(model_name, world_size, rank, chunk_hash) for rank in ranks
                           if (model_name, world_size, rank, chunk_hash) not in entries
                           and ChunkKey(model_name, world_size, rank, chunk_hash) not in writing]
                budget -= len(missing)
                if budget < 0:
                    break
                out.append(missing)
        return out

    def _reserve_slots(self, keys: Sequence[ChunkKey]) -> tuple[list[ChunkKey], list[int]]:
        """Slots for the ``keys`` neither resident nor being written, in order as far as the pool
        allows (evicting as a store does): ``(keys, slots)``. Those keys count as being written
        until ``_commit_loaded``."""
        plan = StorePlan(self.pool.slot_bytes, [])
        with self._mutex:
            self._claim_slots(keys, plan)
        return plan.keys, plan.slots

    def _commit_loaded(self, items: Sequence[tuple[ChunkKey, int, int]],
                       got: Sequence[int]) -> list[ChunkKey]:
        """Make the ``(key, slot, nbytes)`` chunks whose load got all ``nbytes`` resident (tail
        first, as a store's), free the slots of the others; the keys made resident."""
        loaded: list[ChunkKey] = []
        with self._mutex:
            now, entries, writing, pool = self._clock(), self._entries, self._writing, self.pool
            for (key, slot, nbytes), n in zip(reversed(items), reversed(got), strict=True):
                del writing[key]
                if n == nbytes:
                    entries[key] = _Entry(key, slot, nbytes, now)
                    self._bytes_used += nbytes
                    loaded.append(key)
                else:
                    pool.free(slot)
            if self.events is not None and loaded:
                self.events.stored(loaded[::-1], MEMORY_TIER)  # (committed tail first)
        return loaded

    def _relookup(self, model_name: str, world_size: int, chunk_hashes: Sequence[bytes],
                  lookup_id: str, lock: bool, ranks: Sequence[int], hits: int) -> int:
        """``lookup`` again after the tiers loaded chunks, counting those found since its first
        pass (``hits``) as hits of that same lookup rather than misses."""
        with self._mutex:
            chunks = self._lookup_locked(model_name, world_size, chunk_hashes, lookup_id, lock,
                                         ranks)
            n = self._n
            n.lookup_hit_chunks += chunks - hits
            n.lookup_miss_chunks -= chunks - hits
        return chunks

    def _slot_memory(self, slot: int, nbytes: int) -> memoryview:
        return self.pool.view(slot, nbytes).numpy().data  # numpy's memoryview of the slot: no copy

    @contextmanager
    def _pinned(self, key: ChunkKey) -> Iterator[memoryview | None]:
        """A resident chunk's bytes, pinned (not evictable) for the ``with`` block; None if gone.
        (The tiers' writers take bytes through it.)"""
        with self._mutex:
            entry = self._entries.get(key)
            if entry is not None:
                entry.readers += 1
        if entry is None:
            yield None
            return
        try:
            yield self._slot_memory(entry.slot, entry.nbytes)
        finally:
            with self._mutex:
                entry.readers -= 1

    def _coldest(self, limit: int, ahead: int, saved: Callable[[ChunkKey], bool]) -> list[ChunkKey]:
        """Up to ``limit`` keys not ``saved`` among the ``ahead - free slots`` least recently used
        entries, the next in line for eviction (``saved`` runs under the lock: a dict lookup)."""
        out: list[ChunkKey] = []
        with self._mutex:
            at_risk = ahead - self.pool.num_free
            for count, key in enumerate(self._entries):
                if count >= at_risk or len(out) >= limit:
                    break
                if not saved(key):  # type: ignore[arg-type]
                    out.append(key)  # type: ignore[arg-type]
        return out

    def _spill_candidates(self, limit: int) -> list[ChunkKey]:
        """What the disk writer saves next (``TieredStorage.spill_candidates``); [] without disk."""
        return self._tiers.spill_candidates(limit) if self._tiers is not None else []

    # ------------------------------------------------------------------ admin

    def clear(self, force: bool = False) -> tuple[int, int]:
        """Drop resident chunks; returns ``(removed, kept)``.

        Unforced, locked chunks stay; forced, they go with their locks. Chunks being read or
        written always stay (``kept`` counts the resident ones kept).
        """
        removed = kept = 0
        dropped: list[ChunkKey] = []
        with self._mutex:
            for entry in list(self._entries.values()):
                if entry.readers or (entry.locks and not force):
                    kept += 1
                else:
                    self._drop(entry)
                    dropped.append(entry.key)
                    removed += 1
            if self.events is not None and dropped:
                self.events.removed(dropped, MEMORY_TIER)
            if force:
                self._purge_locks()
        return removed, kept

    def _purge_locks(self) -> None:
        """Forget locks on entries that are gone, so a re-stored key starts unlocked."""
        entries = self._entries
        for lookup_id, held in list(self._locks.items()):
            held.entries = {key: entry for key, entry in held.entries.items()
                            if entries.get(key) is entry}
            if not held.entries:
                del self._locks[lookup_id]

    def stats(self) -> dict[str, int]:
        """The engine's share of ``ServerStats``: ``ServerStats(**engine.stats(), ...)``."""
        with self._mutex:
            out = asdict(self._n)
            out.update(
                chunks=len(self._entries),
                bytes_used=self._bytes_used,
                slots_total=self.pool.num_slots,
                slots_used=self.pool.num_used,
                locks_held=sum(len(held.entries) for held in self._locks.values()),
            )
        if self._tiers is not None:
            out.update(self._tiers.stats())
        return out

    def list_chunks(self, model_name: str | None = None, limit: int = 100,
                    sort: str = "age") -> tuple[list[ChunkInfo], int]:
        """Up to ``limit`` resident chunks (of ``model_name`` if given) and how many match in all.

        Sorts: ``age`` newest first, ``hits`` most first, ``size`` largest first, ``key`` by
        (model, chunk hash, world size, rank) so a chunk's ranks sit together.
        """
        if sort not in SORTS:
            raise ProtocolError(f"sort must be one of {', '.join(SORTS)}, got {sort!r}")
        with self._mutex:
            now = self._clock()
            rows = [(entry.key, entry.nbytes, entry.locks, entry.hits, now - entry.created)
                    for entry in self._entries.values()
                    if model_name is None or entry.key[0] == model_name]
        rows.sort(key=_SORT_KEYS[sort])
        return [_chunk_info(*row) for row in rows[:max(limit, 0)]], len(rows)

    def is_resident(self, key: ChunkKey) -> bool:
        """Whether ``key`` is committed (visible to lookups)."""
        with self._mutex:
            return key in self._entries

    def locks_of(self, lookup_id: str) -> list[ChunkKey]:
        """The keys ``lookup_id`` holds a lock on (for inspection and tests)."""
        with self._mutex:
            held = self._locks.get(lookup_id)
            return list(held.entries) if held is not None else []

    def __len__(self) -> int:
        return len(self._entries)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Shut down the engine's own threads (the async lookups' prefetch pool, if it was made;
        running prefetches get ``timeout_s`` to finish). The tiers are their owner's to stop.
        True if nothing was left running. Idempotent; the engine stays usable, except for tiered
        async lookups."""
        return self._async.close(timeout_s)

    # ------------------------------------------------------------------ in-process async lookup
    # The engine's half of lmcache_core.lookup_client: a worker's LMCacheAsyncLookupServer calls
    # these from its thread, for this engine's own rank only (the work: async_lookup.AsyncLookups).

    def async_lookup_and_prefetch(self, lookup_id: str, hashes: Sequence[bytes],
                                  offsets: Sequence[int] | None = None, pin: bool = True,
                                  request_configs: dict[str, Any] | None = None, *,
                                  model_name: str = "", world_size: int = 1, worker_id: int = 0,
                                  on_result: Callable[[str, int], None] | None = None) -> int | None:
        """Count rank ``worker_id``'s cached prefix of ``hashes``, pin it when ``pin``, and answer.

        The hit tokens go to ``on_result(lookup_id, num_hit_tokens)`` (the server's
        ``send_response_to_scheduler``) and are returned. With a disk or Redis tier, the prefix is
        brought into memory by ``lookup_tiers`` on a prefetch thread, so the caller's thread never
        waits on tier I/O: then this returns None and ``on_result`` is called from that thread.
        ``offsets[i]`` is the end in tokens of chunk ``i`` (without them a chunk counts
        ``chunk_size``); ``request_configs`` is accepted for LMCache compatibility.
        """
        return self._async.lookup_and_prefetch(lookup_id, hashes, offsets, pin,
                                               model_name=model_name, world_size=world_size,
                                               worker_id=worker_id, on_result=on_result)

    def cleanup_memory_objs(self, lookup_id: str) -> int:
        """Release what ``lookup_id``'s async lookup pinned (it was cancelled or timed out)."""
        return self._async.cleanup(lookup_id)


_Row = tuple[ChunkKey, int, int, int, float]
_SORT_KEYS: dict[str, Callable[[_Row], Any]] = {
    "age": lambda row: row[4],
    "hits": lambda row: (-row[3], row[4]),
    "size": lambda row: (-row[1], row[4]),
    "key": lambda row: (row[0][0], row[0][3], row[0][1], row[0][2]),
}


def _chunk_info(key: ChunkKey, nbytes: int, locks: int, hits: int, age_s: float) -> ChunkInfo:
    return ChunkInfo(chunk_hash=key[3], model_name=key[0], world_size=key[1], kv_rank=key[2],
                     tier=MEMORY_TIER, nbytes=nbytes, locks=locks, hits=hits, age_s=age_s)
