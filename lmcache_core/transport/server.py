"""``MessageQueueServer``: a ROUTER socket, one loop thread, and a worker pool for long requests.

Cheap requests (ping, lookup, info) are answered inline on the loop thread; routes marked
``blocking`` (store, retrieve) run on a thread pool so a long copy never delays a ping or a lookup.
Every request gets exactly one reply: its result, or an ``ErrorReply`` built at the one error
boundary (``_answer``). Worker threads hand replies back through a deque and an eventfd.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import zmq

from lmcache_core.errors import (
    BindError,
    LMCacheError,
    ServerError,
    ShuttingDownError,
    UnknownOperationError,
)
from lmcache_core.protocol import messages as m
from lmcache_core.protocol.codec import (
    DecodedRequest,
    Limits,
    decode_request,
    encode_reply,
    error_reply,
)
from lmcache_core.protocol.ops import RequestType
from lmcache_core.transport.waker import Waker

logger = logging.getLogger(__name__)
Handler = Callable[[Any, bytes], m.Reply]
_RECV_BATCH = 256


class Route(NamedTuple):
    """How one op is served: ``handler(payload, client_identity) -> Reply``."""

    handler: Handler
    blocking: bool = False


class ServerCounters:
    """Request and error counts, read by the stats handler (plain ints: one writer thread)."""

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0


class MessageQueueServer:
    """Serves ``routes`` on ``url`` (tcp:// or ipc://) until ``stop()``."""

    def __init__(self, url: str, routes: Mapping[RequestType, Route], *,
                 context: zmq.Context[Any] | None = None, workers: int = 2,
                 limits: Limits | None = None, name: str = "lmcache-server") -> None:
        self.url = url
        self.routes = dict(routes)
        self.limits = limits or Limits()
        self.counters = ServerCounters()
        self._context = context if context is not None else zmq.Context.instance()
        self._name = name
        self._workers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-worker")
        self._done: deque[list[bytes]] = deque()
        self._in_flight = 0
        self._waker = Waker()
        self._stopping = threading.Event()
        self._drain_deadline = 0.0
        self._socket: zmq.Socket[Any] | None = None
        self._thread: threading.Thread | None = None
        self.bound_url = url

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Bind and start the loop thread; returns the bound url (with the real port for :0)."""
        self._socket = self._bind(self.url)
        self._thread = threading.Thread(target=self._run, name=f"{self._name}-loop", daemon=True)
        self._thread.start()
        return self.bound_url

    def _bind(self, url: str) -> zmq.Socket[Any]:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # A hard cap well above the soft limit: bigger frames drop the peer instead of eating memory;
        # frames between the two get a TOO_LARGE reply.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.limits.max_request_bytes)
        if url.startswith("ipc://"):
            Path(url[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)
        try:
            sock.bind(url)
        except zmq.ZMQError as exc:
            sock.close(0)
            hint = " (is another lmcache serve running there?)" if exc.errno == errno.EADDRINUSE else ""
            raise BindError(f"cannot listen on {url}: {exc.strerror}{hint}") from None
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        self.bound_url = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
        return sock

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Finish in-flight requests (answering new ones SHUTTING_DOWN), then close. Idempotent."""
        if self._thread is None or self._stopping.is_set():
            return
        self._drain_deadline = time.monotonic() + drain_timeout_s
        self._stopping.set()
        self._waker.wake()
        self._thread.join(drain_timeout_s + 2.0)
        self._workers.shutdown(wait=False, cancel_futures=True)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the loop has exited (after ``stop``); True if it has."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        assert self._socket is not None
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        try:
            while not self._drained():
                events = dict(poller.poll(100 if self._stopping.is_set() else -1))
                if self._waker.fd in events:
                    self._waker.drain()
                self._send_done()
                if self._socket in events:
                    self._receive()
        except Exception:
            logger.exception("lmcache server loop failed")
        finally:
            self._socket.close(0)
            self._remove_ipc_file()
            self._waker.close()

    def _drained(self) -> bool:
        if not self._stopping.is_set():
            return False
        if self._in_flight and time.monotonic() < self._drain_deadline:
            return False
        self._send_done()
        if self._in_flight:
            logger.warning("stopping with %d request(s) still running", self._in_flight)
        return True

    def _receive(self) -> None:
        """Serve what is queued (poll said at least one message is); checking EVENTS between
        messages is cheaper than ending each batch with a zmq.Again exception."""
        sock = self._socket
        assert sock is not None
        for _ in range(_RECV_BATCH):
            frames = sock.recv_multipart(zmq.NOBLOCK)
            self._dispatch(frames[0], frames[1:])
            if not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
                return

    def _dispatch(self, identity: bytes, frames: list[bytes]) -> None:
        self.counters.requests += 1
        try:
            request = decode_request(frames, self.limits)
            route = self.routes.get(request.op)
            if route is None:
                raise UnknownOperationError(f"this server does not serve {request.op.value}")
        except LMCacheError as exc:
            self.counters.errors += 1
            logger.info("rejected a request from %s: %s", identity.hex(), exc)
            uid = frames[0] if frames else b""
            op = frames[1] if len(frames) > 1 else b""
            self._send([identity, *encode_reply(uid, op, error_reply(exc))])
            return
        if not route.blocking:
            self._send([identity, *self._answer(route, request, identity)])
        elif self._stopping.is_set():
            self._send([identity, *self._reply_error(request, ShuttingDownError(
                "the server is shutting down"))])
        else:
            self._in_flight += 1
            job = self._workers.submit(self._answer, route, request, identity)
            job.add_done_callback(functools.partial(self._on_done, identity))

    def _on_done(self, identity: bytes, job: Future[list[bytes]]) -> None:
        self._done.append([identity, *job.result()])
        self._waker.wake()

    def _send_done(self) -> None:
        while self._done:
            self._in_flight -= 1
            self._send(self._done.popleft())

    def _answer(self, route: Route, request: DecodedRequest, identity: bytes) -> list[bytes]:
        """The one error boundary: a reply or a typed ErrorReply, whatever the handler does."""
        try:
            reply = route.handler(request.payload, identity)
        except LMCacheError as exc:
            self.counters.errors += 1
            logger.info("%s failed: %s", request.op.value, exc)
            return self._reply_error(request, exc)
        except Exception as exc:
            self.counters.errors += 1
            logger.exception("%s raised", request.op.value)
            return self._reply_error(request, ServerError(f"{type(exc).__name__}: {exc}"))
        return encode_reply(request.uid_frame, request.op_frame, reply)

    @staticmethod
    def _reply_error(request: DecodedRequest, exc: LMCacheError) -> list[bytes]:
        return encode_reply(request.uid_frame, request.op_frame, error_reply(exc))

    def _send(self, frames: list[bytes]) -> None:
        assert self._socket is not None
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away; EAGAIN: it stopped reading
            logger.debug("reply to %s dropped: %s", frames[0].hex(), exc)

    def _remove_ipc_file(self) -> None:
        if self.bound_url.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(self.bound_url[len("ipc://"):])
