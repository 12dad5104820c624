"""The scheduler client's lookup records: one table of moves, and nothing moves a record around it.

The moves themselves, against a real server, are tests/integration/test_adapters.py's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lmcache_core.client import lookups
from lmcache_core.client.lookups import TRANSITIONS, Lookup, LookupEvent, LookupState
from lmcache_core.protocol import messages as m
from lmcache_core.transport.future import MessagingFuture

S, E = LookupState, LookupEvent


def test_every_state_has_its_row_and_every_event_a_use():
    assert set(TRANSITIONS) == set(LookupState)
    used = {event for row in TRANSITIONS.values() for event in row}
    assert used == set(LookupEvent)
    assert all(target in LookupState for row in TRANSITIONS.values() for target in row.values())


def test_every_state_leads_back_to_idle():
    """No record can be stranded: from every state some moves drop it."""
    for start in LookupState:
        seen, todo = {start}, [start]
        while todo:
            for target in TRANSITIONS[todo.pop()].values():
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        assert S.IDLE in seen, start


def test_a_move_the_table_lacks_raises():
    record = Lookup("r")
    with pytest.raises(RuntimeError, match="no move from idle"):
        record.move(E.GIVE_UP)
    assert record.move(E.SUBMIT) is S.SUBMITTED
    with pytest.raises(RuntimeError, match="no move from submitted"):
        record.move(E.RIDE)
    assert record.state is S.SUBMITTED


def test_leaving_a_lookup_state_drops_the_lookup_and_its_deadline():
    record = Lookup("r")
    record.move(E.SUBMIT)
    record.future, record.deadline = MessagingFuture("lookup"), 12.5
    assert record.move(E.FORGET) is S.FORGOTTEN
    assert record.future is not None and record.deadline == float("inf")
    assert record.move(E.END_BEHIND) is S.IDLE and record.future is None


def test_a_record_stays_while_its_release_waits_or_rides():
    waiting = Lookup("w", released=MessagingFuture("end"))
    waiting.move(E.SUBMIT)
    assert waiting.move(E.DROP) is S.ENDING  # its release still waits in the outbox
    carrier: MessagingFuture[m.LookupReply] = MessagingFuture("carrier")
    riding = Lookup("r", carrier=carrier)
    riding.move(E.SUBMIT)
    assert riding.move(E.DROP) is S.RIDING  # its release rides on a lookup in flight
    carrier.set_result(m.LookupReply(hit_chunks=0))
    assert riding.move(E.CARRIER_LANDS) is S.IDLE


def test_only_the_table_moves_a_record():
    """The scheduler client never sets a record's state itself: every move is ``Lookup.move``."""
    for module in ("scheduler.py", "lookups.py"):
        tree = ast.parse((Path(lookups.__file__).parent / module).read_text())
        sets = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assign | ast.AugAssign)
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(target, ast.Attribute) and target.attr == "state"
                and not (module == "lookups.py" and isinstance(target.value, ast.Name)
                         and target.value.id == "self")]
        assert sets == [], (module, sets)
