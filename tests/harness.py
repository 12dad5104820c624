"""The test suite's one way to wait and its one fake clock (plain helpers; fixtures in conftest.py).

``wait_until`` is the only polling loop the tests need: a test that waits for something another
thread or process does asks for the condition itself, with a deadline that only bounds a hang (it
is never what the test measures), instead of sleeping for a time it hopes is long enough.
``FakeClock`` is what a test passes as the ``clock=`` of the code under test (the lookup client,
the scheduler adapter, the gate, the writers, the prefetch table) to make time pass without
sleeping.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: How long a wait may take before it counts as a hang: generous, because the machine may be busy;
#: a passing test never waits this long.
DEFAULT_TIMEOUT_S = 10.0
_FIRST_PAUSE_S = 0.001
_MAX_PAUSE_S = 0.02


def wait_until(predicate: Callable[[], T], timeout_s: float = DEFAULT_TIMEOUT_S,
               what: str | Callable[[], str] = "the condition") -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    Between calls it pauses 1 ms, doubling up to 20 ms (a predicate that asks a server does not
    flood it). Past ``timeout_s`` it fails the test with ``what`` (a string, or a callable giving
    one then, e.g. a server's log).
    """
    deadline = time.monotonic() + timeout_s
    pause = _FIRST_PAUSE_S
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            message = what() if callable(what) else what
            raise AssertionError(f"{message}: not met within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, _MAX_PAUSE_S)


def lookup_result(adapter: Any, request_id: str, num_computed_tokens: int = 0,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Poll a scheduler adapter's ``check_lookup_result`` until it answers, as vLLM's scheduler
    does (an answer stays put until cleaned up, so asking once more returns it)."""
    wait_until(lambda: adapter.check_lookup_result(request_id, num_computed_tokens) is not None,
               timeout_s, f"lookup {request_id} never finished")
    result = adapter.check_lookup_result(request_id, num_computed_tokens)
    assert isinstance(result, int)
    return result


class FakeClock:
    """A ``Callable[[], float]`` that stands still until ``advance``: the ``clock=`` of code under
    test. Thread-safe (the code under test reads it on its own threads)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock ``seconds`` on; returns the new time."""
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds})")
        with self._lock:
            self._now += seconds
            return self._now


def segment_name(pid: int, ns: int | None = None) -> str:
    """A shared-memory name of the project's form for process ``pid``, made here rather than by
    that process (``kv.share.new_segment_name`` names this process's own): in this run's scope,
    so only this run's servers would sweep it once ``pid`` is gone."""
    from lmcache_core.kv.shm import pid_namespace, scoped_prefix

    prefix = scoped_prefix("lmcache-test")
    return f"{prefix}-{pid}-{pid_namespace() if ns is None else ns}-{secrets.token_hex(6)}"
