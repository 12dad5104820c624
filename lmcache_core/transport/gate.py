"""``Gate``: parks requests until what they wait for is done, polled by one thread.

A store on a GPU host may arrive while the worker's forward pass is still running: its copies must
wait for the worker's CUDA event. Waiting on a worker thread would hold it for the whole pass (one
store per GPU could hold them all), so the transport parks such a request here instead; one thread
polls every parked ``query()`` and hands the request back to the workers once it is done, or once
its deadline passed (then it is answered with a timeout, nothing copied). Polling backs off from
20 us to 1 ms while nothing completes, and sleeps on a condition (bounded) while nothing is parked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 1e-3
_IDLE_WAIT_S = 1.0  # an idle gate re-checks for a stop at least this often


class Waitable(Protocol):
    def query(self) -> bool: ...


class Gate(Generic[T]):
    """Holds ``(item, waitable, deadline)`` until ``waitable.query()`` or the deadline; then calls
    ``release(item, expired)`` on the gate's thread (``run``)."""

    def __init__(self, release: Callable[[T, bool], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._release = release
        self._clock = clock
        self._cond = threading.Condition()
        self._parked: list[tuple[T, Waitable, float]] = []
        self._stopping = False

    def park(self, item: T, waitable: Waitable, timeout_s: float) -> None:
        """Hold ``item`` until ``waitable`` is done or ``timeout_s`` passed."""
        with self._cond:
            self._parked.append((item, waitable, self._clock() + timeout_s))
            self._cond.notify()

    def __len__(self) -> int:
        with self._cond:
            return len(self._parked)

    def stop(self) -> None:
        """End ``run`` (what is still parked is dropped: its clients are gone with the socket)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def run(self) -> None:
        """The gate's thread: poll, release, back off; until ``stop``."""
        pause = _POLL_FIRST_S
        while True:
            with self._cond:
                while not self._parked and not self._stopping:
                    self._cond.wait(_IDLE_WAIT_S)
                if self._stopping:
                    return
                parked = list(self._parked)
            if self.poll_once(parked):
                pause = _POLL_FIRST_S
            else:
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)

    def poll_once(self, parked: list[tuple[T, Waitable, float]] | None = None) -> int:
        """Release what is done or past its deadline; returns how many were released."""
        if parked is None:
            with self._cond:
                parked = list(self._parked)
        now = self._clock()
        done: list[tuple[tuple[T, Waitable, float], bool]] = []
        for entry in parked:
            if _done(entry[1]):
                done.append((entry, False))
            elif now >= entry[2]:
                done.append((entry, True))
        if not done:
            return 0
        with self._cond:
            gone = {id(entry) for entry, _ in done}
            self._parked = [e for e in self._parked if id(e) not in gone]
        for (item, _, _), expired in done:
            self._release(item, expired)
        return len(done)


def _done(waitable: Waitable) -> bool:
    """``query()``; an error counts as done (the request then meets it and is answered with it)."""
    try:
        return bool(waitable.query())
    except Exception:
        logger.debug("a parked request's query() raised", exc_info=True)
        return True
