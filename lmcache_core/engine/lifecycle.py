"""A piece's lifecycle: its states and every transition between them, in one table.

Modelled on h11's ``_state.py``: the engine's store (``store.PieceStore``) changes a piece's state
only through ``advance``, which looks the (state, event) pair up in ``TRANSITIONS`` and raises
``LifecycleError`` for a pair the table does not hold (a bug: e.g. committing a piece twice,
reading a dropped one, freeing one still read). Every event the table names is one the store
raises wherever it happens, and nowhere else (``tests/unit/test_lifecycle.py`` holds the table's
moves written out, and drives real pieces through them).

Readers are in the table: a reader count decides a move (a piece dropped while read is freed by
its last reader, ``LAST_READ_DONE``, never before), so each reader's start and end is an event.
Locks are not: a lock is a lookup's claim on a resident piece for its coming retrieve, which
eviction respects (as it respects a pin, ``retention``); it never moves a piece nor holds its
bytes (a piece dropped while locked, by a forced clear or as corrupt, is freed as soon as nobody
reads it; its owner's lock goes with its lookup id, ``locks.LockTable``). So locking is no move
of a piece's life: a lookup locks what it found in the index, which is resident by construction,
and the table would only repeat that.

States:

* ``WRITING``: room reserved in the pool (``begin_store``, or a tier load); invisible to lookups
  and retrieves, never evicted; a second store of its key counts it as present.
* ``RESIDENT``: committed; lookups see it. While ``readers`` > 0 it is *being read* (a retrieve or
  a tier writer copies out of it, or its checksum is being taken: a store commits its pieces as
  soon as their bytes are in, each read by its hash until the digest is recorded,
  ``PieceStore.record_checksums``): eviction never takes it, nor a locked or pinned one.
* ``DROPPED``: out of the index (evicted, condemned as corrupt, cleared, its checksum given up)
  while a reader still copies out of it (or its hash reads it); its pool bytes are freed by the
  last reader's release, so no slot is reused under a hash.
* ``FREED``: its pool bytes are given back (a final state).

Which pieces may go, and in what order, is eviction's business (``eviction``, ``retention``);
this table only says which moves are legal.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

from lmcache_core.errors import LifecycleError


class State(Enum):
    WRITING = "writing"
    RESIDENT = "resident"
    DROPPED = "dropped"
    FREED = "freed"


class Event(Enum):
    COMMIT = "commit"  # its bytes are in: visible to lookups (its checksum taken, or being taken)
    ABORT = "abort"  # its store or load failed: room freed, never seen
    READ = "read"  # a reader starts copying out of it (or its hash, at commit, reading it)
    READ_DONE = "read_done"  # a reader is done (not its last, or it is still indexed)
    LAST_READ_DONE = "last_read_done"  # the last reader of a dropped piece is done: freed
    DROP = "drop"  # out of the index with nobody reading it: freed at once
    DROP_READ = "drop_read"  # out of the index while read: freed by its last reader


W, R, D, F = State.WRITING, State.RESIDENT, State.DROPPED, State.FREED

#: (state, event) -> the next state; every legal move of a piece, and no other.
TRANSITIONS: dict[tuple[State, Event], State] = {
    (W, Event.COMMIT): R,
    (W, Event.ABORT): F,
    (R, Event.READ): R,
    (R, Event.READ_DONE): R,
    (R, Event.DROP): F,
    (R, Event.DROP_READ): D,
    # A dropped piece's readers finish; the last one frees it.
    (D, Event.READ_DONE): D,
    (D, Event.LAST_READ_DONE): F,
}


class HasState(Protocol):
    state: State


def advance(piece: HasState, event: Event) -> State:
    """Move ``piece`` by ``event`` (``TRANSITIONS``); LifecycleError when the table has no such
    move from its state."""
    try:
        piece.state = TRANSITIONS[(piece.state, event)]
    except KeyError:
        raise LifecycleError(f"a piece cannot {event.value} while {piece.state.value}") from None
    return piece.state
