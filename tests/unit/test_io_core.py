"""The I/O core both clients share: deadlines, the supervised I/O thread, and a client whose I/O
thread dies failing what waits on it instead of leaving it hanging."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from lmcache_core.errors import ConnectionClosedError
from lmcache_core.protocol import messages as m
from lmcache_core.transport.client import MessageQueueClient
from lmcache_core.transport.io_core import IOThread, PendingRequests, ThreadWaiters, receive_ready
from tests.harness import wait_until


def test_pending_requests_expire_in_deadline_order_and_skip_answered_ones():
    table: PendingRequests[str] = PendingRequests(idle_wake_s=1.0)
    table.add(1, "a", 10.0)
    table.add(2, "b", 5.0)
    table.add(3, "c", None)  # its caller keeps its own deadline
    assert table.pop(2) == "b"
    assert table.wait_ms(4.0) == 6001  # to a's deadline (b's is skipped), rounded up
    assert table.next_wake == 10.0
    assert table.expired(9.9) == [] and table.expired(10.0) == ["a"]
    assert table.wait_ms(11.0) == 1001 and len(table) == 1
    assert table.take_all() == ["c"] and len(table) == 0


def test_an_io_thread_that_raises_is_logged_kept_and_still_runs_its_exit(caplog):
    exited = threading.Event()
    turns = []

    def turn():
        turns.append(1)
        if len(turns) == 2:
            raise RuntimeError("boom")
        return 0, False

    io = IOThread("test-io", -1, turn, exited.set, "test owner")
    io.start()
    assert io.join(5) and exited.is_set()
    assert isinstance(io.error, RuntimeError)
    assert "test owner: I/O thread test-io failed" in caplog.text
    io.wake()  # after the exit: harmless


def test_an_io_thread_waits_until_woken_and_ends_when_its_turn_says_so():
    stop = threading.Event()
    turns = []

    def turn():
        turns.append(time.monotonic())
        return None if stop.is_set() else (-1, False)

    io = IOThread("test-io", -1, turn, lambda: None, "test owner")
    io.start()
    wait_until(lambda: turns)
    time.sleep(0.05)  # (kept: a busy loop would take more turns meanwhile; a slow machine only hides it)
    assert len(turns) == 1  # blocked in poll: no busy loop
    stop.set()
    io.wake()
    assert io.join(5) and io.error is None and len(turns) == 2


def test_a_waiting_thread_wakes_on_its_socket_and_receives_what_is_ready():
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        waiter = ThreadWaiters(pull.getsockopt(zmq.FD)).mine()
        for i in range(5):
            push.send(b"%d" % i)
        got: list[bytes] = []
        end = time.monotonic() + 5
        while len(got) < 5 and time.monotonic() < end:
            got += receive_ready(pull, 3, multipart=False)
            if len(got) < 5:
                waiter.wait(50)
        assert got == [b"0", b"1", b"2", b"3", b"4"]
        start = time.monotonic()
        threading.Timer(0.05, waiter.waker.wake).start()
        waiter.wait(60_000)  # the waker ends the wait
        assert time.monotonic() - start < 30  # woken, not at the wait's minute
    finally:
        pull.close(0)
        push.close(0)


def test_a_client_whose_io_thread_dies_fails_its_pending_requests():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)  # takes requests, never answers
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = MessageQueueClient(f"tcp://127.0.0.1:{port}", request_timeout_s=30)
    try:
        def broken() -> None:
            raise RuntimeError("injected")

        client._receive_locked = broken  # type: ignore[method-assign]
        future = client.request_async(m.PingRequest())  # wakes the thread, which dies on it
        with pytest.raises(ConnectionClosedError, match="I/O thread died"):
            future.result(5)
        with pytest.raises(ConnectionClosedError):
            client.request_async(m.PingRequest()).result(1)
    finally:
        client.close()
        router.close(0)


def test_a_waker_closes_only_after_a_wake_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread's ``wake`` that read the fd is done writing before ``close`` frees the
    number (a descriptor reusing it must never get the 8 bytes)."""
    import os

    from lmcache_core.transport.waker import Waker

    waker = Waker()
    writing, go_on = threading.Event(), threading.Event()
    real_write = os.eventfd_write

    def paused_write(fd: int, value: int) -> None:
        writing.set()
        go_on.wait(5)
        real_write(fd, value)

    monkeypatch.setattr(os, "eventfd_write", paused_write)
    waking = threading.Thread(target=waker.wake)
    waking.start()
    assert writing.wait(5)
    closing = threading.Thread(target=waker.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive()  # the fd stays open while the wake writes to it
    go_on.set()
    waking.join(5)
    closing.join(5)
    assert not closing.is_alive() and waker.fd == -1
    waker.wake()  # closed: nothing written
