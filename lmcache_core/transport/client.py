"""``MessageQueueClient``: a DEALER socket driven by one background I/O thread.

Callers on any thread encode their request, queue it and wake the I/O thread through an eventfd; the
thread owns the socket (ZMQ sockets are single-threaded), sends, receives, matches replies to futures
by request id and fails every request still unanswered at its deadline. Nothing here sleeps: the
thread blocks only in ``poll`` with a timeout equal to the next deadline.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

import zmq

from lmcache_core.errors import (
    ConnectionClosedError,
    LMCacheError,
    LMCacheTimeoutError,
    ServerUnreachableError,
)
from lmcache_core.protocol import messages as m
from lmcache_core.protocol.codec import decode_reply, decode_uid, encode_request
from lmcache_core.protocol.ops import RequestType
from lmcache_core.transport.future import MessagingFuture
from lmcache_core.transport.waker import Waker

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=m.Reply)
_RECV_BATCH = 256


class _Pending(NamedTuple):
    op: RequestType
    op_frame: bytes
    future: MessagingFuture[Any]
    deadline: float


class _Outgoing(NamedTuple):
    uid: int
    frames: list[bytes]
    pending: _Pending


class MessageQueueClient:
    """Sends typed requests to one lmcache server and resolves a ``MessagingFuture`` per request.

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
        self._outbox: deque[_Outgoing] = deque()
        self._pending: dict[int, _Pending] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._waker = Waker()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

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
                       timeout_s: float | None = None) -> MessagingFuture[Any]:
        """Queue one request; returns at once. The future fails after ``timeout_s`` (default: the
        client's request timeout) if no reply came."""
        future: MessagingFuture[Any] = MessagingFuture(f"{op.value} to {self.server_url}")
        if self._closing.is_set():
            future.set_exception(ConnectionClosedError(f"client for {self.server_url} is closed"))
            return future
        uid = next(self._uids)
        try:
            frames = encode_request(uid, op, payloads)
        except (TypeError, ValueError) as exc:
            future.set_exception(exc)
            return future
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.request_timeout_s)
        self._outbox.append(_Outgoing(uid, frames, _Pending(op, frames[1], future, deadline)))
        self._waker.wake()
        if not self._thread.is_alive():  # closed between the check above and the append
            future.set_exception(ConnectionClosedError(f"client for {self.server_url} is closed"))
        return future

    def call(self, op: RequestType, payload: Any, reply_type: type[R],
             timeout_s: float | None = None) -> R:
        """Send one request and wait for its reply (at most the request timeout)."""
        reply = self.submit_request(op, [payload], timeout_s).result(
            (timeout_s if timeout_s is not None else self.request_timeout_s) + 1.0)
        if not isinstance(reply, reply_type):
            raise LMCacheError(f"{op.value}: expected {reply_type.__name__}, got {reply!r}")
        return reply

    def wait_until_reachable(self, timeout_s: float | None = None) -> m.PingReply:
        """Ping until the server answers; ``ServerUnreachableError`` naming the url if it never does."""
        timeout = self.connect_timeout_s if timeout_s is None else timeout_s
        try:
            return self.call(RequestType.PING, m.PingRequest(), m.PingReply, timeout_s=timeout)
        except LMCacheTimeoutError:
            raise ServerUnreachableError(
                f"no lmcache server answered at {self.server_url} within {timeout:g}s "
                f"(start one with: lmcache serve -c <config.yaml>)") from None

    @property
    def in_flight(self) -> int:
        return len(self._pending) + len(self._outbox)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the I/O thread, close the socket, fail what is still waiting. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._waker.wake()
        self._thread.join(timeout_s)

    def __enter__(self) -> MessageQueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._waker.fd in events:
                    self._waker.drain()
                self._flush_outbox()
                if self._socket in events:
                    self._receive_replies()
                self._expire(time.monotonic())
        except Exception:  # the thread must never die silently: fail everyone waiting
            logger.exception("lmcache client I/O thread for %s failed", self.server_url)
        finally:
            self._shutdown()

    def _poll_timeout_ms(self) -> int:
        while self._deadlines and self._deadlines[0][1] not in self._pending:
            heapq.heappop(self._deadlines)
        if not self._deadlines:
            return -1
        return max(0, int((self._deadlines[0][0] - time.monotonic()) * 1000) + 1)

    def _flush_outbox(self) -> None:
        while self._outbox:
            item = self._outbox.popleft()
            try:
                self._socket.send_multipart(item.frames, zmq.NOBLOCK)
            except zmq.Again:
                item.pending.future.set_exception(ServerUnreachableError(
                    f"send queue to {self.server_url} is full: the server is not reading"))
                continue
            self._pending[item.uid] = item.pending
            heapq.heappush(self._deadlines, (item.pending.deadline, item.uid))

    def _receive_replies(self) -> None:
        for _ in range(_RECV_BATCH):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._resolve(frames)

    def _resolve(self, frames: list[bytes]) -> None:
        try:
            uid = decode_uid(frames[0])
        except LMCacheError as exc:
            logger.warning("dropping a reply from %s with a bad uid frame: %s", self.server_url, exc)
            return
        pending = self._pending.pop(uid, None)
        if pending is None:  # answered after its deadline, or not ours
            logger.debug("dropping a late reply for request %d", uid)
            return
        if len(frames) < 2 or frames[1] != pending.op_frame:
            pending.future.set_exception(LMCacheError(
                f"reply to {pending.op.value} echoed another op: {frames[1:2]!r}"))
            return
        try:
            pending.future.set_result(decode_reply(pending.op, frames[2:]))
        except LMCacheError as exc:
            pending.future.set_exception(exc)

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, uid = heapq.heappop(self._deadlines)
            pending = self._pending.pop(uid, None)
            if pending is not None:
                pending.future.set_exception(LMCacheTimeoutError(
                    f"{pending.op.value} to {self.server_url}: no reply within the request timeout"))

    def _shutdown(self) -> None:
        self._closing.set()
        error = ConnectionClosedError(f"client for {self.server_url} was closed")
        for pending in self._pending.values():
            pending.future.set_exception(error)
        while self._outbox:
            self._outbox.popleft().pending.future.set_exception(error)
        self._pending.clear()
        self._socket.close(0)
        self._waker.close()
