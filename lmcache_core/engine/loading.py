"""What the lower tiers ask of the core to load pieces back and to save them ahead of eviction.

``tiered.TieredStorage`` works through these (and the core's ``commit_loaded``, ``memory`` and
``reading``): a tier lookup finds the head ranges memory does not cover, reserves pool room for the
pieces it will read (as a store would, evicting), and after committing them looks up again; the
disk writer asks which pieces are next in line for eviction. Each call takes the core's lock
briefly; no I/O happens under it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lmcache_core.engine.core import CacheCore
from lmcache_core.engine.index import cover
from lmcache_core.engine.retention import eviction_order, pinned_now
from lmcache_core.keys import ChunkKey, HeadRange


def uncovered(core: CacheCore, model_name: str, layout: str, ranges: Sequence[HeadRange],
              chunk_hashes: Sequence[bytes]) -> list[list[HeadRange]]:
    """Per chunk, the ranges of ``ranges`` that resident pieces do not cover."""
    out: list[list[HeadRange]] = []
    with core.mutex:
        chunks_of = core.index.chunks.get
        for chunk_hash in chunk_hashes:
            pieces = chunks_of((model_name, layout, chunk_hash)) or []
            out.append([(lo, hi) for lo, hi in ranges
                        if not pieces or cover(pieces, lo, hi) is None])
    return out


def reserve(core: CacheCore,
            items: Sequence[tuple[ChunkKey, int]]) -> list[tuple[ChunkKey, int, int]]:
    """Pool bytes for the ``(key, nbytes)`` pieces neither resident nor being written, in order
    as far as the pool allows (evicting as a store does): ``(key, handle, nbytes)``. They count
    as being written until ``core.commit_loaded``."""
    out: list[tuple[ChunkKey, int, int]] = []
    with core.mutex:
        for key, nbytes in items:
            if key in core.writing or key in core.index.lru or not core.pool.fits(nbytes):
                continue
            # Loaded pieces have no tenant (tier records carry none; ``commit_loaded`` leaves
            # them untagged): only the model's quota applies.
            if not core.quota_room(key.model_name, nbytes):
                continue
            handle = core.allocate(nbytes, 1)
            if handle is None:
                break
            core.writing.reserve(key, handle, nbytes)
            out.append((key, handle, nbytes))
    return out


def relookup(core: CacheCore, model_name: str, layout: str, ranges: Sequence[HeadRange],
             chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool, hits: int) -> int:
    """``lookup`` again after the tiers loaded pieces, counting the chunks found since its first
    pass (``hits``) as hits of that same lookup rather than misses."""
    with core.mutex:
        chunks = core.lookup_locked(model_name, layout, ranges, chunk_hashes, lookup_id, lock)
        n = core.counters
        n.lookup_hit_chunks += chunks - hits
        n.lookup_miss_chunks -= chunks - hits
    return chunks


def coldest(core: CacheCore, limit: int, ahead_bytes: int,
            saved: Callable[[ChunkKey], bool]) -> list[ChunkKey]:
    """Up to ``limit`` pieces not ``saved`` among the next in line for eviction, holding
    ``ahead_bytes - free pool bytes``: eviction's own order (``retention.eviction_order``: LRU,
    unless TTLs, pins or priorities reorder it), past pinned pieces, which eviction never takes
    (saving them ahead would spend disk writes on nothing). ``saved`` runs under the lock: a dict
    lookup."""
    out: list[ChunkKey] = []
    with core.mutex:
        at_risk = ahead_bytes - core.pool.bytes_free
        if at_risk <= 0:  # nothing due: skip the order (with hints, a sort of the whole index)
            return out
        now = core.clock()
        for piece in eviction_order(core.index, core.retention, now):
            if at_risk <= 0 or len(out) >= limit:
                break
            if pinned_now(piece, now):
                continue
            at_risk -= piece.nbytes
            if not saved(piece.key):
                out.append(piece.key)
    return out
