"""A piece's lifecycle: its states and every transition between them, in one table.

Modelled on h11's ``_state.py``: the engine's store (``store.PieceStore``) changes a piece's state
only through ``advance``, which looks the (state, event) pair up in ``TRANSITIONS`` and raises
``LifecycleError`` for a pair the table does not hold (a bug: e.g. committing a piece twice,
reading a dropped one, freeing one still read). Locks and readers are counts on a piece, and each
change of them is an event too, so the table says in which states a piece may be locked or read.

States:

* ``WRITING``: room reserved in the pool (``begin_store``, or a tier load); invisible to lookups
  and retrieves, never evicted; a second store of its key counts it as present.
* ``RESIDENT``: committed; lookups see it. While ``locks`` > 0 it is *locked* (a lookup holds it
  for a coming retrieve) and while ``readers`` > 0 *being read* (a retrieve or a tier writer copies
  out of it, or its checksum is being taken: a store commits its pieces as soon as their bytes are
  in, each read by its hash until the digest is recorded, ``PieceStore.record_checksums``):
  eviction takes neither, nor a pinned one (``retention``).
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
    LOCK = "lock"  # a lookup locks it
    UNLOCK = "unlock"  # a retrieve, a free, a session end or a TTL releases a lock
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
    (R, Event.LOCK): R,
    (R, Event.UNLOCK): R,
    (R, Event.READ): R,
    (R, Event.READ_DONE): R,
    (R, Event.DROP): F,
    (R, Event.DROP_READ): D,
    # A dropped piece keeps the locks it had until their owners release them (nothing reads a
    # lock of a piece no longer indexed), and its readers finish.
    (D, Event.UNLOCK): D,
    (D, Event.READ_DONE): D,
    (D, Event.LAST_READ_DONE): F,
    (F, Event.UNLOCK): F,
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
