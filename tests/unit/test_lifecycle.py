"""A piece's lifecycle (engine/lifecycle.py): the one table of its states and moves, and the store
moving real pieces through it (and nothing else)."""

from __future__ import annotations

import pytest

from lmcache_core.engine import CacheEngine
from lmcache_core.engine.index import Piece
from lmcache_core.engine.lifecycle import TRANSITIONS, Event, State, advance
from lmcache_core.errors import LifecycleError, ServerError
from lmcache_core.keys import ChunkKey, opaque_layout
from lmcache_core.storage.pool import MemoryPool

KEY = ChunkKey("m", opaque_layout(1), 0, 1, b"\x01" * 32)


def piece(state: State) -> Piece:
    return Piece(KEY, 0, 64, 0.0, state=state)


def test_every_legal_move_is_in_the_table_and_any_other_raises() -> None:
    for state in State:
        for event in Event:
            p = piece(state)
            if (state, event) in TRANSITIONS:
                assert advance(p, event) is TRANSITIONS[(state, event)] is p.state
            else:
                with pytest.raises(LifecycleError, match=f"cannot {event.value} while "
                                                         f"{state.value}"):
                    advance(p, event)
                assert p.state is state  # an illegal move leaves it where it was
    assert issubclass(LifecycleError, ServerError)  # a bug: an internal error on the wire


def test_freed_is_final_and_only_a_resident_piece_is_read() -> None:
    assert {event for (state, event) in TRANSITIONS if state is State.FREED} == {Event.UNLOCK}
    assert {state for (state, event) in TRANSITIONS if event is Event.READ} == {State.RESIDENT}
    for event in (Event.COMMIT, Event.READ, Event.DROP):
        with pytest.raises(LifecycleError):
            advance(piece(State.DROPPED), event)


def engine() -> CacheEngine:
    return CacheEngine(MemoryPool.slots(64, 4, pin=False), chunk_size=16)


def test_a_store_moves_its_piece_from_writing_to_resident_or_freed() -> None:
    e = engine()
    plan = e.begin_store([KEY], 64)
    [written] = e.store.writing.pieces.values()
    assert written is not None and written.state is State.WRITING
    e.finish_store(plan)
    resident = e.store.index.get(KEY)
    assert resident is written and resident.state is State.RESIDENT
    other = ChunkKey("m", opaque_layout(1), 0, 1, b"\x02" * 32)
    failed = e.begin_store([other], 64)
    [aborted] = e.store.writing.pieces.values()
    e.finish_store(failed, ok=False)
    assert aborted is not None and aborted.state is State.FREED
    assert not e.is_resident(other) and e.pool.num_allocated == 1


def test_a_piece_dropped_while_read_is_freed_by_its_last_reader() -> None:
    e = engine()
    plan = e.begin_store([KEY], 64)
    e.finish_store(plan)
    first = e.begin_retrieve("m", opaque_layout(1), (0, 1), [KEY.chunk_hash])
    second = e.begin_retrieve("m", opaque_layout(1), (0, 1), [KEY.chunk_hash])
    [[held]] = first.pieces
    assert e.clear(force=True) == (0, 1)  # being read: kept
    [[found]] = second.pieces
    assert e.store.condemn([found]) == 1  # found corrupt: out of the index, still read
    assert held.state is State.DROPPED and e.pool.num_allocated == 1
    e.finish_retrieve(first)
    assert held.state is State.DROPPED and e.pool.num_allocated == 1
    e.finish_retrieve(second)
    assert held.state is State.FREED and e.pool.num_allocated == 0
    with pytest.raises(LifecycleError):  # nothing can read it again
        advance(held, Event.READ)
