"""A piece's lifecycle (engine/lifecycle.py): the one table of its states and moves, checked against
the moves written out here (so a move added to the table, or dropped from it, fails), and the
store moving real pieces through it (every event the table names, and nothing else)."""

from __future__ import annotations

import pytest

from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.engine import store as store_module
from lmcache_core.engine.index import Piece
from lmcache_core.engine.lifecycle import TRANSITIONS, Event, State, advance
from lmcache_core.errors import LifecycleError, ServerError
from lmcache_core.keys import ChunkKey, opaque_layout
from lmcache_core.storage.pool import MemoryPool

KEY = ChunkKey("m", opaque_layout(1), 0, 1, b"\x01" * 32)
W, R, D, F = State.WRITING, State.RESIDENT, State.DROPPED, State.FREED

#: Every legal move of a piece, written out (not read from the table): (state, event) -> state.
EXPECTED = {
    (W, Event.COMMIT): R,  # its bytes are in: visible
    (W, Event.ABORT): F,  # its store or load failed
    (R, Event.READ): R,
    (R, Event.READ_DONE): R,
    (R, Event.DROP): F,  # out of the index, nobody reading: freed at once
    (R, Event.DROP_READ): D,  # out of the index while read
    (D, Event.READ_DONE): D,
    (D, Event.LAST_READ_DONE): F,  # its last reader frees it
}

Move = tuple[ChunkKey, State, Event, State]


def piece(state: State) -> Piece:
    return Piece(KEY, 0, 64, 0.0, state=state)


def test_the_table_holds_exactly_the_expected_moves_and_any_other_raises() -> None:
    assert TRANSITIONS == EXPECTED
    for state in State:
        for event in Event:
            p = piece(state)
            if (state, event) in EXPECTED:
                assert advance(p, event) is EXPECTED[(state, event)] is p.state
            else:
                with pytest.raises(LifecycleError, match=f"cannot {event.value} while "
                                                         f"{state.value}"):
                    advance(p, event)
                assert p.state is state  # an illegal move leaves it where it was
    assert issubclass(LifecycleError, ServerError)  # a bug: an internal error on the wire


def test_freed_is_final_and_only_a_resident_piece_is_read() -> None:
    assert {event for (state, event) in EXPECTED if state is F} == set()
    for event in Event:
        with pytest.raises(LifecycleError):
            advance(piece(F), event)
    for event in (Event.COMMIT, Event.READ, Event.DROP):
        with pytest.raises(LifecycleError):
            advance(piece(D), event)


def engine() -> CacheEngine:
    return CacheEngine(MemoryPool.slots(64, 4, pin=False), chunk_size=16)


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[Move]:
    """Every move the store makes, as it makes it: (key, from, event, to)."""
    out: list[Move] = []

    def recorded(p: Piece, event: Event) -> State:
        before = p.state
        after = advance(p, event)
        out.append((p.key, before, event, after))
        return after

    monkeypatch.setattr(store_module, "advance", recorded)
    return out


def test_a_store_moves_its_piece_from_writing_to_resident_or_freed(moves: list[Move]) -> None:
    e = engine()
    plan = e.store.begin_store([KEY], 64)
    [written] = e.store.inspect().writing.values()
    assert written is not None and written.state is W
    e.store.finish_store(plan)
    resident = e.store.inspect().pieces[KEY]
    assert resident.handle == written.handle and resident.state is R
    other = ChunkKey("m", opaque_layout(1), 0, 1, b"\x02" * 32)
    failed = e.store.begin_store([other], 64)
    e.store.finish_store(failed, ok=False)
    assert moves == [(KEY, W, Event.COMMIT, R), (other, W, Event.ABORT, F)]
    assert not e.store.inspect().resident(other) and e.pool.num_allocated == 1


def test_a_piece_dropped_while_read_is_freed_by_its_last_reader(moves: list[Move]) -> None:
    e = engine()
    plan = e.store.begin_store([KEY], 64)
    e.store.finish_store(plan)
    first = e.store.begin_retrieve("m", opaque_layout(1), (0, 1), [KEY.chunk_hash])
    second = e.store.begin_retrieve("m", opaque_layout(1), (0, 1), [KEY.chunk_hash])
    [[held]] = first.pieces
    assert e.store.clear(force=True) == (0, 1)  # being read: kept
    [[found]] = second.pieces
    assert e.store.condemn([found]) == 1  # found corrupt: out of the index, still read
    assert held.state is D and e.pool.num_allocated == 1
    e.store.finish_retrieve(first)
    assert held.state is D and e.pool.num_allocated == 1
    e.store.finish_retrieve(second)
    assert held.state is F and e.pool.num_allocated == 0
    with pytest.raises(LifecycleError):  # nothing can read it again
        advance(held, Event.READ)
    assert [move[1:] for move in moves] == [
        (W, Event.COMMIT, R), (R, Event.READ, R), (R, Event.READ, R),
        (R, Event.DROP_READ, D), (D, Event.READ_DONE, D), (D, Event.LAST_READ_DONE, F)]


def test_the_store_raises_every_event_the_table_names(moves: list[Move]) -> None:
    """Locks are no event (a lookup locks and a retrieve unlocks without a move); every event
    of the table is one the store raises."""
    e = engine()
    e.store.finish_store(e.store.begin_store([KEY], 64))  # COMMIT
    other = ChunkKey("m", opaque_layout(1), 0, 1, b"\x02" * 32)
    e.store.finish_store(e.store.begin_store([other], 64), ok=False)  # ABORT
    assert e.lookup("m", [GroupTarget(opaque_layout(1), ((0, 1),))], [KEY.chunk_hash], "locks") == 1
    assert e.store.inspect().pieces[KEY].locks == 1
    locking = len(moves)
    assert [move[2] for move in moves] == [Event.COMMIT, Event.ABORT]  # the lookup: no move
    plan = e.store.begin_retrieve("m", opaque_layout(1), (0, 1), [KEY.chunk_hash], "locks")
    e.store.finish_retrieve(plan)  # READ, READ_DONE; its lock goes, no move
    assert [move[2] for move in moves[locking:]] == [Event.READ, Event.READ_DONE]
    assert e.store.inspect().pieces[KEY].locks == 0
    reading = e.store.begin_retrieve("m", opaque_layout(1), (0, 1), [KEY.chunk_hash])
    assert e.store.condemn(reading.pieces[0]) == 1  # DROP_READ
    e.store.finish_retrieve(reading)  # LAST_READ_DONE
    e.store.finish_store(e.store.begin_store([KEY], 64))
    assert e.store.clear() == (1, 0)  # DROP
    assert {move[2] for move in moves} == set(Event) == {event for _, event in EXPECTED}
