"""``LMCacheAsyncLookupServer``: the worker-side half of the async lookup.

One background thread owns the sockets: it polls its PULL socket (requests and cleanups from the
scheduler) and an eventfd ``Waker`` (shutdown, and answers handed over by other threads), hands each
request to the engine's ``async_lookup_and_prefetch`` and PUSHes the engine's answer to the socket
the request names (``reply_to``: one PUSH per client instance, the few most recent kept). A message
that does not decode is logged and dropped; an engine error is answered with 0 hit tokens, so the
client never waits out its timeout for a worker that is alive.
"""

from __future__ import annotations

import logging
import select
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq

from lmcache_core.errors import ConfigError, LMCacheError
from lmcache_core.log_budget import LogBudget
from lmcache_core.lookup_client import _ipc
from lmcache_core.lookup_client.config import LMCacheMetadata, ensure_private_dir
from lmcache_core.lookup_client.messages import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
    decode_worker_msg,
    encode,
)
from lmcache_core.transport.waker import Waker

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 16 * 2**20
_HWM = 100_000
# Plain ints: ``int & zmq.POLLIN`` builds an IntFlag through enum's Python code (~1 us a poll).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_RECV_BATCH = 256
#: How many lookup ids the server remembers the latest attempt (seq) of.
_MAX_TRACKED = 1 << 16
#: Client instances (answer sockets) a server keeps a PUSH to; one is the normal case.
_MAX_CLIENTS = 4


class LookupEngine(Protocol):
    """What the server needs of an engine (``CacheEngine`` has both)."""

    def async_lookup_and_prefetch(
            self, lookup_id: str, hashes: Sequence[bytes], offsets: Sequence[int] | None = None,
            pin: bool = True, request_configs: dict[str, Any] | None = None, *,
            model_name: str = "", world_size: int = 1, worker_id: int = 0,
            on_result: Callable[[str, int], None] | None = None) -> int | None: ...

    def cleanup_memory_objs(self, lookup_id: str) -> int: ...


class LMCacheAsyncLookupServer:
    """Serves the scheduler's async lookups for one worker's engine (its own rank only)."""

    def __init__(self, lmcache_engine: LookupEngine, metadata: LMCacheMetadata, *,
                 context: zmq.Context[Any] | None = None) -> None:
        if not metadata.runs_lookup_server:
            raise ConfigError(
                f"worker {metadata.worker_id} is not one of the lookup-server workers "
                f"{list(metadata.server_worker_ids)}; only those construct a lookup server")
        self.engine = lmcache_engine
        self.metadata = metadata
        self.worker_id = metadata.worker_id
        self._context = context if context is not None else zmq.Context.instance()
        ensure_private_dir(metadata.runtime_path())
        self._pull_path = metadata.worker_socket(metadata.worker_id)
        self._pull, self._pull_inode = _ipc.bind_pull(
            self._context, self._pull_path, MAX_REQUEST_BYTES, _HWM)
        self._runtime_dir = metadata.runtime_path()
        self._pushes: OrderedDict[str, zmq.Socket[Any]] = OrderedDict()  # reply_to -> PUSH
        # lookup id -> (seq, reply_to) of the latest attempt seen (a cleanup of an older one is stale)
        self._latest: OrderedDict[str, tuple[int, str]] = OrderedDict()
        # answers handed over by other threads: (lookup id, seq and reply_to or None, hit tokens)
        self._outbox: deque[tuple[str, tuple[int, str] | None, int]] = deque()
        self._counts = {"requests": 0, "cleanups": 0, "stale_cleanups": 0, "responses": 0,
                        "dropped_responses": 0, "malformed": 0, "engine_errors": 0}
        # Any client may send malformed messages, or name an answer socket no one can reach, at
        # will; a failing engine cleanup fails for every lookup: a few lines each, the rest counted.
        self._malformed_log = LogBudget(logger=logger)
        self._undeliverable_log = LogBudget(logger=logger)
        self._cleanup_log = LogBudget(logger=logger)
        self._waker = Waker()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self.process_requests_from_scheduler,
                                        name=f"lmcache-lookup-server-{self.worker_id}", daemon=True)
        self._thread.start()
        logger.info("lookup server for worker %d listening at %s", self.worker_id, self._pull_path)

    # ------------------------------------------------------------------ public

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        """Answer ``lookup_id`` (its latest attempt) with ``num_hit_tokens``; callable from any thread."""
        self._answer(lookup_id, num_hit_tokens, None)

    def stats(self) -> dict[str, int]:
        """Counters: requests, cleanups (stale ones skipped), responses, malformed messages, ..."""
        return dict(self._counts)

    @property
    def socket_path(self) -> str:
        return str(self._pull_path)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread; it closes its sockets (linger 0) and removes its socket file."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._waker.wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("lookup server thread of worker %d did not stop in %.1fs",
                           self.worker_id, timeout_s)

    def __enter__(self) -> LMCacheAsyncLookupServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ thread

    def process_requests_from_scheduler(self) -> None:
        """The background thread's loop (started by the constructor; do not call it yourself).

        It polls the PULL socket's ``ZMQ_FD`` and the waker with ``select.poll`` (one system call,
        no per-wake-up Python allocation of zmq's ``Poller``) and reads requests while
        ``ZMQ_EVENTS`` says one is in (no ``Again`` raised per wake-up): the hops between a request
        arriving and its answer being sent are the poll's return, the receive and the engine call.
        """
        poller = select.poll()
        zmq_fd: Any = self._pull.get(zmq.FD)
        waker_fd = self._waker.fd
        poller.register(zmq_fd, select.POLLIN)
        poller.register(waker_fd, select.POLLIN)
        try:
            while not self._closing.is_set():
                more = self._receive()
                if self._outbox:
                    self._flush_outbox()
                if more:  # the batch limit: read on after a look at the outbox and the flag
                    continue
                for fd, _ in poller.poll():
                    if fd == waker_fd:
                        self._waker.drain()
        except Exception:
            logger.exception("lookup server thread of worker %d failed", self.worker_id)
        finally:
            self._closing.set()
            _ipc.unbind(self._pull, self._pull_path, self._pull_inode)
            for push in self._pushes.values():
                push.close(0)
            self._pushes.clear()
            self._waker.close()

    def _receive(self) -> bool:
        """Handle what has arrived (up to a batch); True if more may be waiting.

        Reads until ``ZMQ_EVENTS`` shows nothing in, which is what re-arms the edge-triggered
        ``ZMQ_FD`` the loop polls.
        """
        sock = self._pull
        for _ in range(_RECV_BATCH):
            if not int(sock.getsockopt(_EVENTS)) & _POLLIN:
                return False
            try:
                buf = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return False
            try:
                msg = decode_worker_msg(buf)
            except LMCacheError as exc:
                self._counts["malformed"] += 1
                self._malformed_log.log(
                    logging.WARNING, "lookup server %d: dropping a malformed message (%d bytes): %s",
                    self.worker_id, len(buf), exc)
                continue
            if isinstance(msg, LookupRequestMsg):
                self._lookup(msg)
            else:
                self._cleanup(msg)
        return True

    def _lookup(self, msg: LookupRequestMsg) -> None:
        self._counts["requests"] += 1
        latest = self._latest
        attempt = latest[msg.lookup_id] = (msg.seq, msg.reply_to)
        latest.move_to_end(msg.lookup_id)
        if len(latest) > _MAX_TRACKED:
            latest.popitem(last=False)
        meta = self.metadata
        answered = False

        def on_result(lookup_id: str, num_hit_tokens: int) -> None:
            nonlocal answered
            if not answered:  # one answer per request, whatever the engine does
                answered = True
                self._answer(lookup_id, num_hit_tokens, attempt)

        try:
            self.engine.async_lookup_and_prefetch(
                msg.lookup_id, msg.hashes, msg.offsets, True, msg.request_configs,
                model_name=meta.model_name, world_size=meta.world_size, worker_id=self.worker_id,
                on_result=on_result)
        except Exception:  # what a request holds may make it fail: a few lines, not one each
            self._counts["engine_errors"] += 1
            self._cleanup_log.log(logging.ERROR, "lookup server %d: lookup %r failed; answering 0 "
                                  "hit tokens", self.worker_id, msg.lookup_id, exc_info=True)
            if not answered:
                try:
                    self.engine.cleanup_memory_objs(msg.lookup_id)
                except Exception:
                    self._cleanup_log.log(logging.ERROR, "lookup server %d: releasing the pins "
                                          "of %r failed", self.worker_id, msg.lookup_id,
                                          exc_info=True)
                on_result(msg.lookup_id, 0)

    def _cleanup(self, msg: LookupCleanupMsg) -> None:
        latest = self._latest.get(msg.lookup_id)
        if latest is not None and latest[0] != msg.seq:  # a newer attempt already replaced the pins
            self._counts["stale_cleanups"] += 1
            return
        self._latest.pop(msg.lookup_id, None)
        self._counts["cleanups"] += 1
        try:
            self.engine.cleanup_memory_objs(msg.lookup_id)
        except Exception:
            self._cleanup_log.log(logging.ERROR, "lookup server %d: cleanup of %r failed",
                                  self.worker_id, msg.lookup_id, exc_info=True)

    def _answer(self, lookup_id: str, num_hit_tokens: int, attempt: tuple[int, str] | None) -> None:
        if threading.get_ident() == self._thread.ident:
            self._send(lookup_id, attempt, num_hit_tokens)
        else:
            self._outbox.append((lookup_id, attempt, num_hit_tokens))
            self._waker.wake()

    def _flush_outbox(self) -> None:
        while self._outbox:
            self._send(*self._outbox.popleft())

    def _send(self, lookup_id: str, attempt: tuple[int, str] | None, num_hit_tokens: int) -> None:
        if attempt is None:
            attempt = self._latest.get(lookup_id)
            if attempt is None:
                logger.warning("lookup server %d: no lookup %r to answer", self.worker_id, lookup_id)
                return
        seq, reply_to = attempt
        try:
            self._push_to(reply_to).send(encode(LookupResponseMsg(
                lookup_id=lookup_id, seq=seq, worker_id=self.worker_id,
                num_hit_tokens=max(0, int(num_hit_tokens)))), zmq.NOBLOCK)
            self._counts["responses"] += 1
        except zmq.ZMQError as exc:  # the scheduler is not reading: nobody will use these pins
            self._counts["dropped_responses"] += 1
            self._undeliverable_log.log(
                logging.WARNING, "lookup server %d: cannot answer %r (%s); releasing its pins",
                self.worker_id, lookup_id, exc)
            if self._latest.get(lookup_id) == attempt:
                self._cleanup(LookupCleanupMsg(lookup_id=lookup_id, seq=seq))

    def _push_to(self, reply_to: str) -> zmq.Socket[Any]:
        """The PUSH socket to client instance ``reply_to``; the least recent beyond a few is closed."""
        push = self._pushes.get(reply_to)
        if push is None:
            push = _ipc.connect_push(self._context, self._runtime_dir / reply_to, _HWM)
            self._pushes[reply_to] = push
            if len(self._pushes) > _MAX_CLIENTS:
                self._pushes.popitem(last=False)[1].close(0)
        else:
            self._pushes.move_to_end(reply_to)
        return push
