"""``TieredStorage``: the engine's lower tiers (disk, Redis) and what the engine asks of them.

A ``CacheEngine`` made with a ``disk`` or ``remote`` tier holds one of these (without tiers it holds
none, and none of this runs). It does the tier I/O and its orchestration; the engine keeps the index,
and lends it a few index operations (``_not_resident``, ``_reserve_slots``, ``_commit_loaded``,
``_relookup``, ``_pinned``, ``_coldest``):

* **lookup** (``CacheEngine.lookup_tiers``): after a memory ``lookup``, the chunks memory lacks are
  found in the disk index (no I/O) or asked of Redis in one pipelined round trip; the longest prefix
  available for every rank gets pool slots (evicting as a store would), is read in (disk on the
  caller's thread, Redis on the remote tier's threads at the same time) and checksummed, then
  committed; a final locked re-lookup counts and locks what is resident.
* **write-behind** (``stored``): a committed store is queued for Redis, and for disk
  (``write_through``) or the disk writer is told to keep the coldest chunks saved. Never blocks.
* **eviction** (``evicted``): a chunk evicted before the disk writer saved it is counted.
* **stats**: the tiers' counters, merged into the engine's.

Tier I/O never runs under the engine's lock: slots are reserved under it (as a store does), filled
outside it, and committed under it again. The writers of both tiers take bytes through the engine's
``_pinned``, which holds a reader count so the slot cannot be evicted mid-copy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, TypeVar

from lmcache_core.keys import ChunkKey
from lmcache_core.storage import record

if TYPE_CHECKING:
    from lmcache_core.engine import CacheEngine
    from lmcache_core.storage.disk import DiskTier
    from lmcache_core.storage.remote import RemoteTier

T = TypeVar("T")
#: A chunk to load: ``(key, nbytes, from_disk)``.
Load = tuple[ChunkKey, int, bool]
#: A chunk being loaded: ``(key, slot, nbytes)``.
Item = tuple[ChunkKey, int, int]


class TieredStorage:
    """One engine's disk and/or remote tier; binds their writers to the engine's pinned views."""

    def __init__(self, engine: CacheEngine, disk: DiskTier | None = None,
                 remote: RemoteTier | None = None) -> None:
        self.engine = engine
        self.disk = disk
        self.remote = remote
        self.spill_ahead = max(1, engine.pool.num_slots // 4)  # slots kept saved on disk ahead of eviction
        if disk is not None:
            disk.bind(engine._pinned, self.spill_candidates)
            disk.events = engine.events  # each tier reports its own chunks (KV events)
        if remote is not None:
            remote.bind(engine._pinned)
            remote.events = engine.events

    # ------------------------------------------------------------------ lookup

    def lookup(self, model_name: str, world_size: int, chunk_hashes: Sequence[bytes],
               lookup_id: str, lock: bool = True, ranks: Sequence[int] | None = None,
               timeout_s: float = 1.0) -> int:
        """``CacheEngine.lookup_tiers``: ``lookup``, then the rest of the prefix from the tiers.

        Blocks for at most about ``timeout_s``. A reported hit is always in memory and locked,
        exactly as after a plain ``lookup``; a load that misses the deadline is not counted now and
        lands in memory (unlocked) when it completes.
        """
        engine = self.engine
        hits = engine.lookup(model_name, world_size, chunk_hashes, lookup_id, lock, ranks)
        if hits == len(chunk_hashes):
            return hits
        deadline = time.monotonic() + timeout_s
        rank_list = range(world_size) if ranks is None else ranks
        wanted = engine._not_resident(model_name, world_size, chunk_hashes[hits:], rank_list)
        loads = self._plan_loads(wanted, deadline)
        if loads:
            self._load(loads, deadline)
        return engine._relookup(model_name, world_size, chunk_hashes, lookup_id, lock, rank_list,
                                hits)

    def _plan_loads(self, wanted: list[list[ChunkKey]], deadline: float) -> list[Load]:
        """``(key, nbytes, from_disk)`` for the longest run of chunks every missing key of which
        is on disk or in Redis (one pipelined STRLEN for those not on disk)."""
        disk, remote = self.disk, self.remote
        slot_bytes = self.engine.pool.slot_bytes
        lengths: dict[ChunkKey, int] = {}
        if remote is not None and not remote.down:
            ask = [key for chunk in wanted for key in chunk if disk is None or not disk.contains(key)]
            if ask:
                try:
                    found = self._wait(remote.run(remote.lengths, ask, deadline), deadline)
                except RuntimeError:  # the tier is shutting down
                    found = None
                if found:
                    lengths = dict(zip(ask, found, strict=True))
        loads: list[Load] = []
        for chunk in wanted:
            found_all = len(loads)
            for key in chunk:
                nbytes = disk.nbytes_of(key) if disk is not None else None
                if nbytes is not None and 0 < nbytes <= slot_bytes:
                    loads.append((key, nbytes, True))
                    continue
                length = lengths.get(key, 0)
                nbytes = length - record.header_bytes(key)
                if length and 0 < nbytes <= slot_bytes:
                    loads.append((key, nbytes, False))
                    continue
                del loads[found_all:]
                return loads
        return loads

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
        sizes = {key: (nbytes, from_disk) for key, nbytes, from_disk in loads}
        keys, slots = self.engine._reserve_slots([key for key, _, _ in loads])
        disk_items: list[Item] = []
        remote_items: list[Item] = []
        for key, slot in zip(keys, slots, strict=True):
            nbytes, from_disk = sizes[key]
            (disk_items if from_disk else remote_items).append((key, slot, nbytes))
        remote, future = self.remote, None
        if remote_items and remote is not None:
            try:
                future = remote.run(self._load_remote, remote_items, deadline)
            except RuntimeError:  # the tier is shutting down
                self._commit_loads(remote_items, [0] * len(remote_items), from_disk=False)
        if disk_items:
            self._load_disk(disk_items, deadline)
        if future is not None:
            self._wait(future, deadline)

    def _load_disk(self, items: list[Item], deadline: float) -> None:
        disk, slot_memory = self.disk, self.engine._slot_memory
        got = [0] * len(items)
        try:
            for i, (key, slot, nbytes) in enumerate(items):
                if disk is None or time.monotonic() >= deadline:
                    break
                got[i] = disk.read_into(key, slot_memory(slot, nbytes))
        finally:
            self._commit_loads(items, got, from_disk=True)

    def _load_remote(self, items: list[Item], deadline: float) -> None:
        """On the remote tier's thread: GET into the slots, then commit (even after the caller
        stopped waiting: the chunks are then simply warm in memory)."""
        remote, slot_memory = self.remote, self.engine._slot_memory
        got = [0] * len(items)
        try:
            if remote is not None:
                got = remote.fetch_into([key for key, _, _ in items],
                                        [slot_memory(slot, nbytes) for _, slot, nbytes in items],
                                        deadline)
        finally:
            self._commit_loads(items, got, from_disk=False)

    def _commit_loads(self, items: list[Item], got: list[int], from_disk: bool) -> None:
        """Make the loaded chunks resident (a short or failed load frees its slot); chunks that
        came from Redis go to disk as a store's would."""
        loaded = self.engine._commit_loaded(items, got)
        if loaded and not from_disk:
            self._to_disk(loaded)

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

        "Next in line": the least recently used ``spill_ahead - free slots`` entries, so the
        writer starts saving once the pool is three quarters full and stays ahead of eviction.
        """
        disk = self.disk
        if disk is None:
            return []
        return self.engine._coldest(limit, self.spill_ahead, disk.contains)

    def stats(self) -> dict[str, int]:
        """The tiers' counters (names as in ``ServerStats``)."""
        out: dict[str, int] = {}
        if self.disk is not None:
            out.update(self.disk.stats())
        if self.remote is not None:
            out.update(self.remote.stats())
        return out
