"""The I/O machinery both clients share: the transport client (a DEALER to the server) and the
async lookup client (PUSH/PULL to every TP worker's lookup server) plug in only their sockets.

- ``IOThread``: one background thread that waits in the OS poller on a ``Waker`` and, while its
  owner asks for it, on one zmq socket's ``ZMQ_FD``, never inside a zmq call. Each round it runs
  the owner's ``turn`` (receive, expire, decide how long to wait and whether to watch the socket);
  it is supervised: an exception is logged and kept in ``error``, and the owner's ``on_exit`` (fail
  what is pending, close the socket) runs however the thread ends, so a dead thread is never silent.
- ``PendingRequests``: requests in flight by id, with their deadlines in a heap; what passes its
  deadline, or is still there at shutdown, is handed back for the owner to fail.
- ``ThreadWaiters``: each caller thread's own waker and pollers, for callers that wait on (and
  receive from) the socket on their own thread: a reply then reaches them without a thread hop.
- ``receive_ready``: what the socket holds now, by non-blocking receives to EAGAIN (so the
  edge-triggered ``ZMQ_FD`` signals the next message) or a batch limit.
"""

from __future__ import annotations

import heapq
import logging
import select
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, NamedTuple, TypeVar

import zmq

from lmcache_core.transport.sending import recv_frames
from lmcache_core.transport.waker import Waker

logger = logging.getLogger(__name__)
E = TypeVar("E")
# Plain ints: ``int & zmq.POLLIN`` builds an IntFlag through enum's Python code (~1 us a poll).
POLLIN = int(zmq.POLLIN)
EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)

#: What an owner's turn returns: how long to wait (ms, -1: until woken) and whether to watch the
#: socket meanwhile; None ends the thread.
Turn = Callable[[], "tuple[int, bool] | None"]


class IOThread:
    """The owner's background loop; see the module docstring."""

    def __init__(self, name: str, zmq_fd: Any, turn: Turn, on_exit: Callable[[], None],
                 what: str, always_fd: Any = None) -> None:
        """``always_fd``: another descriptor to wait on in every round (a socket monitor's
        ``ZMQ_FD``), whatever the owner says of the socket's."""
        self.waker = Waker()
        self.error: BaseException | None = None
        self._zmq_fd = zmq_fd
        self._always_fd = always_fd
        self._turn = turn
        self._on_exit = on_exit
        self._what = what
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self.waker.wake()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end (after the owner's turn returned None); True if it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        waker = self.waker
        waker_fd = waker.fd
        poller = select.poll()
        poller.register(waker_fd, select.POLLIN)
        if self._always_fd is not None:
            poller.register(self._always_fd, select.POLLIN)
        watching = False
        try:
            while True:
                step = self._turn()
                if step is None:
                    break
                timeout_ms, watch = step
                if watch != watching:
                    # Registering after a turn that read to EAGAIN: ZMQ_FD signals what comes next.
                    if watch:
                        poller.register(self._zmq_fd, select.POLLIN)
                    else:
                        poller.unregister(self._zmq_fd)
                    watching = watch
                for fd, _ in poller.poll(timeout_ms):
                    if fd == waker_fd:
                        waker.drain()
        except Exception as exc:  # the thread must never die silently
            self.error = exc
            logger.exception("%s: I/O thread %s failed", self._what, self._thread.name)
        finally:
            try:
                self._on_exit()
            finally:
                waker.close()


class PendingRequests(Generic[E]):
    """Requests in flight: ``entries`` by id; deadlines in a heap (stale ones skipped lazily).

    Not thread-safe: the owner calls it under its own lock."""

    def __init__(self, idle_wake_s: float) -> None:
        self.entries: dict[int, E] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._idle_wake_s = idle_wake_s
        #: The latest time the I/O thread looks at the deadlines again (``wait_ms`` sets it).
        self.next_wake = 0.0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, uid: int, entry: E, deadline: float | None) -> None:
        """Track ``entry``; ``deadline`` None: its caller enforces its own."""
        self.entries[uid] = entry
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, uid))

    def pop(self, uid: int) -> E | None:
        return self.entries.pop(uid, None)

    def expired(self, now: float) -> list[E]:
        """Remove and return what is past its deadline."""
        out: list[E] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, uid = heapq.heappop(deadlines)
            entry = self.entries.pop(uid, None)
            if entry is not None:
                out.append(entry)
        return out

    def wait_ms(self, now: float) -> int:
        """Until the first deadline (at most ``idle_wake_s`` with none), in whole ms, rounded up."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][1] not in self.entries:
            heapq.heappop(deadlines)
        self.next_wake = deadlines[0][0] if deadlines else now + self._idle_wake_s
        return max(0, int((self.next_wake - now) * 1000) + 1)

    def take_all(self) -> list[E]:
        """Remove and return everything (shutdown)."""
        out = list(self.entries.values())
        self.entries.clear()
        self._deadlines.clear()
        return out


class Waiter(NamedTuple):
    """A waiting caller thread's own waker, a poller of the socket and that waker, and a poller of
    the waker alone (for when the socket is closed)."""

    waker: Waker
    poller: Any  # select.poll
    waker_only: Any  # select.poll

    def wait(self, timeout_ms: int, socket: bool = True) -> None:
        """Block until the socket signals, the waker rings or ``timeout_ms`` passed."""
        waker = self.waker
        for fd, _ in (self.poller if socket else self.waker_only).poll(timeout_ms):
            if fd == waker.fd:
                waker.drain()


class ThreadWaiters:
    """Each caller thread's ``Waiter`` on one socket's ``ZMQ_FD`` (made on its first wait)."""

    def __init__(self, zmq_fd: Any) -> None:
        self._zmq_fd = zmq_fd
        self._local = threading.local()

    def mine(self) -> Waiter:
        waiter: Waiter | None = getattr(self._local, "waiter", None)
        if waiter is None:
            waker = Waker()
            poller = select.poll()
            poller.register(self._zmq_fd, select.POLLIN)
            poller.register(waker.fd, select.POLLIN)
            waker_only = select.poll()
            waker_only.register(waker.fd, select.POLLIN)
            waiter = self._local.waiter = Waiter(waker, poller, waker_only)
        return waiter


def receive_ready(sock: zmq.Socket[Any], limit: int, multipart: bool) -> list[Any]:
    """Up to ``limit`` messages the socket holds now (frame lists if ``multipart``), by
    non-blocking receives; asking ``EVENTS`` until it lacks ``POLLIN`` re-arms ``ZMQ_FD``."""
    out: list[Any] = []
    if not int(sock.getsockopt(EVENTS)) & POLLIN:  # the common case of a poll: nothing in
        return out
    recv = partial(recv_frames, sock) if multipart else sock.recv
    for _ in range(limit):
        try:
            out.append(recv(_NOBLOCK))
        except zmq.Again:
            break
        if not int(sock.getsockopt(EVENTS)) & POLLIN:
            break
    return out
