"""``MessageQueueServer``: a ROUTER socket, one loop thread, and worker threads for long requests.

The loop thread reads every request's head (frame count, size, uid, op: cheap whatever the bytes
are). Cheap requests (ping, lookup, info) are then decoded and answered inline; routes marked
``blocking`` (store, retrieve) are decoded and served on a worker thread, so neither a long copy nor
a large payload delays a ping. Every request gets exactly one reply: its result, or an
``ErrorReply`` built at the one error boundary (``_answer``); no exception from one request reaches
the loop. Workers hand replies back through a deque and an eventfd. A route with a ``gate`` (store
and retrieve on GPU hosts: the worker's CUDA event) has its request parked in a ``Gate`` until
what it waits for completes, so no worker thread waits for a GPU's forward pass; one thread polls
them all, and a request past its deadline is answered without its handler running. With an
``on_disconnect`` observer, a ``PeerWatch`` reports the identities of clients whose connection closed.
A ``dialect`` (LMCache 0.5.6's own clients) claims the requests whose op frame is its own before our
codec reads them, and answers them in its own form (silence for a bad one, as LMCache's server).

The loop and the workers are spawned through a ``Supervisor``: if one of them dies, the server
fails as a whole (``lmcache serve`` exits so that it is restarted) instead of holding its port and
answering nothing. Log lines about rejected requests are budgeted: a flood of bad frames costs a
few lines, not a line each.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import zmq

from lmcache_core.errors import (
    BindError,
    LMCacheError,
    LMCacheTimeoutError,
    ServerBusyError,
    ServerError,
    ShuttingDownError,
    UnknownOperationError,
    clip,
)
from lmcache_core.protocol import messages as m
from lmcache_core.protocol.codec import (
    Limits,
    RequestHead,
    decode_head,
    decode_payload,
    encode_reply,
    error_reply,
    rejection_frames,
)
from lmcache_core.protocol.ops import RequestType
from lmcache_core.supervision import Supervisor
from lmcache_core.transport.gate import Gate, Waitable
from lmcache_core.transport.peers import PeerWatch
from lmcache_core.transport.waker import Waker

logger = logging.getLogger(__name__)
Handler = Callable[[Any, bytes], m.Reply]
#: ``observe(op, seconds, error_code)`` after each request a route served ("" when it succeeded).
Observer = Callable[[RequestType, float, str], None]
_RECV_BATCH = 256
_WORKER_JOIN_S = 2.0  # after the drain: how long stop() waits for a worker still copying
#: Payload bytes the workers' queue may hold, in requests of the largest size. The loop reads the
#: socket as fast as it can (so pings are never stuck behind stores); without this bound a client
#: sending large requests faster than the workers serve them would grow the queue without end.
_QUEUED_REQUESTS_OF_MAX_SIZE = 4


#: ``gate(payload) -> (waitable, timeout_s) | None``: what a blocking request must wait for before
#: its handler runs (e.g. the worker's CUDA event); it then waits in the ``Gate``, not on a worker.
GateFn = Callable[[Any], tuple[Waitable, float] | None]


class Route(NamedTuple):
    """How one op is served: ``handler(payload, client_identity) -> Reply``."""

    handler: Handler
    blocking: bool = False
    gate: GateFn | None = None


class Dialect(Protocol):
    """A second wire on the same socket (LMCache's own clients): it claims a request by its op
    frame, then answers it (reply frames, or None: no reply) or hands back a task for a worker
    thread. It never raises; its replies bypass our codec."""

    def owns(self, op_frame: bytes) -> str | None: ...

    def serve(self, op: str, frames: list[bytes],
              client: bytes) -> list[bytes] | Callable[[], list[bytes] | None] | None: ...


class _Task(NamedTuple):
    """A dialect's request to serve on a worker thread."""

    identity: bytes
    run: Callable[[], list[bytes] | None]
    size: int  # the request's bytes, counted against the workers' queue bound


class ServerCounters:
    """Request and error counts, read by the stats handler (plain ints: only the loop thread
    writes them; workers report their errors with the reply they hand back)."""

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.errors_by_code: dict[str, int] = {}  # ErrorReply codes (a small fixed set)

    def error(self, code: str) -> None:
        """One more error reply, with this code."""
        self.errors += 1
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1


class LogBudget:
    """At most ``lines`` log lines per ``window_s`` for one kind of event; the rest are counted and
    the count is told with the next line let through."""

    def __init__(self, lines: int = 20, window_s: float = 10.0) -> None:
        self._lines = lines
        self._window_s = window_s
        self._lock = threading.Lock()
        self._window_start = 0.0
        self._used = 0
        self._suppressed = 0

    def take(self) -> int | None:
        """None when this line must be dropped; else how many were dropped before it."""
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= self._window_s:
                self._window_start, self._used = now, 0
            if self._used >= self._lines:
                self._suppressed += 1
                return None
            self._used += 1
            suppressed, self._suppressed = self._suppressed, 0
            return suppressed


def _log(budget: LogBudget, level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
    suppressed = budget.take()
    if suppressed is None:
        return
    if suppressed:
        msg += f" ({suppressed} similar line(s) suppressed before this one)"
    logger.log(level, msg, *args, exc_info=exc_info)


@contextlib.contextmanager
def _owner_only_files(active: bool) -> Iterator[None]:
    """Files created meanwhile get mode 0600: an ipc:// socket is then never connectable by other
    users, not even between its bind and the chmod after it. (The umask is per process; the
    server binds at start, before its other threads make files.)"""
    if not active:
        yield
        return
    previous = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(previous)


class _Job(NamedTuple):
    identity: bytes
    head: RequestHead
    route: Route
    payload: Any = None  # decoded already (by the gate check)
    gated: bool = False  # back from the gate: serve it now
    expired: bool = False  # what it waited for did not complete in time: answer a timeout


class MessageQueueServer:
    """Serves ``routes`` on ``url`` (tcp:// or ipc://) until ``stop()``."""

    def __init__(self, url: str, routes: Mapping[RequestType, Route], *,
                 context: zmq.Context[Any] | None = None, workers: int = 2,
                 limits: Limits | None = None, name: str = "lmcache-server",
                 supervisor: Supervisor | None = None, observe: Observer | None = None) -> None:
        self.url = url
        self.routes = dict(routes)
        self.limits = limits or Limits()
        self.counters = ServerCounters()
        self._context = context if context is not None else zmq.Context.instance()
        self._name = name
        self._num_workers = max(1, workers)
        self._supervisor = supervisor if supervisor is not None else Supervisor()
        self._observe = observe  # e.g. a latency histogram; None costs nothing per request
        self._jobs: queue.SimpleQueue[_Job | _Task | None] = queue.SimpleQueue()
        self.dialect: Dialect | None = None  # e.g. LMCache's own clients (set before start)
        self._done: deque[tuple[list[bytes], str, int]] = deque()  # (frames, error code, size)
        self._in_flight = 0
        self._queued_bytes = 0  # payload bytes of the jobs in flight (loop thread only)
        self._max_queued_bytes = _QUEUED_REQUESTS_OF_MAX_SIZE * self.limits.max_request_bytes
        self._waker = Waker()
        self._stopping = threading.Event()
        self._drain_deadline = 0.0
        self._socket: zmq.Socket[Any] | None = None
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._workers_lock = threading.Lock()  # add_workers against stop()
        self._gate: Gate[_Job] = Gate(self._ungate)
        self._gate_thread: threading.Thread | None = None
        #: ``on_disconnect(identity)``, on the loop thread: a client's connection closed (set
        #: before ``start``; e.g. the registry, so a killed GPU worker's memory is freed fast).
        self.on_disconnect: Callable[[bytes], None] | None = None
        self._peers: PeerWatch | None = None
        self._rejections = LogBudget()
        self._failures = LogBudget()
        self.bound_url = url

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Bind and start the loop and worker threads; returns the bound url (real port for :0)."""
        self._socket = self._bind(self.url)
        if self.on_disconnect is not None:
            self._peers = PeerWatch(self._socket, self.on_disconnect)
        self._thread = self._supervisor.spawn(f"{self._name}-loop", self._run)
        self._workers = [self._supervisor.spawn(f"{self._name}-worker-{i}", self._work)
                         for i in range(self._num_workers)]
        if any(route.gate is not None for route in self.routes.values()):
            self._gate_thread = self._supervisor.spawn(f"{self._name}-gate", self._gate.run)
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
        path = url[len("ipc://"):] if url.startswith("ipc://") else None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        try:
            with _owner_only_files(path is not None):
                sock.bind(url)
        except zmq.ZMQError as exc:
            sock.close(0)
            hint = " (is another lmcache serve running there?)" if exc.errno == errno.EADDRINUSE else ""
            raise BindError(f"cannot listen on {url}: {exc.strerror}{hint}") from None
        if path is not None:
            # Only this user may connect: whoever can talk to the server can make it read and write
            # the shared memory it maps.
            os.chmod(path, 0o600)
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        self.bound_url = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
        return sock

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Finish in-flight requests (answering new ones SHUTTING_DOWN), then close. Idempotent."""
        if self._thread is None or self._stopping.is_set():
            return
        self._drain_deadline = time.monotonic() + drain_timeout_s
        self._supervisor.retire(self._thread)
        with self._workers_lock:
            self._stopping.set()
        self._waker.wake()
        self._thread.join(drain_timeout_s + 2.0)
        self._cancel_queued()
        for worker in self._workers:
            self._supervisor.retire(worker)
            self._jobs.put(None)
        deadline = time.monotonic() + _WORKER_JOIN_S
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        if self._gate_thread is not None:  # after the drain: it released what could complete
            self._supervisor.retire(self._gate_thread)
            self._gate.stop()
            self._gate_thread.join(_WORKER_JOIN_S)
        if not any(w.is_alive() for w in self._workers):
            self._waker.close()  # else a worker still copying may wake it: leave the fd open

    def add_workers(self, extra: int) -> int:
        """Run ``extra`` worker threads beyond the configured ones (never fewer than now); returns
        how many run. E.g. a pair per GPU registered: a copy waits for its GPU's forward pass, and
        one store per GPU must not hold every thread while other GPUs' requests queue."""
        with self._workers_lock:
            if self._thread is None or self._stopping.is_set():
                return len(self._workers)
            while len(self._workers) < self._num_workers + extra:
                name = f"{self._name}-worker-{len(self._workers)}"
                self._workers.append(self._supervisor.spawn(name, self._work))
            return len(self._workers)

    def _cancel_queued(self) -> None:
        """Drop the jobs no worker took before the drain ended (the socket is closed: no one
        would get their replies)."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._jobs.get_nowait()

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
        """The loop thread. Any exception here (not from a request: those are answered) ends the
        thread, and the supervisor takes the server down."""
        assert self._socket is not None
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        if self._peers is not None:
            poller.register(self._peers.monitor, zmq.POLLIN)
        try:
            while not self._drained():
                events = dict(poller.poll(100 if self._stopping.is_set() else -1))
                if self._waker.fd in events:
                    self._waker.drain()
                self._send_done()
                if self._socket in events:
                    self._receive()
                if self._peers is not None and self._peers.monitor in events:
                    self._peers.drain()
        finally:
            if self._peers is not None:
                self._peers.close(self._socket)
            self._socket.close(0)
            self._remove_ipc_file()

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
        peers = self._peers
        for _ in range(_RECV_BATCH):
            frames = peers.recv(sock) if peers is not None else sock.recv_multipart(zmq.NOBLOCK)
            self._dispatch(frames[0], frames[1:])
            if not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
                return

    def _dispatch(self, identity: bytes, frames: list[bytes]) -> None:
        """Answer or queue one request; whatever happens, it costs this request only."""
        self.counters.requests += 1
        try:
            self._route(identity, frames)
        except Exception as exc:  # a bug on this path: answer it, log it, keep serving
            error = ServerError(f"{type(exc).__name__}: {clip(str(exc))}")
            self.counters.error(error.code.value)
            _log(self._failures, logging.ERROR, "serving a request from %s failed",
                 identity.hex(), exc_info=True)
            self._send([identity, *rejection_frames(frames, error)])

    def _route(self, identity: bytes, frames: list[bytes]) -> None:
        if self.dialect is not None and len(frames) >= 2 and not self._stopping.is_set():
            op = self.dialect.owns(frames[1])
            if op is not None:
                self._serve_dialect(identity, op, frames)
                return
        try:
            head = decode_head(frames, self.limits)
            route = self.routes.get(head.op)
            if route is None:
                raise UnknownOperationError(f"this server does not serve {head.op.value}")
        except LMCacheError as exc:
            self.counters.error(exc.code.value)
            _log(self._rejections, logging.INFO, "rejected a request from %s: %s",
                 identity.hex(), clip(str(exc)))
            self._send([identity, *rejection_frames(frames, exc)])
            return
        if not route.blocking:
            frames_out, code = self._answer(_Job(identity, head, route))
            if code:
                self.counters.error(code)
            self._send([identity, *frames_out])
        elif self._stopping.is_set():
            error = ShuttingDownError("the server is shutting down")
            self.counters.error(error.code.value)
            self._send([identity, *self._reply_error(head, error)])
        elif self._in_flight and self._queued_bytes + len(head.payload_frame) > self._max_queued_bytes:
            busy = ServerBusyError(f"{self._in_flight} long requests ({self._queued_bytes} bytes) "
                                   f"are queued; {head.op.value} was not served")
            self.counters.error(busy.code.value)
            self._send([identity, *self._reply_error(head, busy)])
        else:
            self._in_flight += 1
            self._queued_bytes += len(head.payload_frame)
            self._jobs.put(_Job(identity, head, route))

    def _serve_dialect(self, identity: bytes, op: str, frames: list[bytes]) -> None:
        """A request of the other dialect: answered now, never (its error behaviour: too large or
        too many queued are not served either), or later on a worker."""
        size = sum(len(f) for f in frames)
        if size > self.limits.max_request_bytes:
            _log(self._rejections, logging.INFO, "dropped a %d-byte %s request", size, op)
            return
        out = self.dialect.serve(op, frames, identity) if self.dialect is not None else None
        if callable(out):
            if self._in_flight and self._queued_bytes + size > self._max_queued_bytes:
                _log(self._rejections, logging.INFO, "dropped a %s request: %d long requests "
                     "are queued", op, self._in_flight)
                return
            self._in_flight += 1
            self._queued_bytes += size
            self._jobs.put(_Task(identity, out, size))
        elif out is not None:
            self._send([identity, *out])

    def _work(self) -> None:
        """A worker thread: serve queued jobs until a None arrives."""
        while (job := self._jobs.get()) is not None:
            if isinstance(job, _Task):
                try:
                    out = job.run()
                except Exception:  # a dialect's task never raises; if it did, no reply
                    _log(self._failures, logging.ERROR, "a dialect task raised", exc_info=True)
                    out = None
                self._done.append(([job.identity, *out] if out is not None else [], "", job.size))
                self._waker.wake()
                continue
            if self._park(job):
                continue
            frames, code = self._answer(job)
            self._done.append(([job.identity, *frames], code, len(job.head.payload_frame)))
            self._waker.wake()

    def _park(self, job: _Job) -> bool:
        """Hand a request whose route must wait (its gate) to the gate thread; True if parked.

        Anything unexpected leaves it to the handler, which meets the same problem and answers it."""
        gate = job.route.gate
        if gate is None or job.gated or self._gate_thread is None:
            return False
        try:
            payload = decode_payload(job.head, self.limits)
            waiting = gate(payload)
            if waiting is None or waiting[0].query():
                return False
        except Exception:
            return False
        self._gate.park(job._replace(payload=payload), waiting[0], waiting[1])
        return True

    def _ungate(self, job: _Job, expired: bool) -> None:
        """From the gate thread: back to the workers, to be served (or answered a timeout)."""
        self._jobs.put(job._replace(gated=True, expired=expired))

    def _send_done(self) -> None:
        while self._done:
            frames, code, size = self._done.popleft()
            self._in_flight -= 1
            self._queued_bytes -= size
            if code:
                self.counters.error(code)
            if frames:  # empty: a dialect request answered with silence
                self._send(frames)

    def _answer(self, job: _Job) -> tuple[list[bytes], str]:
        """``_serve``, timed for ``observe`` when there is one."""
        observe = self._observe
        if observe is None:
            return self._serve(job)
        start = time.perf_counter()
        frames, code = self._serve(job)
        try:
            observe(job.head.op, time.perf_counter() - start, code)
        except Exception:
            _log(self._failures, logging.ERROR, "observing %s raised", job.head.op.value,
                 exc_info=True)
        return frames, code

    def _serve(self, job: _Job) -> tuple[list[bytes], str]:
        """The one error boundary: the reply frames (a result or a typed ErrorReply, whatever the
        payload or the handler does), and the error's code ("" for a result)."""
        head = job.head
        if job.expired:
            late = LMCacheTimeoutError(f"{head.op.value}: what it waits for (the worker's CUDA "
                                       "event) did not complete in time; nothing was copied")
            return self._reply_error(head, late), late.code.value
        try:
            payload = job.payload if job.payload is not None else decode_payload(head, self.limits)
            reply = job.route.handler(payload, job.identity)
        except LMCacheError as exc:
            _log(self._rejections, logging.INFO, "%s failed: %s", head.op.value, clip(str(exc)))
            return self._reply_error(head, exc), exc.code.value
        except Exception as exc:
            error = ServerError(f"{type(exc).__name__}: {clip(str(exc))}")
            _log(self._failures, logging.ERROR, "%s raised", head.op.value, exc_info=True)
            return self._reply_error(head, error), error.code.value
        return encode_reply(head.uid_frame, head.op_frame, reply), ""

    @staticmethod
    def _reply_error(head: RequestHead, exc: LMCacheError) -> list[bytes]:
        return encode_reply(head.uid_frame, head.op_frame, error_reply(exc))

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
