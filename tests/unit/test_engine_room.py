"""Eviction takes only the room a store needs (issue 22): a piece of a new size evicts at most its
bytes plus one unit (plus the overhang of whole pieces it cuts), and a held piece blocks only the
units it sits in. Real pools and engines; the store's bytes are checked where they matter."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.keys import ChunkKey, opaque_layout
from lmcache_core.storage.pool import MemoryPool
from tests.harness import FakeClock

UNIT = 1024
UNITS = 16
LAYOUT = opaque_layout(1)


def chunk(model: str, i: int) -> ChunkKey:
    return ChunkKey(model, LAYOUT, 0, 1, i.to_bytes(4, "big") * 8)


def engine_of(units: int = UNITS) -> CacheEngine:
    return CacheEngine(MemoryPool(units * UNIT, slab_bytes=UNIT, pin=False), chunk_size=16,
                       clock=FakeClock())


def put(engine: CacheEngine, keys: Sequence[ChunkKey], nbytes: int) -> int:
    """Store ``keys`` with ``nbytes`` each, every byte of a piece its key's first hash byte."""
    plan = engine.store.begin_store(keys, nbytes)
    for _, k, view in plan.writes:
        view.fill_(k.chunk_hash[3])
    engine.store.finish_store(plan)
    return plan.stored


def fill_with_a(engine: CacheEngine, per_unit: int = 4) -> list[ChunkKey]:
    """Fill every unit with model A's pieces of ``UNIT // per_unit`` bytes, one store each (so
    piece i is the i-th least recently used and sits in unit i // per_unit)."""
    keys = [chunk("A", i) for i in range(UNITS * per_unit)]
    for k in keys:
        assert put(engine, [k], UNIT // per_unit) == 1
    assert engine.pool.free_slabs == 0
    return keys


def resident(engine: CacheEngine, keys: Sequence[ChunkKey]) -> list[bool]:
    pieces = engine.store.inspect().pieces
    return [k in pieces for k in keys]


def lock(engine: CacheEngine, k: ChunkKey, lookup_id: str) -> None:
    assert engine.lookup(k.model_name, [GroupTarget(k.layout, ((0, 1),))], [k.chunk_hash], lookup_id) == 1


def test_a_new_small_size_evicts_one_unit_and_nothing_else() -> None:
    engine = engine_of()
    a = fill_with_a(engine)
    assert put(engine, [chunk("B", 0)], 512) == 1  # class 512: a slab of its own
    assert resident(engine, a) == [False] * 4 + [True] * 60  # A's least recently used unit
    assert engine.snapshot().engine.evictions == 4
    assert put(engine, [chunk("B", 1)], 512) == 1  # the slab's second slot: no eviction
    assert engine.snapshot().engine.evictions == 4


def test_a_new_large_size_evicts_only_its_window() -> None:
    engine = engine_of()
    a = fill_with_a(engine)
    assert put(engine, [chunk("B", 0)], 2500) == 1  # 2500 bytes: an extent of 3 units
    assert resident(engine, a) == [False] * 12 + [True] * 52  # 3072 bytes < 2500 + one unit
    handle = engine.store.inspect().pieces[chunk("B", 0)].handle
    assert engine.pool.units_of(handle) == range(0, 3)
    assert bool((engine.pool.view(handle, 2500) == 0).all())  # B's own bytes (hash byte 0)
    # A same-size store later takes the coldest same-size piece's units, exactly.
    engine.lookup("A", [GroupTarget(LAYOUT, ((0, 1),))], [k.chunk_hash for k in a[12:]], "warm",
                  lock=False)
    assert put(engine, [chunk("B", 1)], 2500) == 1
    assert not engine.store.inspect().resident(chunk("B", 0)) and sum(resident(engine, a)) == 52


def test_a_locked_piece_blocks_only_its_own_unit() -> None:
    engine = engine_of()
    a = fill_with_a(engine)
    for unit in range(UNITS - 1):  # one locked piece in every unit but the last
        lock(engine, a[unit * 4 + 1], f"hold{unit}")
    assert put(engine, [chunk("B", 0)], 512) == 1
    assert resident(engine, a) == [True] * 60 + [False] * 4  # the one unit nobody holds
    # Every unit holds a locked piece now (B's own is locked too): no room, nothing evicted.
    lock(engine, chunk("B", 0), "holdB")
    evictions = engine.snapshot().engine.evictions
    plan = engine.store.begin_store([chunk("C", 0)], 300)
    assert (plan.stored, plan.skipped_full) == (0, 1)
    engine.store.finish_store(plan)
    assert engine.snapshot().engine.evictions == evictions
    # One unit's lock released: that unit alone goes.
    engine.store.free_lookup_locks("hold7")
    assert put(engine, [chunk("C", 0)], 300) == 1
    assert resident(engine, a[28:32]) == [False] * 4
    assert sum(resident(engine, a)) == 56


def test_an_extent_goes_around_locked_units() -> None:
    engine = engine_of()
    a = fill_with_a(engine)
    lock(engine, a[5], "hold")  # unit 1
    assert put(engine, [chunk("B", 0)], 3 * UNIT) == 1
    handle = engine.store.inspect().pieces[chunk("B", 0)].handle
    # The coldest unit (0) cannot anchor three units without unit 1; unit 2's window can.
    assert engine.pool.units_of(handle) == range(2, 5)
    assert resident(engine, a[:20]) == [True] * 8 + [False] * 12
    assert engine.snapshot().engine.evictions == 12


def test_an_extent_takes_the_cheapest_window_around_its_anchor() -> None:
    """The least recently used piece anchors the windows that overlap it; of those, the one whose
    pieces hold the fewest bytes goes: here the anchor's unit and the next, holding one 128-byte
    piece, not the anchor's and the one before, holding a whole unit's piece (either keeps within
    the bound of the random test below: only this test tells them apart)."""
    engine = engine_of()
    fuller, anchor, lighter = chunk("A", 0), chunk("A", 1), chunk("S", 0)
    assert put(engine, [fuller], UNIT) == 1 and put(engine, [anchor], UNIT) == 1
    assert put(engine, [lighter], 128) == 1  # a slab of 128-byte slots, one used
    rest = [chunk("A", i) for i in range(2, UNITS - 1)]
    assert all(put(engine, [k], UNIT) == 1 for k in rest) and engine.pool.free_slabs == 0
    pieces = engine.store.inspect().pieces
    assert [engine.pool.units_of(pieces[k].handle) for k in (fuller, anchor, lighter)] == [
        range(0, 1), range(1, 2), range(2, 3)]
    for k in (fuller, lighter, *rest):  # used since: the anchor is the least recently used
        assert engine.lookup(k.model_name, [GroupTarget(LAYOUT, ((0, 1),))], [k.chunk_hash],
                             "warm", lock=False) == 1
    assert put(engine, [chunk("B", 0)], 2 * UNIT - 100) == 1  # an extent of 2 units
    taken = engine.store.inspect().pieces[chunk("B", 0)].handle
    assert engine.pool.units_of(taken) == range(1, 3)  # units 1-2: 1152 bytes, not 0-1: 2048
    assert resident(engine, [fuller, anchor, lighter, *rest]) == [True, False, False] + [True] * 13
    assert engine.snapshot().engine.evictions == 2


def test_no_store_evicts_more_than_its_room_whatever_the_mix() -> None:
    """Random stores of slot and extent sizes, some pieces locked, into a full pool. Every
    eviction of a one-piece store is inside the units the new piece took, but for at most two
    whole pieces reaching past them (the bound of ``engine/eviction.py``)."""
    rng = random.Random(5)
    engine = engine_of(UNITS * 2)
    pool = engine.pool
    sizes = [100, 256, 700, 1024, 1500, 2048, 3000, 5000]
    checked = 0
    for i in range(600):
        before = {key: (piece.nbytes, pool.units_of(piece.handle))
                  for key, piece in engine.store.inspect().pieces.items()}
        nbytes = rng.choice(sizes)
        k = chunk(f"m{nbytes}", i)
        if not put(engine, [k], nbytes):
            continue
        if rng.random() < 0.2:
            lock(engine, k, f"lock{i}")
        if rng.random() < 0.2:
            engine.store.free_lookup_locks(f"lock{rng.randrange(i + 1)}")
        after = engine.store.inspect().pieces
        gone = [(size, units) for key, (size, units) in before.items() if key not in after]
        if not gone:
            continue
        checked += 1
        taken = pool.units_of(after[k].handle)
        inside = [size for size, units in gone if units.start >= taken.start
                  and units.stop <= taken.stop]
        across = [units for _, units in gone if not (units.start >= taken.start
                                                     and units.stop <= taken.stop)]
        assert all(units.start < taken.stop and taken.start < units.stop for units in across)
        assert len(across) <= 2, (nbytes, gone, taken)
        assert sum(inside) <= len(taken) * UNIT < pool.size_class(nbytes) + UNIT
        assert all(len(units) > 1 for units in across)  # only extents reach past the room
    assert checked > 60


def test_the_bytes_of_every_piece_survive_the_shuffle() -> None:
    """Mixed slot and extent stores and evictions: every resident piece still reads back as it
    was written (no extent overlaps another allocation)."""
    rng = random.Random(11)
    engine = engine_of()
    for i in range(300):
        nbytes = rng.choice([128, 900, 1100, 2100, 4000])
        put(engine, [chunk(f"m{nbytes}", i)], nbytes)
    for key, piece in engine.store.inspect().pieces.items():
        view = engine.pool.view(piece.handle, piece.nbytes)
        assert torch.equal(view, torch.full_like(view, key.chunk_hash[3]))
