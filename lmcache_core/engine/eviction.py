"""The eviction policy: which resident pieces go to make room, across every model, in the order
``retention.eviction_order`` gives (LRU unless requests asked for TTLs, pins or priorities).

The pool is one byte budget cut into slabs, each of one size class (``storage.pool``). Room for a
piece of class C is a free slot in a C slab or a free slab. So, walking that order past pieces
that are locked, being read or pinned: a victim of class C frees one C slot; a victim of
another class frees room only if its whole slab can go, so its slab's pieces are taken together
(or the slab is skipped when one of them is held). Per-model quotas evict the model's own oldest
pieces first. Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable

from lmcache_core.engine.index import Piece, PieceIndex
from lmcache_core.engine.retention import free_to_go
from lmcache_core.storage.pool import MemoryPool


def victims_for(index: PieceIndex, pool: MemoryPool, order: Iterable[Piece], now: float,
                nbytes: int, count: int) -> list[Piece]:
    """Pieces whose eviction makes room for ``count`` allocations of ``nbytes``, taken in
    ``order`` (``retention.eviction_order``); as many as one pass finds: fewer when too much is
    held (locked, being read, pinned)."""
    size_class = pool.size_class(nbytes)
    per_slab = pool.slab_bytes // size_class
    chosen: list[Piece] = []
    taken: set[int] = set()  # handles already chosen
    seen_slabs: set[int] = set()
    room = 0
    by_handle = index.by_handle
    for piece in order:
        if room >= count:
            break
        if piece.handle in taken or not free_to_go(piece, now):
            continue
        if pool.class_of(piece.handle) == size_class:
            chosen.append(piece)
            taken.add(piece.handle)
            room += 1
            continue
        slab = pool.slab_of(piece.handle)
        if slab in seen_slabs:
            continue
        seen_slabs.add(slab)
        members = [by_handle.get(handle) for handle in pool.slab_handles(slab)]
        if any(member is None or not free_to_go(member, now) for member in members):
            continue  # a piece being written (not indexed yet) or held: the slab stays
        for member in members:
            assert member is not None
            if member.handle not in taken:
                chosen.append(member)
                taken.add(member.handle)
        room += per_slab
    return chosen


def quota_victims(order: Iterable[Piece], now: float, model_name: str,
                  excess: int) -> list[Piece]:
    """The first pieces of ``model_name`` in eviction ``order`` that may go, holding at least
    ``excess`` bytes (fewer when not enough can go)."""
    chosen: list[Piece] = []
    freed = 0
    for piece in order:
        if freed >= excess:
            break
        if piece.key.model_name == model_name and free_to_go(piece, now):
            chosen.append(piece)
            freed += piece.nbytes
    return chosen
