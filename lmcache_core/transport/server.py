"""``MessageQueueServer``: a ROUTER socket, one loop thread, and worker threads for long requests.

The loop thread reads every request's head (frame count, size, uid, op: cheap whatever the bytes
are). Cheap requests (ping, lookup, info) are then decoded and answered inline; routes marked
``blocking`` (store, retrieve) are decoded and served on a worker thread, so neither a long copy nor
a large payload delays a ping. Every request gets exactly one reply: its result, or an
``ErrorReply`` built at the one error boundary (``_answer``: ``answer.serve``); no exception from
one request reaches the loop. Workers hand replies back through a deque and an eventfd. A route with
a ``gate`` (store and retrieve on GPU hosts: the worker's CUDA event) has its request parked in a
``Gate`` until what it waits for completes, so no worker thread waits for a GPU's forward pass; one
thread polls them all, and a request past its deadline is answered without its handler running. With
an ``on_disconnect`` observer, a ``PeerWatch`` reports the identities of clients whose connection
closed. A ``dialect`` (LMCache 0.5.6's own clients) claims the requests whose op frame is its own
before our codec reads them, and answers them in its own form (a failure its client raises for a bad one,
server).

The loop and the workers are spawned through a ``Supervisor``: if one of them dies, the server
fails as a whole (``lmcache serve`` exits so that it is restarted) instead of holding its port and
answering nothing. Log lines about rejected requests are budgeted: a flood of bad frames costs a
few lines, not a line each.

The parts with a job of their own live next to it: ``routes`` (the route table's entries, the
dialect hook's interface, the queued work items), ``answer`` (the error boundary), ``counters``
(request and error counts, log budgets) and ``listen`` (binding the socket, removing its file).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from lmcache_core.errors import (
    LMCacheError,
    ServerBusyError,
    ServerError,
    ShuttingDownError,
    UnknownOperationError,
    clip,
)
from lmcache_core.protocol.codec import Limits, decode_head, decode_payload, rejection_frames
from lmcache_core.protocol.ops import RequestType
from lmcache_core.stats import TransportStats
from lmcache_core.supervision import Supervisor
from lmcache_core.transport.answer import reply_error, serve
from lmcache_core.transport.counters import LogBudget
from lmcache_core.transport.gate import Gate
from lmcache_core.transport.listen import bind_router, remove_ipc_file
from lmcache_core.transport.peers import PeerWatch
from lmcache_core.transport.routes import Dialect, GateFn, Handler, Job, Observer, Route, Task
from lmcache_core.transport.sending import recv_frames, send_frames
from lmcache_core.transport.waker import Waker

__all__ = ["Dialect", "GateFn", "Handler", "LogBudget", "MessageQueueServer", "Observer", "Route"]

logger = logging.getLogger(__name__)
_RECV_BATCH = 256
_WORKER_JOIN_S = 2.0  # after the drain: how long stop() waits for a worker still copying
#: Payload bytes the workers' queue may hold, in requests of the largest size. The loop reads the
#: socket as fast as it can (so pings are never stuck behind stores); without this bound a client
#: sending large requests faster than the workers serve them would grow the queue without end.
_QUEUED_REQUESTS_OF_MAX_SIZE = 4


class MessageQueueServer:
    """Serves ``routes`` on ``url`` (tcp:// or ipc://) until ``stop()``."""

    def __init__(self, url: str, routes: Mapping[RequestType, Route], *,
                 context: zmq.Context[Any] | None = None, workers: int = 2,
                 limits: Limits | None = None, name: str = "lmcache-server",
                 supervisor: Supervisor | None = None, observe: Observer | None = None) -> None:
        self.url = url
        self.routes = dict(routes)
        self.limits = limits or Limits()
        self.counters = TransportStats()  # its section of SERVER_INFO (the loop thread adds)
        self._context = context if context is not None else zmq.Context.instance()
        self._name = name
        self._num_workers = max(1, workers)
        self._supervisor = supervisor if supervisor is not None else Supervisor()
        self._observe = observe  # e.g. a latency histogram; None costs nothing per request
        self._jobs: queue.SimpleQueue[Job | Task | None] = queue.SimpleQueue()
        self.dialect: Dialect | None = None  # e.g. LMCache's own clients (set before start)
        self._done: deque[tuple[list[bytes], str, int]] = deque()  # (frames, error code, size)
        self._posted: deque[list[bytes]] = deque()  # late replies (``post``), sent by the loop
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
        self._gate: Gate[Job] = Gate(self._ungate)
        self._gate_thread: threading.Thread | None = None
        #: ``on_disconnect(identity)``, on the loop thread: a client's connection closed (set
        #: before ``start``; e.g. the registry, so a killed GPU worker's memory is freed fast).
        self.on_disconnect: Callable[[bytes], None] | None = None
        self._peers: PeerWatch | None = None
        self._rejections = LogBudget(logger=logger)
        self._failures = LogBudget(logger=logger)
        self.bound_url = url

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Bind and start the loop and worker threads; returns the bound url (real port for :0)."""
        self._socket, self.bound_url, self._ipc_inode = bind_router(
            self._context, self.url, self.limits.max_request_bytes)
        if self.on_disconnect is not None:
            self._peers = PeerWatch(self._socket, self.on_disconnect)
        if self.dialect is not None:
            self.dialect.attach(self.post)
        self._thread = self._supervisor.spawn(f"{self._name}-loop", self._run)
        self._workers = [self._supervisor.spawn(f"{self._name}-worker-{i}", self._work)
                         for i in range(self._num_workers)]
        if any(route.gate is not None for route in self.routes.values()):
            self._gate_thread = self._supervisor.spawn(f"{self._name}-gate", self._gate.run)
        return self.bound_url

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

    def stats(self) -> TransportStats:
        """Its section of SERVER_INFO, read now."""
        return self.counters.copy(in_flight=self._in_flight)

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
        more = zmq.Poller()  # the socket alone: is another request queued behind this one?
        more.register(self._socket, zmq.POLLIN)
        try:
            while not self._drained():
                events = dict(poller.poll(100 if self._stopping.is_set() else -1))
                if self._waker.fd in events:
                    self._waker.drain()
                self._send_done()
                if self._socket in events:
                    self._receive(more)
                if self._peers is not None and self._peers.monitor in events:
                    self._peers.drain()
        finally:
            if self._peers is not None:
                self._peers.close(self._socket)
            self._socket.close(0)
            remove_ipc_file(self.bound_url, self._ipc_inode)

    def _drained(self) -> bool:
        if not self._stopping.is_set():
            return False
        if self._in_flight and time.monotonic() < self._drain_deadline:
            return False
        self._send_done()
        if self._in_flight:
            logger.warning("stopping with %d request(s) still running", self._in_flight)
        return True

    def _receive(self, more: zmq.Poller) -> None:
        """Serve what is queued (poll said at least one message is). Between messages a
        zero-timeout poll of the socket alone (~2 us) says whether another is queued: cheaper
        than ending each batch with a zmq.Again exception, or than reading the EVENTS option
        (~4 us: pyzmq builds an IntFlag for it, with the GIL held)."""
        sock = self._socket
        assert sock is not None
        peers = self._peers
        for _ in range(_RECV_BATCH):
            frames = peers.recv(sock) if peers is not None else recv_frames(sock)
            self._dispatch(frames[0], frames[1:])
            if not more.poll(0):
                return

    def _dispatch(self, identity: bytes, frames: list[bytes]) -> None:
        """Answer or queue one request; whatever happens, it costs this request only."""
        self.counters.requests += 1
        try:
            self._route(identity, frames)
        except Exception as exc:  # a bug on this path: answer it, log it, keep serving
            error = ServerError(f"{type(exc).__name__}: {clip(str(exc))}")
            self.counters.error(error.code.value)
            self._failures.log(logging.ERROR, "serving a request from %s failed", identity.hex(),
                               exc_info=True)
            self._send([identity, *rejection_frames(frames, error)])

    def _route(self, identity: bytes, frames: list[bytes]) -> None:
        if self.dialect is not None and len(frames) >= 2 and not self._stopping.is_set():
            op = self.dialect.owns(frames)
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
            self._rejections.log(logging.INFO, "rejected a request from %s: %s", identity.hex(),
                                 clip(str(exc)))
            self._send([identity, *rejection_frames(frames, exc)])
            return
        if not route.blocking:
            frames_out, code = self._answer(Job(identity, head, route))
            if code:
                self.counters.error(code)
            self._send([identity, *frames_out])
        elif self._stopping.is_set():
            error = ShuttingDownError("the server is shutting down")
            self.counters.error(error.code.value)
            self._send([identity, *reply_error(head, error)])
        elif self._in_flight and self._queued_bytes + len(head.payload_frame) > self._max_queued_bytes:
            busy = ServerBusyError(f"{self._in_flight} long requests ({self._queued_bytes} bytes) "
                                   f"are queued; {head.op.value} was not served")
            self.counters.error(busy.code.value)
            self._send([identity, *reply_error(head, busy)])
        else:
            self._in_flight += 1
            self._queued_bytes += len(head.payload_frame)
            self._jobs.put(Job(identity, head, route))

    def _serve_dialect(self, identity: bytes, op: str, frames: list[bytes]) -> None:
        """A request of the other dialect: answered now (a refusal in its own form when too
        large or too many are queued), or later on a worker (or not at all, where its
        protocol defines no reply)."""
        dialect = self.dialect
        assert dialect is not None
        size = sum(len(f) for f in frames)
        if size > self.limits.max_request_bytes:
            self._send([identity, *dialect.refuse(op, frames, identity, f"a {size}-byte request; "
                                                  f"at most {self.limits.max_request_bytes}")])
            return
        start = time.perf_counter()
        out = dialect.serve(op, frames, identity)
        if callable(out):
            if self._in_flight and self._queued_bytes + size > self._max_queued_bytes:
                self._rejections.log(logging.INFO, "refused a %s request: %d long requests "
                                     "are queued", op, self._in_flight)
                late = dialect.dropped(op, frames, identity)
                if late is not None:
                    self._send([identity, *late])
                return
            self._in_flight += 1
            self._queued_bytes += size
            self._jobs.put(Task(identity, out, size, op))
            return
        self._observe_dialect(op, start)
        if out is not None:
            self._send([identity, *out])

    def _work(self) -> None:
        """A worker thread: serve queued jobs until a None arrives."""
        while (job := self._jobs.get()) is not None:
            if isinstance(job, Task):
                start = time.perf_counter()
                try:
                    out = job.run()
                except Exception:  # a dialect's task never raises; if it did, no reply
                    self._failures.log(logging.ERROR, "a dialect task raised", exc_info=True)
                    out = None
                self._observe_dialect(job.op, start)
                self._done.append(([job.identity, *out] if out is not None else [], "", job.size))
                self._waker.wake()
                continue
            if self._park(job):
                continue
            frames, code = self._answer(job)
            self._done.append(([job.identity, *frames], code, len(job.head.payload_frame)))
            self._waker.wake()

    def _park(self, job: Job) -> bool:
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

    def _ungate(self, job: Job, expired: bool) -> None:
        """From the gate thread: back to the workers, to be served (or answered a timeout)."""
        self._jobs.put(job._replace(gated=True, expired=expired))

    def post(self, frames: list[bytes]) -> None:
        """Send ``[identity, *reply]`` from the loop thread; from any thread, e.g. a dialect's
        reply to a request it answered later (not counted in flight: a stop does not wait)."""
        self._posted.append(frames)
        self._waker.wake()

    def _send_done(self) -> None:
        while self._posted:
            self._send(self._posted.popleft())
        while self._done:
            frames, code, size = self._done.popleft()
            self._in_flight -= 1
            self._queued_bytes -= size
            if code:
                self.counters.error(code)
            if frames:  # empty: a dialect request answered with silence
                self._send(frames)

    def _answer(self, job: Job) -> tuple[list[bytes], str]:
        """``answer.serve`` (the error boundary), timed for ``observe`` when there is one."""
        observe = self._observe
        if observe is None:
            return serve(job, self.limits, self._rejections, self._failures)
        start = time.perf_counter()
        frames, code = serve(job, self.limits, self._rejections, self._failures)
        try:
            observe(job.head.op, time.perf_counter() - start, code)
        except Exception:
            self._failures.log(logging.ERROR, "observing %s raised", job.head.op.value,
                               exc_info=True)
        return frames, code

    def _observe_dialect(self, op: str, start: float) -> None:
        """Time a dialect's request served from ``start`` (decode and handler; a reply sent later
        by ``post`` is not waited for) under its op name."""
        if self._observe is not None:
            try:
                self._observe(op, time.perf_counter() - start, "")
            except Exception:
                self._failures.log(logging.ERROR, "observing %s raised", op, exc_info=True)

    def _send(self, frames: list[bytes]) -> None:
        assert self._socket is not None
        try:
            send_frames(self._socket, frames)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away; EAGAIN: it stopped reading
            logger.debug("reply to %s dropped: %s", frames[0].hex(), exc)
