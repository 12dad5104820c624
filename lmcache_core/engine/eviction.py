"""The eviction policy: which resident pieces go to make room, across every model, in the order
``retention.eviction_order`` gives (LRU unless requests asked for TTLs, pins or priorities).

The pool is one byte budget cut into slabs, each of one size class (``storage.pool``). Room for a
piece of class C is a free slot in a C slab or a free slab. So, walking that order past pieces
that are locked, being read or pinned: a victim of class C frees one C slot; a victim of
another class frees room only if its whole slab can go, so its slab's pieces are taken together
(or the slab is skipped when one of them is held). Quotas (per model, per ``cache_salt`` tenant)
evict the model's or tenant's own oldest pieces first (``over_quotas``). Not thread-safe: the
engine calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from lmcache_core.engine.index import Piece, PieceIndex
from lmcache_core.engine.retention import free_to_go
from lmcache_core.engine.writing import Writing
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


#: Which pieces a quota bounds (one model's, one tenant's).
Belongs = Callable[[Piece], bool]


def quota_victims(order: Iterable[Piece], now: float, belongs: Belongs,
                  excess: int) -> list[Piece]:
    """The first pieces that ``belongs`` picks in eviction ``order`` and that may go, holding at
    least ``excess`` bytes (fewer when not enough can go)."""
    chosen: list[Piece] = []
    freed = 0
    for piece in order:
        if freed >= excess:
            break
        if belongs(piece) and free_to_go(piece, now):
            chosen.append(piece)
            freed += piece.nbytes
    return chosen


def quota_limits(index: PieceIndex, writing: Writing, quotas: Mapping[str, int],
                 tenant_quotas: Mapping[str, int], nbytes: int, model_name: str,
                 tag: str) -> list[tuple[Belongs, int]]:
    """The quotas a new piece of ``nbytes`` for ``model_name`` and tenant ``tag`` ("": none) would
    pass, for ``over_quotas``; pieces being written (``writing``) count as well as resident ones."""
    limits: list[tuple[Belongs, int]] = []
    # The tenant's first: its own oldest pieces go, and those of this model count for the model's
    # quota too; the model's first would take another tenant's piece, then the tenant's as well.
    quota = tenant_quotas.get(tag) if tag else None
    if quota is not None:
        used = index.tenants.bytes.get(tag, 0) + writing.tenants.bytes.get(tag, 0)
        if used + nbytes > quota:
            limits.append((lambda piece: piece.tenant == tag, used + nbytes - quota))
    quota = quotas.get(model_name)
    if quota is not None:
        used = index.models.bytes.get(model_name, 0) + writing.models.bytes.get(model_name, 0)
        if used + nbytes > quota:
            limits.append((lambda piece: piece.key.model_name == model_name,
                           used + nbytes - quota))
    return limits


def over_quotas(order: Callable[[], Iterable[Piece]], now: float,
                limits: Sequence[tuple[Belongs, int]]) -> list[Piece] | None:
    """The pieces to evict so a new piece fits every quota it is under: ``limits`` holds, per
    quota, which pieces it bounds and its ``excess`` bytes. Each quota's own oldest pieces go
    (pieces chosen for one quota count toward another they also belong to: a model's and a
    tenant's). None, choosing nothing, when some quota cannot be met."""
    chosen: list[Piece] = []
    for belongs, excess in limits:
        excess -= sum(piece.nbytes for piece in chosen if belongs(piece))
        if excess <= 0:
            continue
        taken = {piece.handle for piece in chosen}
        more = quota_victims((piece for piece in order() if piece.handle not in taken), now,
                             belongs, excess)
        if sum(piece.nbytes for piece in more) < excess:
            return None
        chosen += more
    return chosen
