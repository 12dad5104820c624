"""The scheduler client's record of one request's lookup, its states, and the one table of moves.

A request id has at most one ``Lookup`` record, from its first lookup (or ``end_session``) until
nothing about it is left to track. The state says what the scheduler client has decided about the
request; whether the server answered is the lookup future's own ``query()``:

============  ===========================================================================
state         meaning
============  ===========================================================================
IDLE          no record (the client keeps none in this state)
SUBMITTED     a lookup is out (or queued behind the lookup that carries this id's release);
              ``check_lookup_result`` gives None until its answer, then its hit, which the
              server keeps locked for the load
DECLINED      the answer was a hit whose load is under ``min_hit_tokens``: 0 from now on, and
              its locks were released at once
GIVEN_UP      no answer within ``lookup_timeout_s``: 0 from now on (the engine recomputes);
              whatever the lookup locks is freed once it lands
FORGOTTEN     ``cleanup_lookup_result`` came before the answer: kept until the answer lands,
              so that a release of the id goes out behind it, never ahead
ENDING        ``end_session`` of an answered lookup: the release waits in the outbox to ride
              on the next lookup (``LookupRequest.ended``), or goes alone after a while
RIDING        the id's release rides on a lookup in flight (``carrier``): a new lookup of the
              id waits for it to land (a tiered server runs lookups on several threads)
============  ===========================================================================

``TRANSITIONS[state][event]`` is the state an event moves a record to; an event a state does not
list is a bug, and ``Lookup.move`` raises on it. Besides its state, a record may hold two things
that outlive a state: ``released`` (its id's ended session, waiting in the outbox while the id is
looked up again) and ``carrier`` (the lookup in flight its release rides on). A record that moves
to IDLE is dropped, unless one of them still holds: it stays ENDING while its release waits in
the outbox, else RIDING while its release rides on a lookup in flight.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from lmcache_core.protocol import messages as m
from lmcache_core.transport.future import MessagingFuture


class LookupState(enum.Enum):
    IDLE = "idle"
    SUBMITTED = "submitted"
    DECLINED = "declined"
    GIVEN_UP = "given up"
    FORGOTTEN = "forgotten"
    ENDING = "ending"
    RIDING = "riding"


class LookupEvent(enum.Enum):
    SUBMIT = "maybe_submit_lookup_request: no lookup of the id is held"
    DECLINE = "check_lookup_result: a hit whose load is under min_hit_tokens"
    GIVE_UP = "check_lookup_result: no answer by the deadline"
    FORGET = "cleanup_lookup_result before the answer"
    DROP = "cleanup_lookup_result after the answer"
    LAND = "the answer of a forgotten lookup came"
    END_BEHIND = "end_session while the lookup is in flight: the release goes alone behind it"
    END = "end_session with no lookup in flight: the release waits to ride"
    RIDE = "a lookup took the outbox: the release rides on it"
    SEND_ALONE = "the release went alone (RELEASE_RIDE_S passed, a full outbox, a waiter, close)"
    CARRIER_LANDS = "the lookup the release rode on was answered"


S, E = LookupState, LookupEvent
#: Every move a record may make, by state and event (IDLE: the record is dropped).
TRANSITIONS: dict[LookupState, dict[LookupEvent, LookupState]] = {
    S.IDLE: {E.SUBMIT: S.SUBMITTED, E.END: S.ENDING},
    S.SUBMITTED: {E.DECLINE: S.DECLINED, E.GIVE_UP: S.GIVEN_UP, E.FORGET: S.FORGOTTEN,
                  E.DROP: S.IDLE, E.END_BEHIND: S.IDLE, E.END: S.ENDING},
    S.DECLINED: {E.DROP: S.IDLE, E.END: S.ENDING},
    S.GIVEN_UP: {E.FORGET: S.FORGOTTEN, E.DROP: S.IDLE, E.END_BEHIND: S.IDLE, E.END: S.ENDING},
    S.FORGOTTEN: {E.SUBMIT: S.SUBMITTED, E.LAND: S.IDLE, E.END_BEHIND: S.IDLE, E.END: S.ENDING},
    S.ENDING: {E.SUBMIT: S.SUBMITTED, E.END: S.ENDING, E.RIDE: S.RIDING, E.SEND_ALONE: S.IDLE},
    S.RIDING: {E.SUBMIT: S.SUBMITTED, E.END: S.ENDING, E.CARRIER_LANDS: S.IDLE},
}
#: The states whose lookup is the request's current one (``check_lookup_result`` reads it, and a
#: second ``maybe_submit_lookup_request`` sends nothing).
HELD = frozenset({S.SUBMITTED, S.DECLINED, S.GIVEN_UP})
#: The states that keep a lookup future, which a release of the id goes behind while in flight.
WITH_LOOKUP = HELD | {S.FORGOTTEN}


@dataclass(eq=False, slots=True)
class Lookup:
    """One request id's record (see the module docstring for its states)."""

    request_id: str
    state: LookupState = S.IDLE
    #: The lookup (WITH_LOOKUP states): the current one, or in FORGOTTEN the one forgotten.
    future: MessagingFuture[m.LookupReply] | None = None
    #: SUBMITTED: when the scheduler stops waiting for the answer (on the client's clock).
    deadline: float = math.inf
    #: The future ``end_session`` returned, while the release waits in the outbox.
    released: MessagingFuture[m.ReleasedReply] | None = None
    #: The lookup in flight that this id's release rides on (set until it lands).
    carrier: MessagingFuture[m.LookupReply] | None = None

    def move(self, event: LookupEvent) -> LookupState:
        """Take the move ``TRANSITIONS`` gives for ``event`` (RuntimeError if none), and drop
        what the new state does not keep: the lookup and its deadline. A move to IDLE stays
        ENDING while the id's release waits in the outbox, RIDING while it rides on a lookup in
        flight."""
        after = TRANSITIONS[self.state].get(event)
        if after is None:
            raise RuntimeError(f"lookup of {self.request_id!r}: {event.value} is no move from "
                               f"{self.state.value}")
        if after is S.IDLE and self.released is not None:
            after = S.ENDING
        elif after is S.IDLE and self.carrier is not None and not self.carrier.query():
            after = S.RIDING
        if after not in WITH_LOOKUP:
            self.future = None
        if after is not S.SUBMITTED:
            self.deadline = math.inf
        self.state = after
        return after
