"""``MessageQueueClient``: a DEALER socket shared by caller threads and one background I/O thread.

Callers encode and send their request themselves, under a lock (no thread hop on the way out). The
I/O thread (``io_core.IOThread``) waits on the socket's file descriptor with the OS poller, never
inside a zmq call, so it holds no socket state while a caller sends; when the descriptor fires it
takes the lock, receives every queued reply, matches replies to futures by request id and fails
requests past their deadline (``io_core.PendingRequests``). Nothing sleeps: the thread blocks only
in ``poll`` with a timeout equal to the next deadline.

A socket monitor tells the thread when the connection to the server closes: the server exited
(killed, restarted) or closed it. Its KV copies run in that process, on this host (shared memory,
CUDA IPC), so no request sent before the close can still be served: the thread fails them all at
once (``ServerUnreachableError``) instead of letting each wait out its timeout (a worker waiting
for a preempted request's stores would stall its engine that long). The socket reconnects by
itself; what is sent from then on goes to whichever server listens next.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from lmcache_core.errors import (
    ConnectionClosedError,
    LMCacheError,
    LMCacheTimeoutError,
    ServerUnreachableError,
)
from lmcache_core.protocol import messages as m
from lmcache_core.protocol import ops
from lmcache_core.protocol.codec import decode_reply, decode_uid, encode_request
from lmcache_core.protocol.ops import RequestType
from lmcache_core.transport.future import MessagingFuture
from lmcache_core.transport.io_core import (
    EVENTS,
    POLLIN,
    IOThread,
    PendingRequests,
    ThreadWaiters,
    receive_ready,
)
from lmcache_core.transport.sending import recv_frames, send_frames
from lmcache_core.transport.typed import TypedRequests

logger = logging.getLogger(__name__)
_RCVTIMEO = int(zmq.RCVTIMEO)
R = TypeVar("R", bound=m.Reply)
_RECV_BATCH = 256
_HOLD_S = 0.002  # longest a short call holds the socket waiting for its reply
_IDLE_WAKE_S = 1.0  # with nothing pending the thread still looks at the clock this often


class _Pending(NamedTuple):
    op: RequestType
    op_frame: bytes
    future: MessagingFuture[Any]
    counted: bool  # in _unattended: the I/O thread watches the socket for its reply


class MessageQueueClient(TypedRequests):
    """Sends typed requests to one lmcache server and resolves a ``MessagingFuture`` per request
    (the typed surface, ``call(ops.X, msg)``, ``request(msg)``, ..., is ``TypedRequests``).

    ``request_timeout_s`` bounds every request, so no future waits forever; ``connect_timeout_s`` is
    what ``wait_until_reachable`` (and the adapters' constructors) allow for the first answer.
    """

    def __init__(self, server_url: str, context: zmq.Context[Any] | None = None, *,
                 request_timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                 name: str = "lmcache-client") -> None:
        self.server_url = server_url
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._context = context if context is not None else zmq.Context.instance()
        self._socket = self._open_socket(server_url)
        self._uids = itertools.count()
        self._lock = threading.Lock()  # guards the socket, _pending and _closed
        self._pending: PendingRequests[_Pending] = PendingRequests(_IDLE_WAKE_S)
        self._closed = False
        # Replies nobody waits on in call() ("unattended") need the I/O thread to watch the socket;
        # while there are none it does not, so it never wakes up for, and competes with, a caller
        # that is receiving its own reply.
        self._unattended = 0
        self._watching = False
        self._sleepers = 0  # threads in ``wait``, which sleep on the socket's fd
        #: ``call_later``'s calls, a heap of (when, seq, fn); the I/O thread runs them when due.
        self._timers: list[tuple[float, int, Callable[[], object]]] = []
        self._timer_seq = itertools.count()
        zmq_fd = self._socket.getsockopt(zmq.FD)
        self._waiters = ThreadWaiters(zmq_fd)
        # Only the I/O thread touches the monitor (zmq sockets belong to one thread at a time).
        self._monitor: zmq.Socket[Any] = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._io = IOThread(name, zmq_fd, self._turn, self._shutdown,
                            f"lmcache client for {server_url}",
                            always_fd=self._monitor.getsockopt(zmq.FD))
        self._io.start()

    def _open_socket(self, url: str) -> zmq.Socket[Any]:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        try:
            sock.connect(url)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise ServerUnreachableError(f"cannot connect to {url!r}: {exc}") from None
        return sock

    # ------------------------------------------------------------------ caller side

    def submit_request(self, op: RequestType, payloads: Sequence[Any],
                       timeout_s: float | None = None, *,
                       polled: bool = False) -> MessagingFuture[Any]:
        """Send one request; returns at once. The future fails after ``timeout_s`` (default: the
        client's request timeout) if no reply came.

        ``polled``: the caller takes the reply itself by polling (``poll_replies``, as the
        scheduler adapter's ``check_lookup_result`` does), so the I/O thread is not woken to watch
        the socket for it: no thread hop, no GIL ping-pong with a polling scheduler (it cost
        ~80 us a lookup). The I/O thread still fails the future at its deadline, and still takes
        the reply when it watches the socket for another request; a thread waiting in the
        future's ``result`` receives on its own thread (``wait``)."""
        return self._submit(op, payloads, timeout_s, waited_on=False, polled=polled)[1]

    def _submit(self, op: RequestType, payloads: Sequence[Any], timeout_s: float | None,
                waited_on: bool, polled: bool = False) -> tuple[int, MessagingFuture[Any]]:
        future: MessagingFuture[Any] = MessagingFuture(f"{op.value} to {self.server_url}")
        if polled:  # no thread watches for its reply: whoever waits on it receives it
            future.driver = self.wait
        uid = next(self._uids)
        try:
            frames = encode_request(uid, op, payloads)
        except (TypeError, ValueError) as exc:
            future.set_exception(exc)
            return uid, future
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.request_timeout_s)
        with self._lock:
            error = self._send_locked(frames)
            if error is None:
                counted = not waited_on and not polled
                # a caller in _call() enforces its own deadline
                self._pending.add(uid, _Pending(op, frames[1], future, counted),
                                  None if waited_on else deadline)
                if counted:
                    self._unattended += 1
                # A send can move arrived replies into the socket without the fd firing again
                # (ZMQ_FD is edge-triggered): the thread must then receive them if some reply has
                # no one else to take it, or if another thread sleeps on that fd in ``wait`` (it
                # would sleep on past its reply: seconds, until some deadline); an early deadline
                # must shorten its wait; and it must start watching the socket once a reply has
                # no one waiting on it.
                wake = (deadline < self._pending.next_wake or (counted and not self._watching)
                        or ((self._unattended > 0 or self._sleepers > 0)
                            and bool(self._events() & POLLIN)))
        if error is not None:
            future.set_exception(error)
        elif wake:
            self._io.wake()
        return uid, future

    def _send_locked(self, frames: list[bytes]) -> LMCacheError | None:
        if self._closed:
            return ConnectionClosedError(f"client for {self.server_url} is closed")
        try:
            send_frames(self._socket, frames)
        except zmq.Again:
            return ServerUnreachableError(
                f"send queue to {self.server_url} is full: the server is not reading")
        except zmq.ZMQError as exc:
            return ServerUnreachableError(f"cannot send to {self.server_url}: {exc}")
        return None

    def _events(self) -> int:
        return int(self._socket.getsockopt(EVENTS))

    def _call(self, op: RequestType, payload: Any, reply_type: type[R],
              timeout_s: float | None = None) -> R:
        """Send one request and wait for its reply (at most the request timeout): the raw
        primitive under ``TypedRequests``, whose reply type comes from the op table."""
        timeout = timeout_s if timeout_s is not None else self.request_timeout_s
        uid, future = self._submit(op, [payload], timeout, waited_on=True)
        if not self._receive_briefly(future, min(timeout, _HOLD_S)) and not self.wait(future, timeout):
            with self._lock:
                pending = self._pop(uid)
            if pending is not None:
                future.set_exception(LMCacheTimeoutError(
                    f"{op.value} to {self.server_url}: no reply within {timeout:g}s"))
        reply = future.result(0)
        if not isinstance(reply, reply_type):
            raise LMCacheError(f"{op.value}: expected {reply_type.__name__}, got {reply!r}")
        return reply

    def _receive_briefly(self, future: MessagingFuture[Any], hold_s: float) -> bool:
        """The fast path of a short call: hold the socket for up to ``hold_s`` and block in zmq's
        own receive (no GIL, no thread hop) until our reply is in. Other threads wait at most
        ``hold_s`` to send; a slower reply is left to ``wait``."""
        done: list[_Outcome] = []
        end = time.monotonic() + hold_s
        with self._lock:
            while not self._closed and not future.query() and not any(f is future for f, _ in done):
                remaining_ms = int((end - time.monotonic()) * 1000)
                if remaining_ms <= 0:
                    break
                self._socket.setsockopt(_RCVTIMEO, remaining_ms)
                try:
                    frames = recv_frames(self._socket, 0)  # blocking, up to RCVTIMEO
                except zmq.Again:
                    break
                outcome = self._resolve(frames)
                if outcome is not None:
                    done.append(outcome)
                done += self._receive_locked()
        _settle(done)
        return future.query()

    def wait(self, future: MessagingFuture[Any], timeout_s: float) -> bool:
        """Wait until ``future`` is done (True) or ``timeout_s`` passed (False), receiving replies on
        this thread when the I/O thread is not already at it: a reply then reaches its caller
        without a hop between threads (a wake-up costs tens of microseconds)."""
        if future.query():
            return True
        mine = self._waiters.mine()
        waiter = threading.get_ident()
        # Wake this thread only from another one: when it settles the future itself (receiving in
        # poll_replies) it is not blocked, and a needless wake costs two system calls.
        future.add_done_callback(
            lambda _f: None if threading.get_ident() == waiter else mine.waker.wake())
        deadline = time.monotonic() + timeout_s
        with self._lock:  # from here on, a sender that finds a reply queued wakes the I/O thread
            self._sleepers += 1
        try:
            while not future.query():
                self.poll_replies()
                remaining = deadline - time.monotonic()
                if future.query() or remaining <= 0:
                    break
                mine.wait(max(1, int(remaining * 1000) + 1))
        finally:
            with self._lock:
                self._sleepers -= 1
        return future.query()

    def watch(self, future: MessagingFuture[Any]) -> None:
        """Have the I/O thread take ``future``'s reply as soon as it arrives: for a ``polled``
        request whose caller stopped polling but waits on its outcome (the scheduler adapter
        sends a release behind a lookup still in flight). Unwatched, its reply would wait in the
        socket until someone polls, or the I/O thread's next look (up to its deadline)."""
        with self._lock:
            entries = self._pending.entries
            # A scan: rare calls, few requests in flight.
            uid = next((uid for uid, p in entries.items() if p.future is future and not p.counted),
                       None)
            if uid is None:
                return
            entries[uid] = entries[uid]._replace(counted=True)
            self._unattended += 1
            wake = not self._watching
        if wake:
            self._io.wake()

    def call_later(self, delay_s: float, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the I/O thread once ``delay_s`` has passed (later by the thread's
        wake-up), outside the client's lock: for work a caller holds back in the hope of doing
        it on its own thread first (the scheduler adapter's ended sessions ride on its next
        lookup), ``fn`` then finds nothing left to do. An exception from it is logged; calls
        still due when the client closes are dropped."""
        at = time.monotonic() + delay_s
        with self._lock:
            if self._closed:
                return
            heapq.heappush(self._timers, (at, next(self._timer_seq), fn))
            wake = at < self._pending.next_wake  # it sleeps past ``at`` unless woken
        if wake:
            self._io.wake()

    def poll_replies(self) -> None:
        """Receive whatever replies have arrived, now, on this thread; never blocks (if the I/O
        thread holds the socket, it is receiving them anyway)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            done = [] if self._closed else self._receive_locked()
        finally:
            self._lock.release()
        _settle(done)

    def wait_until_reachable(self, timeout_s: float | None = None) -> m.PingReply:
        """Ping until the server answers; ``ServerUnreachableError`` naming the url if it never does."""
        timeout = self.connect_timeout_s if timeout_s is None else timeout_s
        try:
            return self.call(ops.PING, m.PingRequest(), timeout)
        except LMCacheTimeoutError:
            raise ServerUnreachableError(
                f"no lmcache server answered at {self.server_url} within {timeout:g}s "
                f"(start one with: lmcache serve -c <config.yaml>)") from None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the I/O thread, close the socket, fail what is still waiting. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._io.wake()
        self._io.join(timeout_s)

    def __enter__(self) -> MessageQueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ I/O thread

    def _turn(self) -> tuple[int, bool] | None:
        """One round of the I/O thread: receive, fail what passed its deadline, and say how long to
        wait and whether to watch the socket meanwhile (None: closed, the thread ends)."""
        with self._lock:
            if self._closed:
                return None
            done = self._receive_locked()
            if self._connection_closed():
                done += self._fail_all_locked(ServerUnreachableError(
                    f"the connection to {self.server_url} closed (the server exited or "
                    "restarted): no reply can come"))
            now = time.monotonic()
            done += self._expire_locked(now)
            due = self._due_timers_locked(now)
            timeout_ms = self._pending.wait_ms(now)
            if self._timers and self._timers[0][0] < self._pending.next_wake:
                self._pending.next_wake = self._timers[0][0]
                timeout_ms = max(0, int((self._timers[0][0] - now) * 1000) + 1)
            # Decided under the lock, so a submitter that sees False knows to wake us.
            self._watching = watch = self._unattended > 0
        _settle(done)  # outside the lock: done-callbacks may send requests
        for fn in due:  # so may these
            try:
                fn()
            except Exception:
                logger.exception("a call_later function of the client for %s raised",
                                 self.server_url)
        return timeout_ms, watch

    def _due_timers_locked(self, now: float) -> list[Callable[[], object]]:
        timers = self._timers
        due = []
        while timers and timers[0][0] <= now:
            due.append(heapq.heappop(timers)[2])
        return due

    def _receive_locked(self) -> list[_Outcome]:
        received = receive_ready(self._socket, _RECV_BATCH, True)
        if not received:
            return received
        if len(received) >= _RECV_BATCH:
            self._io.wake()  # more queued: come back after settling this batch
        done: list[_Outcome] = []
        for frames in received:
            outcome = self._resolve(frames)
            if outcome is not None:
                done.append(outcome)
        return done

    def _resolve(self, frames: list[bytes]) -> _Outcome | None:
        try:
            uid = decode_uid(frames[0])
        except LMCacheError as exc:
            logger.warning("dropping a reply from %s with a bad uid frame: %s", self.server_url, exc)
            return None
        pending = self._pop(uid)
        if pending is None:  # answered after its deadline, or not ours
            logger.debug("dropping a late reply for request %d", uid)
            return None
        if len(frames) < 2 or frames[1] != pending.op_frame:
            return pending.future, LMCacheError(
                f"reply to {pending.op.value} echoed another op: {frames[1:2]!r}")
        try:
            return pending.future, decode_reply(pending.op, frames[2:])
        except LMCacheError as exc:
            return pending.future, exc

    def _pop(self, uid: int) -> _Pending | None:
        pending = self._pending.pop(uid)
        if pending is not None and pending.counted:
            self._unattended -= 1
        return pending

    def _expire_locked(self, now: float) -> list[_Outcome]:
        done: list[_Outcome] = []
        for pending in self._pending.expired(now):
            if pending.counted:
                self._unattended -= 1
            done.append((pending.future, LMCacheTimeoutError(
                f"{pending.op.value} to {self.server_url}: no reply within the request timeout")))
        return done

    def _connection_closed(self) -> bool:
        """Whether the monitor reported the connection closed since the last look (its events
        read to EAGAIN: its ``ZMQ_FD``, like the socket's, signals only what comes next)."""
        closed = False
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return closed
            closed |= event["event"] == zmq.EVENT_DISCONNECTED

    def _fail_all_locked(self, error: LMCacheError) -> list[_Outcome]:
        self._unattended = 0
        return [(p.future, error) for p in self._pending.take_all()]

    def _shutdown(self) -> None:
        """The I/O thread's exit, however it ends: fail what is pending, close the socket."""
        with self._lock:
            self._closed = True
            died = self._io.error
            done = self._fail_all_locked(ConnectionClosedError(
                f"client for {self.server_url} was closed" if died is None else
                f"client for {self.server_url} closed: its I/O thread died ({died!r})"))
            self._timers.clear()
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._monitor.close(0)
            self._socket.close(0)
        _settle(done)


_Outcome = tuple[MessagingFuture[Any], Any]


def _settle(outcomes: list[_Outcome]) -> None:
    """Resolve futures: an exception fails one, anything else is its result."""
    for future, value in outcomes:
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)
