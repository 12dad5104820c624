"""The suite's own harness: ``wait_until`` and ``FakeClock`` (tests/harness.py)."""

from __future__ import annotations

import threading

import pytest

from tests.harness import FakeClock, wait_until


def test_wait_until_returns_the_first_truthy_value() -> None:
    calls = iter([None, 0, [], "ready", "later"])
    assert wait_until(lambda: next(calls)) == "ready"


def test_wait_until_sees_what_another_thread_does() -> None:
    done = threading.Event()
    threading.Timer(0.05, done.set).start()
    assert wait_until(done.is_set) is True


def test_wait_until_fails_the_test_past_its_timeout_saying_what() -> None:
    log = ["nothing yet"]
    with pytest.raises(AssertionError, match=r"the server's log: nothing yet: not met within 0.05 s"):
        wait_until(lambda: False, 0.05, lambda: f"the server's log: {log[0]}")
    with pytest.raises(AssertionError, match="the condition: not met"):
        wait_until(lambda: None, 0.01)


def test_a_predicate_that_raises_ends_the_wait_with_its_error() -> None:
    def broken() -> bool:
        raise RuntimeError("the server exited")

    with pytest.raises(RuntimeError, match="the server exited"):
        wait_until(broken)


def test_the_fake_clock_moves_only_when_advanced(fake_clock: FakeClock) -> None:
    start = fake_clock()
    assert fake_clock() == start
    assert fake_clock.advance(1.5) == start + 1.5 == fake_clock()
    with pytest.raises(ValueError, match="does not go back"):
        fake_clock.advance(-1)
    assert FakeClock(7.0)() == 7.0
