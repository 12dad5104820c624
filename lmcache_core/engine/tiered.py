"""``TieredStorage``: the lower tiers (disk, Redis) around the engine's store, through the store's
methods only (``lookup``, ``uncovered``, ``reserve_loads``, ``commit_loaded``, ``memory``,
``coldest``); ``CacheEngine`` tells it of stores and evictions (``stored``, ``evicted``: the hooks
it gave the store at construction). The tiers come built (with their KV-event sink); ``start``
starts their writers, each given what it writes from (the store's pieces, verified: the store is
built after the tiers), ``stop`` drains and ends them.

* **lookup** (``CacheEngine.lookup`` with a tier budget): after a memory lookup, for each chunk
  whose head ranges memory does not cover, the pieces that can cover them are found in the disk
  index (no I/O) or asked of Redis in one pipelined round trip. Pieces of other tensor-parallel
  sizes count: a range is covered by any pieces of the same chunk and layout whose head ranges
  together hold it (``candidate_ranges``: the ranges every TP size dividing the heads would have
  stored). The longest prefix of chunks that can be covered gets pool room (evicting as a store
  would), is read in (disk on the caller's thread, Redis on the remote tier's threads at the same
  time) and checksummed, then committed; a final locked re-lookup counts and locks what is
  resident.
* **peek** (``peek``, ``lmcache lookup``): the same finding, counted and nothing more: no pool
  room, no load, no lock, no LRU move, no lookup counted. Each chunk of the prefix is counted in
  the slowest tier it needs (memory, disk, Redis), so an operator sees what survived a restart.
* **write-behind** (``stored``): a committed store is queued for Redis, and for disk
  (``write_through``) or the disk writer is told to keep the coldest pieces saved. Never blocks.
* **eviction** (``evicted``): a piece evicted before the disk writer saved it is counted.

Tier I/O never runs under the store's lock: room is reserved under it, filled outside it, and
committed under it again. The writers take bytes through ``verify.IntegrityGuard.source``
(``reading``, which holds a reader count, checked against the piece's checksum: a corrupt piece is
dropped, never written). A loaded piece keeps the checksum its record carried (verified on read).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from lmcache_core.engine.index import GroupTarget, Holder, group_reach, window_needed
from lmcache_core.engine.store import PieceStore
from lmcache_core.engine.verify import IntegrityGuard
from lmcache_core.keys import (
    MAX_PROBED_TP,
    ChunkKey,
    HeadRange,
    candidate_ranges,
    is_mla,
    is_state,
    layout_fields,
    layout_heads,
)
from lmcache_core.storage import record
from lmcache_core.storage.pool import MemoryPool
from lmcache_core.supervision import Supervisor

if TYPE_CHECKING:
    from lmcache_core.storage.disk import DiskTier
    from lmcache_core.storage.remote_tier import RemoteTier

T = TypeVar("T")
#: A piece to load: ``(key, nbytes, from_disk)``.
Load = tuple[ChunkKey, int, bool]
#: A piece being loaded: ``(key, handle, nbytes)``.
Item = tuple[ChunkKey, int, int]
#: Redis keys one tiered lookup may probe (pieces of every TP split of every missing range):
#: bounds the work a request of many chunks and ranks can cause.
PROBE_BUDGET = 8192
#: How often a hybrid lookup moves its reach back to a chunk a window (sliding, local) lacks (each try
#: asks the tiers once more: bounded).
MAX_WINDOW_TRIES = 4
#: Spill ahead of eviction: the disk writer keeps this share of the pool's bytes saved.
SPILL_AHEAD_SHARE = 4
#: Redis keys one explain asks for at most (one pipelined STRLEN, as a lookup's ``PROBE_BUDGET``).
EXPLAIN_REMOTE_KEYS = 1024


@dataclass(slots=True)
class TierCounts:
    """What ``TieredStorage.peek`` found: the leading chunks the tiers hold together, each counted
    once, in the slowest tier it needs. ``remote``: "" (no Redis tier, or none needed), "asked",
    "down" (not asked: the tier is down), "timeout" (no answer in time), "cut" (the prefix needs
    more than ``PROBE_BUDGET`` probes: it may go on past what was counted)."""

    memory: int = 0
    disk: int = 0
    remote_chunks: int = 0
    remote: str = ""

    @property
    def hits(self) -> int:
        return self.memory + self.disk + self.remote_chunks


class TieredStorage:
    """One engine's disk and/or remote tier around its store."""

    def __init__(self, store: PieceStore, pool: MemoryPool, disk: DiskTier | None = None,
                 remote: RemoteTier | None = None, guard: IntegrityGuard | None = None) -> None:
        """``pool``: the store's (what a load may reserve, what spilling keeps ahead of)."""
        self._store = store
        self._pool = pool
        self.disk = disk
        self.remote = remote
        self.spill_ahead_bytes = max(1, pool.nbytes // SPILL_AHEAD_SHARE)
        # The writers take a piece's bytes only once they match its checksum (``verify``).
        self.guard = guard if guard is not None else IntegrityGuard(store)

    def start(self, supervisor: Supervisor | None = None) -> None:
        """Start the tiers' writer threads (watched by ``supervisor``), writing the store's
        pieces through ``guard.source``; the disk's also keeps what is nearest eviction saved
        (``spill_candidates``)."""
        if self.disk is not None:
            self.disk.start(self.guard.source, self.spill_candidates, supervisor)
        if self.remote is not None:
            self.remote.start(self.guard.source, supervisor)

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Write what the tiers' queues hold (each for at most ``drain_timeout_s``), then end
        their writers: Redis's first, then the disk's."""
        for tier in (self.remote, self.disk):
            if tier is not None:
                tier.stop(drain_timeout_s)

    # ------------------------------------------------------------------ lookup

    def lookup(self, model_name: str, groups: Sequence[GroupTarget],
               chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool = True,
               timeout_s: float = 1.0, readers: int = 1, shared: int = 1) -> int:
        """``PieceStore.lookup`` with the tiers, for at most about ``timeout_s``: after the
        memory lookup, the full-attention groups' runs of chunks the tiers can cover set how far
        the hit may reach (a model of one layout: its one group's run); each other group of a
        hybrid model then needs only its window before that reach (a sliding window's last
        chunks, a chunked-local group's from its attention chunk's start: never all its
        chunks), and where a window cannot be covered the reach falls back to the chunk it
        lacks (``_plan_windows``). What the hit needs is loaded, then counted again: a reported
        hit is always in memory and locked (``readers``/``shared``: ``PieceStore.lookup``); a
        load that misses the deadline lands in memory (unlocked) when it completes."""
        store = self._store
        hits = store.lookup(model_name, groups, chunk_hashes, lookup_id, lock, readers, shared)
        if hits == len(chunk_hashes):
            return hits
        deadline = time.monotonic() + timeout_s
        reach = len(chunk_hashes)
        full: list[list[list[Load]]] = []
        for group in (g for g in groups if g.full):
            planned = self._plan_loads(model_name, group.layout, group.ranges,
                                       chunk_hashes[hits:], deadline)
            reach = min(reach, hits + len(planned))
            full.append(planned)
        windows: list[Load] = []
        for _ in range(MAX_WINDOW_TRIES):
            if reach <= hits:
                break
            windows, short = self._plan_windows(model_name, groups, chunk_hashes, reach,
                                                deadline)
            if short is None:
                break
            reach = short
        if reach > hits:
            loads = [load for plan in full for chunk in plan[:reach - hits] for load in chunk]
            self._load(loads + windows, deadline)
        return store.lookup(model_name, groups, chunk_hashes, lookup_id, lock, readers, shared,
                            earlier_hits=hits)

    def _plan_windows(self, model_name: str, groups: Sequence[GroupTarget],
                      chunk_hashes: Sequence[bytes], reach: int, deadline: float
                      ) -> tuple[list[Load], int | None]:
        """The pieces of the groups other than full attention that resuming at chunk ``reach``
        needs (``window_needed``), and None; or, when some window cannot be covered, the first
        chunk one lacks (no reach past it but before its window's end can be restored either;
        at it the window needs only covered chunks: those it found before the one it lacks)."""
        loads: list[Load] = []
        short: int | None = None
        for group in (g for g in groups if not g.full):
            start = window_needed(group, reach)
            planned = self._plan_loads(model_name, group.layout, group.ranges,
                                       chunk_hashes[start:reach], deadline)
            if len(planned) < reach - start:
                lacking = start + len(planned)
                short = lacking if short is None else min(short, lacking)
            loads += [load for chunk in planned for load in chunk]
        return loads, short

    def _plan_loads(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
                    hashes: Sequence[bytes], deadline: float) -> list[list[Load]]:
        """Per chunk, the pieces to load, for the longest run of chunks whose ranges memory does
        not cover the tiers can cover (disk first; Redis asked once, pipelined, for every other
        candidate piece); a chunk memory covers has none."""
        wanted = self._store.uncovered(model_name, layout, ranges, hashes)
        disk, remote = self.disk, self.remote
        ask_redis = remote is not None and not remote.down
        budget = PROBE_BUDGET
        per_chunk: list[tuple[dict[HeadRange, Load], list[ChunkKey]]] = []
        for chunk_hash, missing in zip(hashes, wanted, strict=True):
            on_disk: dict[HeadRange, Load] = {}
            if disk is not None and missing:
                on_disk = {(key.head_lo, key.head_hi): (key, nbytes, True)
                           for key, nbytes in disk.pieces_of(model_name, layout, chunk_hash)}
            probes: list[ChunkKey] = []
            if ask_redis:
                probes = [ChunkKey(model_name, layout, lo, hi, chunk_hash)
                          for heads in missing for lo, hi in candidate_ranges(layout, heads)
                          if (lo, hi) not in on_disk]
                budget -= len(probes)
                if budget < 0:  # one lookup probes a bounded number of keys
                    break
            per_chunk.append((on_disk, probes))
            if not ask_redis and pick_pieces(on_disk, missing) is None:
                break  # the prefix stops here: no need to look further
        in_redis = self._remote_lengths(
            list(dict.fromkeys(key for _, probes in per_chunk for key in probes)), deadline)
        budget = self._pool.nbytes
        loads: list[list[Load]] = []
        chosen: set[ChunkKey] = set()
        for missing, (available, probes) in zip(wanted, per_chunk, strict=False):  # a prefix
            for key in probes:
                nbytes = in_redis.get(key)
                if nbytes is not None:
                    available.setdefault((key.head_lo, key.head_hi), (key, nbytes, False))
            picked = pick_pieces(available, missing)
            if picked is None:
                break
            fresh = [load for load in picked if load[0] not in chosen]
            budget -= sum(load[1] for load in fresh)
            if budget < 0:
                break
            chosen.update(load[0] for load in fresh)
            loads.append(fresh)
        return loads

    def _remote_lengths(self, keys: list[ChunkKey], deadline: float) -> dict[ChunkKey, int]:
        """Payload bytes of the ``keys`` Redis holds (one pipelined STRLEN); {} when down."""
        remote = self.remote
        if remote is None or remote.down or not keys:
            return {}
        try:
            found = self._wait(remote.run(remote.lengths, keys, deadline), deadline)
        except RuntimeError:  # the tier is shutting down
            return {}
        out: dict[ChunkKey, int] = {}
        for key, length in zip(keys, found or (), strict=False):
            nbytes = length - record.header_bytes(key)
            if length and self._pool.fits(nbytes):
                out[key] = nbytes
        return out

    def _wait(self, future: Future[T], deadline: float) -> T | None:
        """The remote call's result, or None (counted) when the deadline passes first."""
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            if self.remote is not None:
                self.remote.count_lookup_timeout()
            return None

    def _load(self, loads: list[Load], deadline: float) -> None:
        """Reserve slots for ``loads`` (in order, as far as the pool allows) and fill them."""
        from_disk = {key: disk for key, _, disk in loads}
        reserved = self._store.reserve_loads([(key, nbytes) for key, nbytes, _ in loads])
        disk_items = [item for item in reserved if from_disk[item[0]]]
        remote_items = [item for item in reserved if not from_disk[item[0]]]
        remote, future = self.remote, None
        if remote_items and remote is not None:
            try:
                future = remote.run(self._load_remote, remote_items, deadline)
            except RuntimeError:  # the tier is shutting down
                self._commit_loads(remote_items, [(0, 0)] * len(remote_items), from_disk=False)
        if disk_items:
            self._load_disk(disk_items, deadline)
        if future is not None:
            self._wait(future, deadline)

    def _load_disk(self, items: list[Item], deadline: float) -> None:
        disk, memory = self.disk, self._store.memory
        got = [(0, 0)] * len(items)
        try:
            for i, (key, handle, nbytes) in enumerate(items):
                if disk is None or time.monotonic() >= deadline:
                    break
                got[i] = disk.load_into(key, memory(handle, nbytes))
        finally:
            self._commit_loads(items, got, from_disk=True)

    def _load_remote(self, items: list[Item], deadline: float) -> None:
        """On the remote tier's thread: GET into the slots, then commit (even after the caller
        stopped waiting: the chunks are then simply warm in memory)."""
        remote, memory = self.remote, self._store.memory
        got = [(0, 0)] * len(items)
        try:
            if remote is not None:
                got = remote.fetch_checked_into(
                    [key for key, _, _ in items],
                    [memory(handle, nbytes) for _, handle, nbytes in items], deadline)
        finally:
            self._commit_loads(items, got, from_disk=False)

    def _commit_loads(self, items: list[Item], got: list[tuple[int, int]],
                      from_disk: bool) -> None:
        """Make the loaded pieces resident with the checksums their records carried (verified by
        the tier: a short, failed or corrupt load frees its room); pieces that came from Redis go
        to disk as a store's would."""
        loaded = self._store.commit_loaded(items, [n for n, _ in got], [s for _, s in got])
        if loaded and not from_disk:
            self._to_disk(loaded)

    # ------------------------------------------------------------------ peek

    def peek(self, model_name: str, groups: Sequence[GroupTarget],
             chunk_hashes: Sequence[bytes], timeout_s: float = 1.0) -> TierCounts:
        """How many leading chunks memory, disk and Redis hold together as ``lookup`` would count
        them, and in which tier each is (``TierCounts``): the leading ``N`` chunks at whose end
        every group can be restored from the tiers together (the rule of
        ``index.find_group_hits``: a full group's chunks ``[0, N)``, another's of
        ``[window_needed(group, N), N)``; one full group: its covered prefix), each counted in
        the slowest tier a piece it needs is in. Redis is asked at most once (one pipelined
        STRLEN for every group together), for at most about ``timeout_s``. Loads, locks,
        touches and counts nothing."""
        deadline = time.monotonic() + timeout_s
        plans: list[_PeekPlan] = []
        state = ""
        for group in groups:
            wanted = self._store.uncovered(model_name, group.layout, group.ranges, chunk_hashes)
            plan, planned = self._peek_plan(model_name, group.layout, chunk_hashes, wanted,
                                            stop_at_miss=group.full)
            plans.append(plan)
            state = state or planned
        probes = list(dict.fromkeys(key for plan in plans for _, _, keys in plan for key in keys))
        in_redis: dict[ChunkKey, int] = {}
        if probes:
            asked, in_redis = self._peek_remote(probes, deadline)
            # a cut plan's count may go on past what was asked: say so, unless Redis failed
            state = state if state == "cut" and asked == "asked" else asked
        levels = [_chunk_tiers(plan, in_redis, len(chunk_hashes)) for plan in plans]
        return _count_tiers(groups, levels, len(chunk_hashes), state)

    def _peek_plan(self, model_name: str, layout: str, hashes: Sequence[bytes],
                   wanted: list[list[HeadRange]], stop_at_miss: bool = True
                   ) -> tuple[_PeekPlan, str]:
        """Per leading chunk: the ranges memory lacks, the disk's pieces of it, and the Redis keys
        to probe when the disk does not cover those ranges (none: it does); with
        ``stop_at_miss`` it stops at the first chunk no tier can hold (a sliding window's group
        goes on: its earlier chunks may be gone). With the Redis state so far ("down", "cut" or
        "")."""
        disk, remote = self.disk, self.remote
        ask_redis = remote is not None and not remote.down
        state = "down" if remote is not None and remote.down else ""
        budget = PROBE_BUDGET
        plan: _PeekPlan = []
        for chunk_hash, ranges in zip(hashes, wanted, strict=True):
            on_disk: dict[HeadRange, Load] = {}
            probes: list[ChunkKey] = []
            if ranges and disk is not None:
                on_disk = {(key.head_lo, key.head_hi): (key, nbytes, True)
                           for key, nbytes in disk.pieces_of(model_name, layout, chunk_hash)}
            if ranges and pick_pieces(on_disk, ranges) is None:
                if not ask_redis and stop_at_miss:
                    break
                probes = [ChunkKey(model_name, layout, lo, hi, chunk_hash)
                          for heads in ranges for lo, hi in candidate_ranges(layout, heads)
                          if (lo, hi) not in on_disk] if ask_redis else []
                budget -= len(probes)
                if budget < 0:
                    return plan, "cut"
            plan.append((ranges, on_disk, probes))
        return plan, state

    def _peek_remote(self, keys: list[ChunkKey], deadline: float) -> tuple[str, dict[ChunkKey, int]]:
        """The Redis state and the payload bytes of the ``keys`` Redis holds, loadable into the
        pool; a peek that waits past its deadline is not counted as a lookup timeout."""
        state, sizes = self._remote_sizes(keys, deadline)
        fits = self._pool.fits
        return state, {key: nbytes for key, nbytes in sizes.items() if fits(nbytes)}

    def _remote_sizes(self, keys: list[ChunkKey], deadline: float
                      ) -> tuple[str, dict[ChunkKey, int]]:
        """The Redis state ("asked", "down", "timeout") and the payload bytes of the ``keys``
        Redis holds (one pipelined STRLEN, waited for until ``deadline``)."""
        remote = self.remote
        assert remote is not None
        try:
            future = remote.run(remote.lengths, keys, deadline)
            found = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            return "timeout", {}
        except RuntimeError:  # the tier is shutting down
            return "down", {}
        if found is None:
            return ("down" if remote.down else "timeout"), {}
        return "asked", {key: length - record.header_bytes(key)
                         for key, length in zip(keys, found, strict=False) if length}

    def remote_holders(self, pairs: Sequence[tuple[str, str]], chunk_hashes: Sequence[bytes],
                       timeout_s: float, max_keys: int = EXPLAIN_REMOTE_KEYS
                       ) -> tuple[str, list[Holder]]:
        """Which of ``pairs`` hold each of ``chunk_hashes`` in Redis (``lmcache lookup
        --explain``): exact keys only, never a SCAN, at most ``max_keys`` of them (each hash in
        order across every pair, then the next; "cut" when they ran out) in one pipelined STRLEN
        within ``timeout_s``. A chunk is asked for its whole heads and each tensor-parallel size's
        first rank's piece (``_probed_ranges``), so the finds say which TP size stored it."""
        remote = self.remote
        if remote is None:
            return "", []
        if remote.down:
            return "down", []
        keys: list[tuple[int, ChunkKey]] = []
        cut = False
        for probe, chunk_hash in enumerate(chunk_hashes):
            for model_name, layout in pairs:
                ranges = _probed_ranges(layout)
                if len(keys) + len(ranges) > max_keys:
                    cut = True
                    break
                keys += [(probe, ChunkKey(model_name, layout, lo, hi, chunk_hash))
                         for lo, hi in ranges]
            if cut:
                break
        if not keys:
            return ("cut" if cut else ""), []
        state, sizes = self._remote_sizes([key for _, key in keys], time.monotonic() + timeout_s)
        found: dict[tuple[int, str, str], list[HeadRange]] = {}
        for probe, key in keys:
            if key in sizes:
                found.setdefault((probe, key.model_name, key.layout), []).append(
                    (key.head_lo, key.head_hi))
        holders = [Holder(probe, model_name, layout, remote.name, tuple(ranges))
                   for (probe, model_name, layout), ranges in found.items()]
        return ("cut" if cut and state == "asked" else state), holders

    # ------------------------------------------------------------------ engine hooks

    def stored(self, keys: Sequence[ChunkKey]) -> None:
        """After a store commits: queue the chunks for Redis, and for disk (write-through) or wake
        the disk writer to keep the coldest chunks saved. Never blocks."""
        if self.remote is not None:
            self.remote.submit(keys)
        self._to_disk(keys)

    def _to_disk(self, keys: Sequence[ChunkKey]) -> None:
        disk = self.disk
        if disk is not None:
            if disk.write_through:
                disk.submit(keys)
            else:
                disk.notify()

    def evicted(self, key: ChunkKey) -> None:
        """Every eviction passes here (under the engine's lock, so no I/O): the disk tier's writer
        has already saved the chunks nearest eviction (``spill_candidates``); one it had not got to
        is counted as ``disk_evicted_unsaved``."""
        disk = self.disk
        if disk is not None and not disk.contains(key):
            disk.count_evicted_unsaved()

    def spill_candidates(self, limit: int) -> list[ChunkKey]:
        """Up to ``limit`` chunks among those next in line for eviction that are not on disk yet.

        "Next in line": in eviction's order (``PieceStore.coldest``), the pieces holding
        ``spill_ahead_bytes - free pool bytes``, so the writer starts saving once the pool is three
        quarters full and stays ahead of eviction.
        """
        disk = self.disk
        if disk is None:
            return []
        return self._store.coldest(limit, self.spill_ahead_bytes, disk.contains)


#: The tiers a peek counts a chunk in, fastest first (``TierCounts``' fields in that order).
MEMORY, DISK, REMOTE = 0, 1, 2
#: A peek's plan of one layout: per leading chunk, (ranges memory lacks, the disk's pieces of
#: it, the Redis keys to probe).
_PeekPlan = list[tuple[list[HeadRange], dict[HeadRange, Load], list[ChunkKey]]]


def _chunk_tiers(plan: _PeekPlan, in_redis: dict[ChunkKey, int], n: int) -> list[int | None]:
    """Per chunk of the ``n``, the slowest tier its pieces in ``plan`` need, None when no tier
    covers it (a chunk past the plan's end included)."""
    out: list[int | None] = []
    for wanted, on_disk, keys in plan:
        if not wanted:
            out.append(MEMORY)
        elif pick_pieces(on_disk, wanted) is not None:
            out.append(DISK)
        else:
            available = dict(on_disk)
            for key in keys:
                if key in in_redis:
                    available.setdefault((key.head_lo, key.head_hi), (key, in_redis[key], False))
            out.append(REMOTE if pick_pieces(available, wanted) is not None else None)
    return out + [None] * (n - len(out))


def _count_tiers(groups: Sequence[GroupTarget], tiers: list[list[int | None]], n: int,
                 state: str) -> TierCounts:
    """The hit of ``find_group_hits``' rule over each group's per-chunk tiers, each of its
    chunks counted in the slowest tier a group needs it from."""
    reach = group_reach(groups, tiers, n)
    counts = TierCounts(remote=state)
    for position in range(reach):  # within the reach, every chunk a group needs has a tier
        slowest = max(found[position] or MEMORY for group, found in zip(groups, tiers, strict=True)
                      if position >= window_needed(group, reach))
        if slowest == MEMORY:
            counts.memory += 1
        elif slowest == DISK:
            counts.disk += 1
        else:
            counts.remote_chunks += 1
    return counts


def pick_pieces(available: dict[HeadRange, Load], ranges: Sequence[HeadRange]) -> list[Load] | None:
    """Pieces of ``available`` that together cover every range of ``ranges`` (widest first at
    each head), or None when some head is in none of them."""
    picked: dict[ChunkKey, Load] = {}
    for lo, hi in ranges:
        at = lo
        while at < hi:
            best = max((heads for heads in available if heads[0] <= at < heads[1]),
                       key=lambda heads: heads[1], default=None)
            if best is None:
                return None
            load = available[best]
            picked[load[0]] = load
            at = best[1]
    return list(picked.values())


def _probed_ranges(layout: str) -> tuple[HeadRange, ...]:
    """The pieces of a chunk an explain asks Redis for in ``layout``: the whole heads and the
    first rank's piece of each tensor-parallel size dividing them; for MLA its one piece, for a
    Mamba state or an opaque layout the first rank's (each rank's piece is its own)."""
    if is_mla(layout) or is_state(layout) or layout_fields(layout) is None:
        return ((0, 1),)
    heads = layout_heads(layout)
    return tuple((0, heads // world) for world in range(1, min(heads, MAX_PROBED_TP) + 1)
                 if heads % world == 0)
