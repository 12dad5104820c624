"""The Supervisor: a watched thread that raises, or returns while it should run, fails the server."""

from __future__ import annotations

import threading

from lmcache_core.storage.writer import BackgroundWriter
from lmcache_core.supervision import Supervisor
from tests.harness import wait_until


def _supervisor() -> tuple[Supervisor, list[str]]:
    reasons: list[str] = []
    return Supervisor(on_failure=reasons.append), reasons


def test_a_thread_that_raises_fails_the_server_once():
    supervisor, reasons = _supervisor()

    def boom() -> None:
        raise RuntimeError("injected")

    supervisor.spawn("t1", boom).join(5)
    supervisor.spawn("t2", boom).join(5)
    assert supervisor.wait_failed(0)
    assert reasons == ["thread t1 died: RuntimeError: injected"]  # the first failure wins
    assert supervisor.failure == reasons[0] and not supervisor.healthy()


def test_a_thread_that_returns_while_running_fails_the_server():
    supervisor, reasons = _supervisor()
    supervisor.spawn("quitter", lambda: None).join(5)
    assert reasons == ["thread quitter ended while the server was running"]


def test_retired_and_stopping_threads_may_end():
    supervisor, reasons = _supervisor()
    go = threading.Event()
    thread = supervisor.spawn("retiring", go.wait, 5)
    assert supervisor.healthy()
    supervisor.retire(thread)
    go.set()
    thread.join(5)
    supervisor.stopping()
    supervisor.spawn("late", lambda: None).join(5)
    assert reasons == [] and supervisor.healthy() and not supervisor.failed


def test_a_writer_thread_that_dies_is_reported_and_a_bad_batch_is_not():
    supervisor, reasons = _supervisor()
    written: list[list[int]] = []

    def write(batch: list[int]) -> None:
        if batch == [1]:
            raise ValueError("one bad chunk")  # logged; the writer goes on
        written.append(batch)

    def on_start() -> None:
        started.wait(5)

    started = threading.Event()
    writer: BackgroundWriter[int] = BackgroundWriter("test tier", "test-writer", 8, write,
                                                     on_start=on_start)
    writer.start(supervisor)
    started.set()
    writer.submit([1])
    assert writer.flush(5)  # alone, so it is a batch of its own (else [1, 2] could be one)
    writer.submit([2])
    assert writer.flush(5) and written == [[2]] and not reasons
    assert writer.stop(5) and not reasons  # a stop is not a failure

    def broken_idle() -> None:
        raise AssertionError("unreachable")

    dying: BackgroundWriter[int] = BackgroundWriter("test tier", "dying-writer", 8, write,
                                                    down=lambda: True, probe=broken_idle,
                                                    probe_interval_s=0.01)
    dying.start(supervisor)
    assert supervisor.wait_failed(5)
    wait_until(lambda: reasons)  # on_failure runs just after the failure is recorded
    assert reasons == ["thread dying-writer died: AssertionError: unreachable"]
    dying.stop(1)
