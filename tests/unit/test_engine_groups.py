"""A hybrid model's lookup rule (engine level): a prefix of N chunks counts only when every
full-attention group holds chunks [0, N) and every sliding-window group its window's pieces
[max(0, N - wc), N), for every rank's heads; every group's pieces of the hit are locked under one
lookup id, each group's retrieve releases its own; LRU order eats the prefix's tail first."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.keys import ChunkKey, LayoutGroup, layout_key, world_heads
from lmcache_core.storage.pool import MemoryPool

MODEL = "gemma"
SLOT = 64
FULL = layout_key("bfloat16", 2, 4, 8, False, LayoutGroup(0, 3, 0))
SLIDE_A = layout_key("bfloat16", 2, 4, 8, False, LayoutGroup(1, 3, 16))
SLIDE_B = layout_key("bfloat16", 2, 4, 8, False, LayoutGroup(2, 3, 16))


def h(i: int) -> bytes:
    return bytes([i + 1]) * 32


def groups(world: int = 1, window: int = 2) -> list[GroupTarget]:
    """One full group and two sliding groups of ``window`` chunks each, for ``world`` ranks."""
    return [GroupTarget(FULL, world_heads(FULL, world), 0),
            GroupTarget(SLIDE_A, world_heads(SLIDE_A, world), window),
            GroupTarget(SLIDE_B, world_heads(SLIDE_B, world), window)]


def make(slots: int = 64) -> CacheEngine:
    return CacheEngine(MemoryPool.slots(SLOT, slots, pin=False), chunk_size=16)


def store(engine: CacheEngine, layout: str, chunks: Sequence[int], heads: tuple[int, int] = (0, 4)
          ) -> None:
    plan = engine.store.begin_store([ChunkKey(MODEL, layout, *heads, h(i)) for i in chunks], SLOT)
    engine.store.finish_store(plan)
    assert plan.stored == len(chunks)


def store_all(engine: CacheEngine, chunks: Sequence[int]) -> None:
    for layout in (FULL, SLIDE_A, SLIDE_B):
        store(engine, layout, chunks)


HASHES = [h(i) for i in range(6)]


def test_a_prefix_counts_where_every_group_can_be_restored():
    engine = make()
    store_all(engine, range(6))
    assert engine.lookup(MODEL, groups(), HASHES, "all") == 6


def test_sliding_groups_need_only_their_window_before_the_hit():
    engine = make()
    store(engine, FULL, range(6))
    for layout in (SLIDE_A, SLIDE_B):
        store(engine, layout, [4, 5])  # the window (2 chunks) before chunk 6, nothing earlier
    assert engine.lookup(MODEL, groups(window=2), HASHES, "w2") == 6
    # windows of 3: N = 6 needs [3, 6), and no shorter N has its window either
    assert engine.lookup(MODEL, groups(window=3), HASHES, "w3") == 0


def test_the_hit_falls_back_to_the_last_boundary_whose_window_is_whole():
    engine = make()
    store(engine, FULL, range(6))
    for layout in (SLIDE_A, SLIDE_B):
        store(engine, layout, [0, 1, 2, 4, 5])
    store(engine, SLIDE_B, [3])
    # SLIDE_A lacks chunk 3: N = 6 needs [4, 6) (whole); but it is the longest, so 6
    assert engine.lookup(MODEL, groups(window=2), HASHES, "a") == 6
    # with windows of 3, N = 6 needs [3, 6): chunk 3 missing in SLIDE_A; N = 5 needs [2, 5):
    # missing too; N = 4 needs [1, 4): missing; N = 3 needs [0, 3): whole
    assert engine.lookup(MODEL, groups(window=3), HASHES, "b") == 3


def test_a_chunk_missing_one_groups_piece_is_a_miss_at_that_chunk():
    engine = make()
    store_all(engine, range(6))
    store(engine, FULL, [6])  # the full group's chunk 6 without its sliding pieces
    hashes = [*HASHES, h(6)]
    assert engine.lookup(MODEL, groups(window=1), hashes, "x") == 6
    engine.store.clear(force=True)
    store(engine, SLIDE_A, range(6))
    store(engine, SLIDE_B, range(6))
    store(engine, FULL, [0, 1, 3, 4, 5])  # full attention lacks chunk 2: nothing past it counts
    assert engine.lookup(MODEL, groups(window=1), HASHES, "y") == 2


def test_every_ranks_heads_in_every_group():
    engine = make()
    for layout in (FULL, SLIDE_A, SLIDE_B):
        store(engine, layout, range(4), (0, 2))
        store(engine, layout, range(4), (2, 4))
    assert engine.lookup(MODEL, groups(world=2), HASHES[:4], "tp2") == 4
    assert engine.lookup(MODEL, groups(world=1), HASHES[:4], "tp1") == 4  # two pieces each
    store(engine, SLIDE_A, [4], (0, 2))  # chunk 4's window piece of SLIDE_A lacks heads 2-4
    store(engine, FULL, [4])
    store(engine, SLIDE_B, [4])
    assert engine.lookup(MODEL, groups(world=2), HASHES[:5], "half") == 4


def test_locks_cover_every_groups_pieces_of_the_hit_and_each_retrieve_releases_its_own():
    engine = make()
    store_all(engine, range(6))
    assert engine.lookup(MODEL, groups(window=2), HASHES, "req") == 6
    locked = engine.store.inspect().locks_of("req")
    by_layout = {layout: sorted(k.chunk_hash[0] - 1 for k in locked if k.layout == layout)
                 for layout in (FULL, SLIDE_A, SLIDE_B)}
    assert by_layout == {FULL: [0, 1, 2, 3, 4, 5], SLIDE_A: [4, 5], SLIDE_B: [4, 5]}
    plan = engine.store.begin_retrieve(MODEL, SLIDE_A, (0, 4), HASHES[4:], "req")
    engine.store.finish_retrieve(plan)
    assert {k.layout for k in engine.store.inspect().locks_of("req")} == {FULL, SLIDE_B}
    assert engine.store.clear()[1] == 8  # locked pieces stay: 6 full, 2 of SLIDE_B
    for layout, hashes in ((FULL, HASHES), (SLIDE_B, HASHES[4:])):
        engine.store.finish_retrieve(engine.store.begin_retrieve(MODEL, layout, (0, 4), hashes, "req"))
    assert engine.store.inspect().locks_of("req") == []


def test_a_miss_holds_nothing_and_drops_what_the_id_held():
    engine = make()
    store_all(engine, range(2))
    assert engine.lookup(MODEL, groups(), HASHES[:2], "r") == 2
    engine.store.clear(force=True)
    assert engine.lookup(MODEL, groups(), HASHES[:2], "r") == 0
    assert engine.store.inspect().locks_of("r") == []


def test_hits_are_touched_tail_first_across_groups():
    """Eviction takes the least recently used first: the hit's last chunk's pieces, of every
    group, go before its earlier chunks' (what remains of the prefix stays usable); window pieces
    the hit does not need are not touched."""
    engine = make()
    store_all(engine, range(3))
    engine.lookup(MODEL, groups(window=1), HASHES[:3], "t", lock=False)
    order = [(k.layout, k.chunk_hash[0] - 1) for k in engine.store.inspect().pieces]
    assert set(order[:4]) == {(SLIDE_A, 0), (SLIDE_A, 1), (SLIDE_B, 0), (SLIDE_B, 1)}
    assert order[4:] == [(SLIDE_B, 2), (SLIDE_A, 2), (FULL, 2), (FULL, 1), (FULL, 0)]


def test_counters_count_one_lookup_of_the_hit():
    engine = make()
    store_all(engine, range(4))
    engine.lookup(MODEL, groups(), HASHES, "c")
    stats = engine.snapshot()
    n = stats.engine
    assert (n.lookups, n.lookup_hit_chunks, n.lookup_miss_chunks) == (1, 4, 2)


@pytest.mark.parametrize("bad", [[], [GroupTarget(FULL, (), 0)]])
def test_a_group_lookup_needs_groups_with_ranges(bad):
    from lmcache_core.errors import ProtocolError

    with pytest.raises(ProtocolError):
        make().lookup(MODEL, bad, HASHES, "bad")


def test_without_registered_groups_a_lookup_never_counts_one_groups_pieces_alone():
    """After a restart, before the hybrid workers registered again, the resident layouts are
    the fallback: a group's layout is no candidate (its pieces alone never make a hit)."""
    from lmcache_core.keys import opaque_layout
    from lmcache_core.server.layouts import LayoutResolver
    from lmcache_core.server.registry import KVRegistry

    engine = make()
    store_all(engine, range(2))
    store(engine, "bfloat16:2x4x8", range(2))  # a single-group engine of the same model name
    resolver = LayoutResolver(engine.store, KVRegistry(lambda request: None, 60.0))
    assert resolver.groups(MODEL, 1) is None
    assert [target.layout for target in resolver.candidates(MODEL, 1, None)] == ["bfloat16:2x4x8"]
    engine.store.clear(force=True)
    store_all(engine, range(2))
    assert [target.layout for target in resolver.candidates(MODEL, 1, None)] == [opaque_layout(1)]
