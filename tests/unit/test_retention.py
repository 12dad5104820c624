"""Retention asked for by requests: TTLs, pins (bounded by max_pinned) and priorities decide what
eviction takes; plain LRU otherwise."""

from __future__ import annotations

import pytest

from lmcache_core.engine import CacheEngine, GroupTarget, PieceRow, Retention
from lmcache_core.errors import PinLimitError
from lmcache_core.keys import ChunkKey, opaque_layout
from lmcache_core.server.listing import memory_rows
from lmcache_core.storage.pool import MemoryPool
from tests.harness import FakeClock
from tests.unit.engines import h

SLOT = 64
LAYOUT = opaque_layout(1)
GROUPS = [GroupTarget(LAYOUT, ((0, 1),))]  # a lookup's (or pin's) of one rank


def key(i: int, model: str = "m") -> ChunkKey:
    return ChunkKey(model, LAYOUT, 0, 1, h(i))


def make(slots: int = 4, max_pinned: int | None = None) -> tuple[CacheEngine, FakeClock]:
    clock = FakeClock(start=100.0)
    engine = CacheEngine(MemoryPool.slots(SLOT, slots, pin=False), chunk_size=16, clock=clock,
                         max_pinned_bytes=max_pinned)
    return engine, clock


def store(engine: CacheEngine, ids: list[int], retention: Retention | None = None):
    """One store per id (within one request a prefix's tail is the least recently used)."""
    stored = skipped = refused = present = 0
    for i in ids:
        plan = engine.store.begin_store([key(i)], SLOT, retention or Retention())
        for _, k, view in plan.writes:
            view.fill_(k.chunk_hash[0])
        engine.store.finish_store(plan)
        stored += plan.stored
        skipped += plan.skipped_full
        refused += plan.pin_refused
        present += plan.already_present
    return Totals(stored, skipped, refused, present)


class Totals:
    def __init__(self, stored: int, skipped_full: int, pin_refused: int, present: int) -> None:
        self.stored, self.skipped_full = stored, skipped_full
        self.pin_refused, self.already_present = pin_refused, present


def rows(engine: CacheEngine) -> dict[int, PieceRow]:
    """Each resident piece as the listing shows it, by its chunk (its hash's first byte)."""
    return {row.chunk_hash[0]: row for row in memory_rows(engine.store)[0]}


def resident(engine: CacheEngine, ids: list[int]) -> list[bool]:
    pieces = engine.store.inspect().pieces
    return [key(i) in pieces for i in ids]


def test_without_hints_eviction_is_plain_lru():
    engine, _ = make()
    store(engine, [0, 1, 2, 3])
    store(engine, [4])
    assert resident(engine, [0, 1, 2, 3, 4]) == [False, True, True, True, True]
    assert engine.store.inspect().hinted == 0


def test_expired_pieces_go_first_then_lru():
    engine, clock = make()
    store(engine, [0, 1])
    store(engine, [2], Retention(ttl_s=10))  # the most recently used, but with a TTL
    store(engine, [3])
    store(engine, [4])  # nothing expired yet: LRU takes 0
    assert resident(engine, [0, 2]) == [False, True]
    clock.advance(11)
    store(engine, [5])  # 2 expired: it goes before the older 1
    assert resident(engine, [1, 2, 3, 4, 5]) == [True, False, True, True, True]


def test_lower_priority_goes_first_lru_within_a_priority():
    engine, _ = make()
    store(engine, [0], Retention(priority=5))
    store(engine, [1, 2])
    store(engine, [3], Retention(priority=-1))
    store(engine, [4, 5])  # room for two: the low one (3), then the oldest plain one (1)
    assert resident(engine, [0, 1, 2, 3, 4, 5]) == [True, False, True, False, True, True]
    store(engine, [6])  # plain 2 before the high-priority 0 although 0 is older
    assert resident(engine, [0, 2]) == [True, False]


def test_pinned_pieces_survive_a_flood_until_unpinned_or_their_ttl_ends():
    engine, clock = make(max_pinned=2 * SLOT)
    store(engine, [0], Retention(pin=True))
    store(engine, [1], Retention(pin=True, ttl_s=30))
    for i in range(10, 30):  # a flood of other stores
        store(engine, [i])
    assert resident(engine, [0, 1]) == [True, True]
    stats = engine.snapshot()
    assert (stats.engine.pinned_pieces, stats.engine.pinned_bytes) == (2, 2 * SLOT)
    clock.advance(31)  # 1's pin lapses with its TTL
    engine.store.expire_locks()
    store(engine, [30, 31])
    assert resident(engine, [0, 1]) == [True, False]
    assert engine.store.unpin("m", GROUPS, [h(0)]) == 1
    store(engine, [32, 33])
    assert not engine.store.inspect().resident(key(0))
    assert engine.snapshot().engine.pinned_pieces == 0


def test_a_pool_full_of_pinned_pieces_skips_stores():
    engine, _ = make(slots=2, max_pinned=2 * SLOT)
    store(engine, [0, 1], Retention(pin=True))
    plan = store(engine, [2])
    assert (plan.stored, plan.skipped_full) == (0, 1)
    assert resident(engine, [0, 1]) == [True, True]


def test_pins_past_max_pinned_are_refused_and_counted_never_dropped_silently():
    engine, _ = make(max_pinned=SLOT)
    plan = store(engine, [0, 1], Retention(pin=True))
    assert (plan.stored, plan.pin_refused) == (2, 1)  # both stored, one left unpinned
    assert engine.snapshot().engine.store_pin_refused == 1
    assert sorted(row.pinned for row in rows(engine).values()) == [False, True]
    with pytest.raises(PinLimitError, match="max_pinned"):
        engine.store.pin("m", GROUPS, [h(0), h(1)])
    assert engine.snapshot().engine.pinned_pieces == 1  # nothing pinned by the refused call


def test_pin_and_unpin_by_hand_and_a_store_of_present_pieces_applies_its_hints():
    engine, clock = make(max_pinned=4 * SLOT)
    store(engine, [0, 1, 2])
    assert engine.store.pin("m", GROUPS, [h(0), h(1), h(9)], ttl_s=60) == 2  # a prefix
    plan = store(engine, [2], Retention(pin=True, priority=3, ttl_s=5))  # already present
    assert (plan.stored, plan.already_present) == (0, 1)
    listed = rows(engine)
    assert [listed[i].pinned for i in (0, 1, 2)] == [True, True, True]
    # stored without a TTL: none is the longest, it keeps none
    assert listed[2].priority == 3 and listed[2].expires_in_s is None
    assert listed[0].expires_in_s == pytest.approx(60)
    clock.advance(1)
    store(engine, [0], Retention(ttl_s=1, priority=-2))  # the longer TTL and higher priority stay
    row = rows(engine)[0]
    assert (row.priority, row.expires_in_s) == (0, pytest.approx(59))
    assert engine.store.unpin("m", GROUPS, [h(0), h(1), h(2)]) == 3


def test_a_pin_with_a_ttl_replaces_the_ttl_and_keeps_the_priority():
    engine, _clock = make(max_pinned=4 * SLOT)
    store(engine, [0], Retention(priority=50, ttl_s=600))
    assert engine.store.pin("m", GROUPS, [h(0)], ttl_s=60) == 1
    row = rows(engine)[0]
    assert (row.pinned, row.priority, row.expires_in_s) == (True, 50, pytest.approx(60))


def test_clear_keeps_pinned_pieces_unless_forced():
    engine, _ = make()
    store(engine, [0], Retention(pin=True))
    store(engine, [1])
    assert engine.store.clear() == (1, 1)
    assert engine.store.clear(force=True) == (1, 0)
    assert engine.snapshot().engine.pinned_pieces == 0 and engine.store.inspect().hinted == 0


def test_a_pin_without_a_ttl_holds_a_piece_stored_with_one_until_unpinned():
    engine, clock = make(slots=2, max_pinned=2 * SLOT)
    store(engine, [1], Retention(ttl_s=5))
    assert engine.store.pin("m", GROUPS, [h(1)]) == 1  # "until unpinned"
    assert rows(engine)[1].expires_in_s is None
    clock.advance(10)  # past the store's TTL
    assert engine.store.expire_locks() == 0 and engine.snapshot().engine.pinned_pieces == 1
    store(engine, [2, 3, 4])  # a 2-slot pool: only the unpinned pieces come and go
    assert resident(engine, [1]) == [True]
    assert engine.store.unpin("m", GROUPS, [h(1)]) == 1
    store(engine, [5, 6])
    assert resident(engine, [1]) == [False] and engine.store.inspect().hinted == 0


def test_a_store_that_pins_a_present_piece_without_a_ttl_pins_it_until_unpinned():
    engine, clock = make(slots=2, max_pinned=2 * SLOT)
    store(engine, [1], Retention(ttl_s=5))
    plan = store(engine, [1], Retention(pin=True))  # already present: pinned, no TTL of its own
    assert (plan.already_present, plan.pin_refused) == (1, 0)
    clock.advance(10)
    engine.store.expire_locks()
    store(engine, [2, 3, 4])
    assert resident(engine, [1]) == [True] and engine.snapshot().engine.pinned_pieces == 1


def test_a_refused_pin_without_a_ttl_leaves_the_pieces_ttl():
    engine, _clock = make(max_pinned=SLOT)
    store(engine, [0], Retention(pin=True))  # takes all of max_pinned
    store(engine, [1], Retention(ttl_s=5))
    plan = store(engine, [1], Retention(pin=True))
    assert plan.pin_refused == 1
    row = rows(engine)[1]
    assert (row.pinned, row.expires_in_s) == (False, pytest.approx(5))


def test_a_pin_with_a_ttl_still_ends_with_it_and_a_later_pin_without_one_holds():
    engine, clock = make(slots=2, max_pinned=2 * SLOT)
    store(engine, [1])
    assert engine.store.pin("m", GROUPS, [h(1)], ttl_s=5) == 1
    clock.advance(10)
    assert engine.store.expire_locks() == 0 and engine.snapshot().engine.pinned_pieces == 0  # lapsed
    assert engine.store.pin("m", GROUPS, [h(1)]) == 1
    clock.advance(1000)
    engine.store.expire_locks()
    assert engine.snapshot().engine.pinned_pieces == 1
    assert engine.snapshot().engine.pinned_bytes == SLOT
