"""``MessagingFuture``: the handle a caller holds for one request in flight.

A small thread-safe future with the seed's ``query()``; a timed-out wait raises
``LMCacheTimeoutError``. Lighter than ``concurrent.futures.Future`` on the paths a scheduler polls:
``query()`` is one attribute read (no lock; 0.1 us against 0.5 us), and settling one costs no
condition variable unless a thread is actually waiting in ``result`` (5 us -> ~1 us per request).

A future may carry a ``driver``: what a thread waiting in ``result``/``exception`` runs instead of
sleeping on an event. The transport client gives one to the futures of ``polled`` requests, whose
replies no background thread watches for: a waiter then receives them itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from lmcache_core.errors import LMCacheTimeoutError

T = TypeVar("T")
logger = logging.getLogger(__name__)

_PENDING, _DONE, _FAILED = 0, 1, 2
#: Guards every future's state change against waiters and callbacks being added. Held for a few
#: attribute writes only, never while a callback runs or a thread waits.
_LOCK = threading.Lock()
#: A driven wait "without timeout" (the request's own deadline settles the future before it).
_FOREVER_S = 365 * 86400.0


class MessagingFuture(Generic[T]):
    """The eventual reply of one request: a result, or the error the server or transport reported."""

    __slots__ = ("_callbacks", "_event", "_state", "_value", "description", "driver")

    def __init__(self, description: str = "request") -> None:
        self._state = _PENDING
        self._value: Any = None
        self._event: threading.Event | None = None  # made only when a thread waits
        self._callbacks: list[Callable[[MessagingFuture[T]], object]] | None = None
        self.description = description
        #: ``driver(future, timeout_s) -> done``: waits by doing the work that settles the future
        #: (receiving its reply on the waiting thread); None: sleep until another thread settles it.
        self.driver: Callable[[MessagingFuture[T], float], bool] | None = None

    def query(self) -> bool:
        """True once the reply (or an error) is in; never blocks."""
        return self._state != _PENDING

    done = query

    def result(self, timeout: float | None = None) -> T:
        """The reply, waiting at most ``timeout`` seconds (the client's request deadline bounds a
        ``None`` wait too). Raises the server's error, or ``LMCacheTimeoutError``."""
        if self._state == _PENDING and not self._wait(timeout):
            raise LMCacheTimeoutError(f"{self.description}: no reply within {timeout:.3g}s")
        if self._state == _FAILED:
            raise self._value
        value: T = self._value
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._state == _PENDING and not self._wait(timeout):
            raise LMCacheTimeoutError(f"{self.description}: no reply within {timeout:.3g}s")
        return self._value if self._state == _FAILED else None

    def _wait(self, timeout: float | None) -> bool:
        if timeout is not None and timeout <= 0:
            return False
        if self.driver is not None:
            return self.driver(self, _FOREVER_S if timeout is None else timeout)
        with _LOCK:
            if self._state != _PENDING:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def add_done_callback(self, fn: Callable[[MessagingFuture[T]], object]) -> None:
        """Call ``fn(self)`` once done: at once if it already is, else on the thread that settles it
        (usually the client's I/O thread, or a caller receiving replies itself). An exception from
        ``fn`` is logged, not raised."""
        with _LOCK:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def set_result(self, value: T) -> None:
        self._settle(_DONE, value)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(_FAILED, exc)

    def _settle(self, state: int, value: Any) -> None:
        with _LOCK:
            if self._state != _PENDING:
                return
            self._value = value
            self._state = state
            event, callbacks = self._event, self._callbacks
            self._callbacks = None
        if event is not None:
            event.set()
        if callbacks:
            for fn in callbacks:
                _call(fn, self)

    @classmethod
    def completed(cls, value: T, description: str = "request") -> MessagingFuture[T]:
        future: MessagingFuture[T] = cls(description)
        future._state, future._value = _DONE, value
        return future

    @classmethod
    def failed(cls, exc: BaseException, description: str = "request") -> MessagingFuture[T]:
        future: MessagingFuture[T] = cls(description)
        future._state, future._value = _FAILED, exc
        return future

    def __repr__(self) -> str:
        state = {_PENDING: "pending", _DONE: "done", _FAILED: "failed"}[self._state]
        return f"<MessagingFuture {self.description}: {state}>"


def _call(fn: Callable[[Any], object], future: MessagingFuture[Any]) -> None:
    try:
        fn(future)
    except Exception:
        logger.exception("a done-callback of %s raised", future.description)
