"""The eviction policy: which resident pieces go to make room, across every model, in the order
``retention.eviction_order`` gives (LRU unless requests asked for TTLs, pins or priorities).

The pool is one byte budget cut into small units (``storage.pool``: 2 MiB by default). A piece up
to a unit takes a slot of a slab (a unit of its size class); a larger one an extent of consecutive
units. Walking that order past pieces that are locked, being read or pinned:

* room for a slot (``slot_victims``): a victim of the same class frees one slot; any other victim
  frees room only if its whole unit can go, so its unit's pieces are taken together (or the unit
  is skipped when one of them is held); a victim that is an extent goes whole.
* room for an extent of k units (``extent_victims``): the first victim that may go anchors a
  window of k consecutive units overlapping it whose occupants may all go, the one that evicts the
  fewest bytes (an extent of exactly k units: itself, at once); the engine then places the piece
  in that window (``MemoryPool.allocate_at``).

The bound: making room for one piece of ``N`` bytes evicts at most one same-class piece (``N``
bytes), or one unit's pieces (``slab_bytes``), or, for an extent, the pieces inside its window of
``ceil(N / unit)`` units (under ``N + slab_bytes``); plus, in either case, the part sticking out
of it of the at most two whole pieces it cuts (extents reaching past the window's ends; the victim
itself when it is an extent larger than the room asked for). A held piece blocks only the units it
sits in. Work per store: one pass of the order up to the first unit or window that may go, and
``O(k + anchor's units)`` unit checks per anchor. Quotas (per model, per ``cache_salt`` tenant)
evict the model's or tenant's own oldest pieces first (``over_quotas``). Not thread-safe: the
engine calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lmcache_core.engine.index import Piece, PieceIndex
from lmcache_core.engine.retention import free_to_go
from lmcache_core.engine.writing import Writing
from lmcache_core.storage.pool import MemoryPool


@dataclass(slots=True)
class Room:
    """What to evict for a store's room, and for an extent the first unit of the window it
    emptied (the piece goes there: ``MemoryPool.allocate_at``); None for slots."""

    victims: list[Piece] = field(default_factory=list)
    first_unit: int | None = None


def victims_for(index: PieceIndex, pool: MemoryPool, order: Iterable[Piece], now: float,
                nbytes: int, count: int) -> Room:
    """What to evict to make room for ``count`` allocations of ``nbytes`` (slots: as many as one
    pass of ``order`` finds; an extent: one, its window), taken in ``order``
    (``retention.eviction_order``); fewer when too much is held (locked, being read, pinned)."""
    if pool.size_class(nbytes) <= pool.slab_bytes:
        return Room(slot_victims(index, pool, order, now, nbytes, count))
    return extent_victims(index, pool, order, now, pool.units_for(nbytes))


def slot_victims(index: PieceIndex, pool: MemoryPool, order: Iterable[Piece], now: float,
                 nbytes: int, count: int) -> list[Piece]:
    """Pieces whose eviction makes room for ``count`` slots of ``nbytes``' class."""
    size_class = pool.size_class(nbytes)
    per_slab = pool.slab_bytes // size_class
    chosen: list[Piece] = []
    taken: set[int] = set()  # handles already chosen
    seen_units: set[int] = set()
    room = 0
    by_handle = index.by_handle
    for piece in order:
        if room >= count:
            break
        if piece.handle in taken or not free_to_go(piece, now):
            continue
        units, piece_class = pool.placement(piece.handle)
        if piece_class == size_class:
            chosen.append(piece)
            taken.add(piece.handle)
            room += 1
            continue
        if units.start in seen_units:
            continue
        seen_units.update(units)
        if len(units) > 1:  # an extent: it alone holds its units
            chosen.append(piece)
            taken.add(piece.handle)
            room += per_slab * len(units)
            continue
        members = [by_handle.get(handle) for handle in pool.slab_handles(units.start)]
        if any(member is None or not free_to_go(member, now) for member in members):
            continue  # a piece being written (not indexed yet) or held: the unit stays
        for member in members:
            assert member is not None
            if member.handle not in taken:
                chosen.append(member)
                taken.add(member.handle)
        room += per_slab
    return chosen


#: A unit's state for a window: None when held (it cannot be emptied), else its occupants that
#: would go: ``(handle, bytes)`` pairs (none: the unit is free).
_Unit = list[tuple[int, int]] | None


def extent_victims(index: PieceIndex, pool: MemoryPool, order: Iterable[Piece], now: float,
                   units: int) -> Room:
    """Room for one extent of ``units`` consecutive units: the cheapest window that may go among
    those overlapping the first victim that anchors one (see the module's note)."""
    tried: set[int] = set()  # anchors' first units already tried
    for piece in order:
        if not free_to_go(piece, now):
            continue
        anchor, piece_class = pool.placement(piece.handle)
        if anchor.start in tried:
            continue
        tried.add(anchor.start)
        if len(anchor) == units and piece_class > pool.slab_bytes:
            return Room([piece], anchor.start)  # the same size: exactly its own units
        window = _cheapest_window(index, pool, now, anchor, units)
        if window is not None:
            return window
    return Room()


def _cheapest_window(index: PieceIndex, pool: MemoryPool, now: float, anchor: range,
                     units: int) -> Room | None:
    """Among the windows of ``units`` units overlapping ``anchor``, the one whose occupants may
    all go and hold the fewest bytes (the lowest among equals); None when each has a held one."""
    lo = max(0, anchor.start - units + 1)
    hi = min(pool.num_slabs - units, anchor.stop - 1)  # the last window start
    if lo > hi:
        return None
    span = range(lo, hi + units)
    states = dict(zip(span, (_unit_state(index, handles, now)
                             for handles in pool.occupants(span)), strict=True))
    best: tuple[int, int] | None = None  # (bytes, start)
    held = 0  # held units in the window
    refs: dict[int, int] = {}  # occupant handle -> units of the window it is in
    cost = 0
    for unit in range(lo, hi + units):  # slide: ``unit`` enters, ``unit - units`` leaves
        cost, held = _enter(states[unit], refs, cost, held, +1)
        if unit - units >= lo:
            cost, held = _enter(states[unit - units], refs, cost, held, -1)
        start = unit - units + 1
        if start >= lo and not held and (best is None or cost < best[0]):
            best = (cost, start)
    if best is None:
        return None
    start = best[1]
    victims: dict[int, Piece] = {}
    for unit in range(start, start + units):
        for handle, _ in states[unit] or ():
            victims[handle] = index.by_handle[handle]
    return Room(list(victims.values()), start)


def _enter(state: _Unit, refs: dict[int, int], cost: int, held: int,
           step: int) -> tuple[int, int]:
    """A unit enters (``step`` 1) or leaves (-1) the sliding window: its occupants' bytes count
    once however many of the window's units they sit in."""
    if state is None:
        return cost, held + step
    for handle, nbytes in state:
        before = refs.get(handle, 0)
        refs[handle] = before + step
        if before == 0:
            cost += nbytes
        elif before + step == 0:
            del refs[handle]
            cost -= nbytes
    return cost, held


def _unit_state(index: PieceIndex, handles: list[int], now: float) -> _Unit:
    occupants: list[tuple[int, int]] = []
    for handle in handles:
        piece = index.by_handle.get(handle)
        if piece is None or not free_to_go(piece, now):
            return None  # being written (not indexed yet) or held
        occupants.append((handle, piece.nbytes))
    return occupants


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
