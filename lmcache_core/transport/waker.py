"""A file descriptor other threads write to wake a zmq poll loop (ZMQ sockets are single-threaded).

One ``eventfd`` per loop: ``wake()`` from any thread, ``drain()`` from the loop after it polled
readable. Cheaper than an inproc socket pair and needs no socket per caller thread.
"""

from __future__ import annotations

import contextlib
import os
import threading


class Waker:
    def __init__(self) -> None:
        # ``wake`` and ``close`` hold it: a wake from another thread writes to this eventfd or
        # not at all (never to a descriptor that reused its number after ``close``).
        self._lock = threading.Lock()
        self.fd = -1
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def wake(self) -> None:
        # A saturated counter (or a closed loop) means a wake-up is pending or pointless anyway.
        with self._lock:
            if self.fd < 0:
                return
            with contextlib.suppress(BlockingIOError, OSError):
                os.eventfd_write(self.fd, 1)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def close(self) -> None:
        with self._lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def __del__(self) -> None:  # per-thread wakers of waiting callers go with their thread
        self.close()
