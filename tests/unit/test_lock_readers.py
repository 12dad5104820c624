"""Lookup locks with several expected readers (LMCache's ``num_kv_readers``) and released over some
chunks only (LMCache's ``free_lookup_locks`` over ``[start, end)``); the default (one reader, all
released at once) is the engine's own dialect's and stays as it was."""

from __future__ import annotations

from tests.unit.engines import (
    MLA,
    h,
    hashes,
    key,
    locks_by_key,
    lookup,
    make,
    piece,
    retrieve,
    store,
    store_ranks,
)


def test_a_lock_waits_for_each_expected_reader_of_its_range() -> None:
    engine = make()
    store_ranks(engine, range(2))
    assert lookup(engine, 2, hashes(2), "a") == 2
    assert engine.store.set_lock_readers("a", 2)
    retrieve(engine, 0, 2, hashes(2), "a")  # rank 0's first reader: its locks stay
    assert len(engine.store.inspect().locks_of("a")) == 4
    retrieve(engine, 0, 2, hashes(2), "a")  # its second: rank 0's locks go
    assert sorted(engine.store.inspect().locks_of("a")) == sorted(key(i, 1) for i in range(2))
    retrieve(engine, 1, 2, [h(0)], "a")
    retrieve(engine, 1, 2, hashes(2), "a")
    assert engine.store.inspect().locks_of("a") == [key(1, 1)]
    retrieve(engine, 1, 2, [h(1)], "a")
    assert engine.store.inspect().locks_of("a") == [] and engine.snapshot().engine.locks_held == 0


def test_set_readers_without_locks_is_refused() -> None:
    engine = make()
    assert not engine.store.set_lock_readers("nothing", 2)
    store_ranks(engine, range(1))
    assert lookup(engine, 2, [h(9)], "miss") == 0
    assert not engine.store.set_lock_readers("miss", 2)


def test_releasing_some_chunks_leaves_the_others_locked() -> None:
    engine = make()
    store_ranks(engine, range(4))
    lookup(engine, 2, hashes(4), "a")
    assert engine.store.release_lookup_reads("a", {h(2), h(3), h(7)}, 1) == 4  # both ranks, 2 chunks
    assert sorted(engine.store.inspect().locks_of("a")) == sorted(
        key(i, r) for i in range(2) for r in range(2))
    locks = locks_by_key(engine)
    assert locks[key(1, 1)] == 1 and locks[key(2, 0)] == 0
    assert engine.store.release_lookup_reads("a", {h(2)}, 1) == 0  # released already
    assert engine.store.release_lookup_reads("a", {h(0), h(1)}, 1) == 4
    assert engine.store.inspect().locks_of("a") == []
    assert engine.store.release_lookup_reads("a", {h(0)}, 1) == 0


def test_a_release_counts_reads_against_the_expected_readers() -> None:
    engine = make()
    store_ranks(engine, range(2))
    lookup(engine, 2, hashes(2), "a")
    engine.store.set_lock_readers("a", 3)
    retrieve(engine, 0, 2, [h(0)], "a")  # one of three reads of rank 0's chunk 0
    assert engine.store.release_lookup_reads("a", {h(0)}, 1) == 0  # rank 0: 2 of 3, rank 1: 1 of 3
    assert engine.store.release_lookup_reads("a", {h(0)}, 1) == 1  # rank 0's third: its lock goes
    assert len(engine.store.inspect().locks_of("a")) == 3
    assert engine.store.release_lookup_reads("a", {h(0)}, 3) == 1  # more than expected: released
    assert sorted(engine.store.inspect().locks_of("a")) == [key(1, 0), key(1, 1)]
    assert engine.store.free_lookup_locks("a") == 2  # our own dialect's: everything left, at once


def test_a_relookup_starts_with_one_reader_again() -> None:
    engine = make()
    store_ranks(engine, range(1))
    lookup(engine, 2, hashes(1), "a")
    engine.store.set_lock_readers("a", 4)
    lookup(engine, 2, hashes(1), "a")
    retrieve(engine, 0, 2, hashes(1), "a")
    retrieve(engine, 1, 2, hashes(1), "a")
    assert engine.store.inspect().locks_of("a") == []


def test_a_release_may_count_one_range_only() -> None:
    engine = make()
    store_ranks(engine, range(2))
    lookup(engine, 2, hashes(2), "a")
    rank1 = (1, 2)  # the opaque layout of world size 2: rank 1's heads
    assert engine.store.release_lookup_reads("a", {h(0)}, 1, rank1) == 1
    assert sorted(engine.store.inspect().locks_of("a")) == sorted([key(0, 0), key(1, 0), key(1, 1)])


def test_mla_locks_wait_for_every_rank_and_a_free_counts_them_all() -> None:
    """MLA: every rank of world size W reads the one piece, so its lock waits for W reads (times
    LMCache's num_kv_readers); a free_lookup_locks (reads by every rank) counts all W."""

    engine = make()
    store(engine, [piece(i, 0, 1, MLA) for i in range(2)])
    for lookup_id in ("read", "freed"):
        assert lookup(engine, 2, hashes(2), lookup_id, layout=MLA) == 2
        assert engine.store.set_lock_readers(lookup_id, 1, shared=2)
    retrieve(engine, 0, 2, hashes(2), "read", layout=MLA)  # rank 0: rank 1 still reads them
    assert len(engine.store.inspect().locks_of("read")) == 2
    retrieve(engine, 1, 2, hashes(2), "read", layout=MLA)
    assert engine.store.inspect().locks_of("read") == []
    assert engine.store.release_lookup_reads("freed", set(hashes(2)), 1) == 2  # both ranks' reads
    assert engine.store.inspect().locks_of("freed") == [] and engine.snapshot().engine.locks_held == 0
