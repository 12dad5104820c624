"""``MessagingFuture``: the handle a caller holds for one request in flight.

A thin typed wrapper over ``concurrent.futures.Future`` (well tested, thread-safe) that adds the
seed's ``query()`` and turns a timed-out wait into ``LMCacheTimeoutError``.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Generic, TypeVar

from lmcache_core.errors import LMCacheTimeoutError

T = TypeVar("T")


class MessagingFuture(Generic[T]):
    """The eventual reply of one request: a result, or the error the server or transport reported."""

    __slots__ = ("_future", "description")

    def __init__(self, description: str = "request") -> None:
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.description = description

    def query(self) -> bool:
        """True once the reply (or an error) is in; never blocks."""
        return self._future.done()

    done = query

    def result(self, timeout: float | None = None) -> T:
        """The reply, waiting at most ``timeout`` seconds (the client's request deadline bounds a
        ``None`` wait too). Raises the server's error, or ``LMCacheTimeoutError``."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise LMCacheTimeoutError(
                f"{self.description}: no reply within {timeout:.3g}s") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return self._future.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise LMCacheTimeoutError(
                f"{self.description}: no reply within {timeout:.3g}s") from None

    def add_done_callback(self, fn: Callable[[MessagingFuture[T]], object]) -> None:
        """Call ``fn(self)`` once done: at once if it already is, else on the client's I/O thread."""
        self._future.add_done_callback(lambda _f: fn(self))

    def set_result(self, value: T) -> None:
        if not self._future.done():
            self._future.set_result(value)

    def set_exception(self, exc: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(exc)

    @classmethod
    def completed(cls, value: T, description: str = "request") -> MessagingFuture[T]:
        future: MessagingFuture[T] = cls(description)
        future.set_result(value)
        return future

    @classmethod
    def failed(cls, exc: BaseException, description: str = "request") -> MessagingFuture[T]:
        future: MessagingFuture[T] = cls(description)
        future.set_exception(exc)
        return future
