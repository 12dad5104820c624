"""Event waits off the copy threads (issue 16, finding 5): the transport's ``Gate``.

A store whose worker event has not completed is parked in the gate, not waited for on a worker
thread: with one worker, other long requests are served meanwhile. A parked request is served once
its event completes, or answered with a timeout (nothing copied) when its deadline passes. Fake
events stand in for CUDA ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_core.errors import ServerError
from lmcache_core.protocol import RequestType
from lmcache_core.protocol import messages as m
from lmcache_core.transport import MessageQueueClient, MessageQueueServer, Route
from lmcache_core.transport.gate import Gate
from tests.harness import wait_until


class Flag:
    """A fake event: done once ``set``."""

    def __init__(self, done: bool = False) -> None:
        self.done = threading.Event()
        if done:
            self.done.set()
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done.is_set()


class Broken:
    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


# ---------------------------------------------------------------- the gate alone


def test_gate_releases_what_completes_and_expires_the_rest() -> None:
    now = [0.0]
    released: list[tuple[str, bool]] = []
    gate: Gate[str] = Gate(lambda item, expired: released.append((item, expired)),
                           clock=lambda: now[0])
    late, soon = Flag(), Flag()
    gate.park("late", late, 5.0)
    gate.park("soon", soon, 5.0)
    gate.park("broken", Broken(), 5.0)
    assert gate.poll_once() == 1 and released == [("broken", False)]  # its handler meets the error
    soon.done.set()
    assert gate.poll_once() == 1 and released[-1] == ("soon", False)
    now[0] = 5.0
    assert gate.poll_once() == 1 and released[-1] == ("late", True)
    assert len(gate) == 0


def test_gate_thread_stops_within_its_bounded_idle_wait() -> None:
    gate: Gate[str] = Gate(lambda item, expired: None)
    thread = threading.Thread(target=gate.run)
    thread.start()
    gate.park("x", Flag(done=True), 1.0)
    wait_until(lambda: len(gate) == 0)
    gate.stop()
    thread.join(2.0)
    assert not thread.is_alive()


# ---------------------------------------------------------------- in the transport


@pytest.fixture
def served(tmp_path: Any) -> Iterator[tuple[MessageQueueServer, dict[int, Flag], list[int]]]:
    """One worker thread; STORE's gate waits on ``events[instance_id]`` (if any)."""
    events: dict[int, Flag] = {}
    handled: list[int] = []

    def gate(p: m.StoreRequest) -> tuple[Flag, float] | None:
        flag = events.get(p.instance_id)
        return None if flag is None else (flag, 0.5 if p.instance_id == 99 else 10.0)

    def store(p: m.StoreRequest, _c: bytes) -> m.StoreReply:
        flag = events.get(p.instance_id)
        assert flag is None or flag.done.is_set()  # served only once its event completed
        handled.append(p.instance_id)
        return m.StoreReply(stored=len(p.chunk_hashes))

    server = MessageQueueServer(f"ipc://{tmp_path}/g.sock", workers=1)
    server.start({RequestType.STORE: Route(store, blocking=True, gate=gate)})
    yield server, events, handled
    server.stop(1.0)
    assert server._gate_thread is not None and not server._gate_thread.is_alive()


def _store(client: MessageQueueClient, instance_id: int) -> Any:
    return client.request_async(m.StoreRequest(
        instance_id=instance_id, chunk_hashes=[b"x" * 32], block_ids=[0], event_handle=b"e"))


def test_a_parked_store_holds_no_worker_thread(served: Any) -> None:
    server, events, handled = served
    events[1] = Flag()
    with MessageQueueClient(server.bound_url) as client:
        waiting = _store(client, 1)
        others = [_store(client, 2 + i) for i in range(3)]  # one worker: served meanwhile
        for future in others:
            assert future.result(5).stored == 1
        assert not waiting.query() and handled == [2, 3, 4]
        events[1].done.set()
        assert waiting.result(5).stored == 1
    assert handled == [2, 3, 4, 1]


def test_a_store_whose_event_never_completes_is_answered_with_a_timeout(served: Any) -> None:
    server, events, handled = served
    events[99] = Flag()  # its gate deadline is 0.5 s
    with MessageQueueClient(server.bound_url) as client:
        started = time.monotonic()
        with pytest.raises(ServerError, match="did not complete in time; nothing was copied"):
            _store(client, 99).result(5)
        assert 0.4 < time.monotonic() - started < 5.0  # at its 0.5 s deadline (10x)
    assert handled == []  # the handler never ran: no copy was queued


def test_a_completed_event_is_not_parked(served: Any) -> None:
    server, events, handled = served
    events[5] = Flag(done=True)
    with MessageQueueClient(server.bound_url) as client:
        assert _store(client, 5).result(5).stored == 1
    assert events[5].queries == 1 and len(server._gate) == 0 and handled == [5]
