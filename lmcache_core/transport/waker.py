"""A file descriptor other threads write to wake a zmq poll loop (ZMQ sockets are single-threaded).

One ``eventfd`` per loop: ``wake()`` from any thread, ``drain()`` from the loop after it polled
readable. Cheaper than an inproc socket pair and needs no socket per caller thread.
"""

from __future__ import annotations

import os


class Waker:
    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def wake(self) -> None:
        try:
            os.eventfd_write(self.fd, 1)
        except (BlockingIOError, OSError):  # counter saturated or closed: a wake-up is pending anyway
            pass

    def drain(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
