"""``LMCacheAsyncLookupClient``: the scheduler-side half of the async lookup.

``lookup()`` hashes the prompt (``TokenDatabase``, the one prefix-chain implementation), PUSHes one
request to every lookup-server worker and returns ``None`` at once. A background thread (the I/O
core both clients share, ``transport.io_core.IOThread``) polls the client's PULL socket and its
``Waker`` (shutdown, and the first deadline of an idle client), records each worker's answer, and
when every expected worker has answered stores the minimum.
``lookup_cache()`` reads that state under a lock and never sleeps. While its lookup is still running
it also drains the PULL socket itself (non-blocking receives): a scheduler that polls in a tight
loop holds the GIL, and would otherwise see each answer only when the interpreter's switch interval
(5 ms) lets the background thread run. ``wait_for_result()`` polls the socket on its own thread.
While callers receive for themselves like this, the background thread stops watching the socket
(it looks again every ``_ATTENDED_S``): woken by each answer, it would only compete with the caller
reading that answer for the GIL and the receive lock, which cost more than the receive itself.

The PULL socket is shared the same way as the PUSH sockets: under a lock, with the thread polling its
``ZMQ_FD`` (which signals new messages; every drain reads until EAGAIN, so no signal is lost). Each
client instance binds its own PULL path and names it in every request (``reply_to``): a worker's
PUSH to a client that closed can lose what it sends before it notices, so a new client never shares
a connection, or a path, with an old one.

A lookup that is cancelled, timed out, replaced by a newer ``lookup()`` of the same id, or evicted
unread is *abandoned*: workers that already answered get a cleanup at once, and any answer that
arrives later for an attempt that is not running (late, unknown, or stale) is dropped and answered
with a cleanup to its worker, so no worker keeps pins nobody will use. The PUSH sockets are shared
by the caller's thread (requests) and the background thread (cleanups) under one lock, which also
gives ZMQ the memory barrier it needs when a socket changes threads.

The parts with a job of their own live next to it: ``sockets`` (the PULL and PUSH sockets),
``results`` (the per-lookup bookkeeping, under this client's lock) and
``messages`` (the wire messages).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import zmq

from lmcache_core.errors import LMCacheError
from lmcache_core.keys import TokenDatabase
from lmcache_core.lookup_client.abstract_client import LookupClientInterface
from lmcache_core.lookup_client.config import (
    LMCacheEngineConfig,
    LMCacheMetadata,
    ensure_private_dir,
)
from lmcache_core.lookup_client.messages import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
    decode_response,
    encode,
)
from lmcache_core.lookup_client.results import MAX_RESULTS, Abandoned, LookupTable
from lmcache_core.lookup_client.sockets import LookupSockets
from lmcache_core.transport.io_core import IOThread, ThreadWaiters, Waiter
from lmcache_core.transport.ipc_files import remove_if_stale

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_RESULTS", "LMCacheAsyncLookupClient"]

logger = logging.getLogger(__name__)

_RECV_BATCH = 512
_LOGGED_BAD = 10
#: While a caller has received answers itself this recently, the thread does not watch the socket.
_ATTENDED_S = 0.005
_instances = itertools.count()


class LMCacheAsyncLookupClient(LookupClientInterface):
    """Non-blocking lookups from the scheduler to the workers' ``LMCacheAsyncLookupServer``s."""

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheMetadata, *,
                 context: zmq.Context[Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: what lookup deadlines (``lookup_timeout_ms``) are measured on (tests pass a
        fake one); the thread's own pacing and callers' waits use real time."""
        self.config = config
        self._clock = clock
        self.metadata = metadata
        self.timeout_s = config.lookup_timeout_ms / 1000.0
        self.token_database = TokenDatabase(config.chunk_size)
        self.worker_ids: tuple[int, ...] = metadata.server_worker_ids
        self._worker_set = frozenset(self.worker_ids)
        self._context = context if context is not None else zmq.Context.instance()
        ensure_private_dir(metadata.runtime_path())
        for path in metadata.scheduler_sockets():  # answer sockets of clients that died
            remove_if_stale(path)
        self._pull_path = metadata.scheduler_socket(f"{os.getpid()}-{next(_instances)}")
        self.reply_to = self._pull_path.name
        self._sockets = LookupSockets(self._context, metadata, self.worker_ids, self._pull_path)
        self._lock = threading.Lock()  # guards the table
        self._table = LookupTable(self.worker_ids, config.lookup_timeout_ms)
        self._attended_at = 0.0  # when a caller last received answers itself
        # Attempt numbers: next() is atomic under the GIL; starting at the clock keeps them rising
        # across client restarts, so a worker never mistakes a new attempt for an older one.
        self._seqs = itertools.count(time.time_ns())
        self._malformed = 0
        self._closing = threading.Event()
        self._closed = False
        zmq_fd = self._sockets.pull.get(zmq.FD)
        self._waiters = ThreadWaiters(zmq_fd)
        self._io = IOThread("lmcache-lookup-client", zmq_fd, self._turn, self._on_exit,
                            f"lookup client for {metadata.engine_id}")
        self._io.start()
        logger.info("lookup client for %s: %d lookup servers, answers at %s",
                    metadata.engine_id, len(self.worker_ids), self._pull_path)

    # ------------------------------------------------------------------ the seed's API

    def lookup(self, token_ids: torch.Tensor | list[int], lookup_id: str,
               request_configs: dict[str, Any] | None = None) -> int | None:
        """Start a lookup of ``token_ids``' complete chunks under ``lookup_id``; returns None at once.

        Poll ``lookup_cache(lookup_id)`` for the answer. Asking again under a running or finished id
        replaces that attempt (the workers re-pin under the same id). Token ids outside uint32, or
        ``request_configs`` msgpack cannot encode, raise ``ValueError``/``TypeError`` before anything
        is sent.
        """
        hashes = self.token_database.chunk_hashes(token_ids)
        seq = next(self._seqs)
        buf = encode(LookupRequestMsg(
            lookup_id=lookup_id, seq=seq, reply_to=self.reply_to, hashes=hashes,
            offsets=self.token_database.chunk_offsets(len(hashes)),
            request_configs=request_configs)) if hashes else b""
        with self._lock:
            table = self._table
            table.counts["lookups"] += 1
            abandoned = table.forget(lookup_id)
            # closed, or its thread ended (no answer would be read): 0 at once, nothing pinned
            started = bool(hashes) and not self._closed and not self._closing.is_set()
            if started:
                wake = table.start(lookup_id, seq, self._clock() + self.timeout_s)
            else:  # nothing to look up (no complete chunk), or closed: 0 at once
                table.finish(lookup_id, 0, seq, pinned=False)
                wake = False
        self._send_cleanups(lookup_id, abandoned)
        if not started:
            return None
        failed = self._sockets.send_all(buf)
        if failed:  # a worker's queue is full (it is not reading): recompute now, not at the timeout
            logger.warning("lookup %r: could not reach lookup server(s) %s; reporting 0 hit tokens",
                           lookup_id, failed)
            with self._lock:
                self._table.counts["send_failures"] += 1
                abandoned = self._table.fail(lookup_id, seq)
            self._send_cleanups(lookup_id, abandoned)
        elif wake:
            self._io.wake()  # the thread may be polling with no deadline at all
        return None

    def lookup_cache(self, lookup_id: str) -> int | None:
        """``-1``: never asked (or cancelled/cleared); ``None``: still running; ``n >= 0``: hit tokens.

        A lookup still running ``lookup_timeout_ms`` after ``lookup()`` reports 0 (and is cancelled).
        Never sleeps: a dict read under a lock held only for dict work and, while the lookup runs, a
        non-blocking read of the answers that have arrived.
        """
        with self._lock:
            running = self._table.state(lookup_id)
            if isinstance(running, int):
                return running
            expired = self._clock() >= running.deadline
            if expired:
                abandoned = self._table.time_out(lookup_id, running)
        if expired:
            self._send_cleanups(lookup_id, abandoned)
            return 0
        self._attended_at = time.monotonic()
        if not self._drain():
            return None
        with self._lock:
            state = self._table.state(lookup_id)
        return state if isinstance(state, int) else None

    def _turn(self) -> tuple[int, bool] | None:
        """One round of the background thread (``IOThread`` polls between rounds); None: closing.

        It expires lookups at their deadlines and receives the answers nobody else does. While a
        caller has been receiving answers itself (``lookup_cache`` on a running lookup,
        ``wait_for_result``) within ``_ATTENDED_S``, it does not watch the socket: woken by every
        answer, it would only compete for the GIL and the receive lock with the caller reading that
        answer. It then looks again (and drains) every ``_ATTENDED_S``, so an answer nobody reads
        waits at most that long.
        """
        if self._closing.is_set():
            return None
        while self._drain() >= _RECV_BATCH:
            pass
        self._expire(self._clock())
        timeout_ms = self._poll_timeout_ms()
        unattended_s = time.monotonic() - self._attended_at
        watch = unattended_s >= _ATTENDED_S
        if not watch:
            look_ms = int((_ATTENDED_S - unattended_s) * 1000) + 1
            timeout_ms = look_ms if timeout_ms < 0 else min(timeout_ms, look_ms)
        return timeout_ms, watch

    def _on_exit(self) -> None:
        """The thread's exit, however it ends: no more receiving (waiters then wait on their
        wakers and deadlines only)."""
        self._closing.set()
        self._sockets.close_pull()

    def clear_lookup_status(self, lookup_id: str) -> None:
        """Forget ``lookup_id``'s result (the scheduler used it). A lookup still running is abandoned."""
        with self._lock:
            abandoned = self._table.clear(lookup_id)
        self._send_cleanups(lookup_id, abandoned)

    def cancel_lookup(self, lookup_id: str) -> None:
        """The request is gone: forget the lookup and make the workers release what it pinned."""
        with self._lock:
            abandoned = self._table.cancel(lookup_id)
        self._send_cleanups(lookup_id, abandoned)

    def supports_producer_reuse(self) -> bool:
        """True: a producer's stored KV cache can be found by later lookups (as in LMCache)."""
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread, close the sockets (linger 0) and remove the socket file. Idempotent.

        Lookups still running report 0; later ``lookup()`` calls report 0 at once.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            abandoned = self._table.close()
        for lookup_id, running in abandoned:  # what already answered can be released now
            self._send_cleanups(lookup_id, (running.seq, list(running.answers)))
        self._closing.set()
        self._io.wake()
        if not self._io.join(timeout_s):
            logger.warning("lookup client thread did not stop in %.1fs", timeout_s)
        self._sockets.close_push()

    def __enter__(self) -> LMCacheAsyncLookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ extras

    def wait_for_result(self, lookup_id: str, timeout_s: float | None = None) -> int | None:
        """Block until ``lookup_id`` is done (tests, benchmarks, tools; never the scheduler's loop).

        Returns what ``lookup_cache`` then returns: hit tokens, 0 after the lookup timeout, ``-1``
        if it was never asked; None if ``timeout_s`` passed first. The answers are received on this
        thread (it polls the answer socket itself), so they reach it without a hop through the
        background thread; one received elsewhere rings this thread's waker.
        """
        end = time.monotonic() + (self.timeout_s + 1.0 if timeout_s is None else timeout_s)
        mine = self._waiters.mine()
        me = (threading.get_ident(), mine.waker)
        with self._lock:
            state = self._table.state(lookup_id)
            if isinstance(state, int):
                return state
            self._table.add_waiter(lookup_id, me)
        try:
            settled = self._wait(lookup_id, end, mine)
        finally:
            with self._lock:
                self._table.remove_waiter(lookup_id, me)
        return settled if settled is not None else self.lookup_cache(lookup_id)

    def _wait(self, lookup_id: str, end: float, mine: Waiter) -> int | None:
        """``wait_for_result``'s loop: the settled answer, or None at the lookup's deadline or
        ``end``, whichever comes first."""
        while True:
            self._attended_at = time.monotonic()
            self._drain()
            with self._lock:
                running = self._table.state(lookup_id)
                if isinstance(running, int):
                    return running
                to_deadline = running.deadline - self._clock()
                to_end = end - time.monotonic()
                if to_deadline <= 0 or to_end <= 0:
                    return None
                wait_ms = int(min(to_deadline, to_end) * 1000) + 1
            if not self._sockets.pull_open:  # the thread failed and closed the socket: wait on
                mine.wait(wait_ms, socket=False)  # the waker (close, answers) and the deadline
                continue
            mine.wait(min(wait_ms, int(_ATTENDED_S * 1000)))

    def stats(self) -> dict[str, int]:
        """Counters (lookups, completed, timeouts, cancelled, late answers, cleanups sent, ...)."""
        with self._lock:
            return self._table.stats(malformed=self._malformed)

    @property
    def socket_path(self) -> str:
        return str(self._pull_path)

    # ------------------------------------------------------------------ sockets

    def _send_cleanups(self, lookup_id: str, abandoned: Abandoned | None) -> None:
        pending: list[tuple[str, int, list[int]]] = []
        if self._table.pending_cleanups:  # read without the lock: the common case has none
            with self._lock:
                pending = self._table.take_pending_cleanups()
        if abandoned is not None:
            pending.append((lookup_id, abandoned[0], list(abandoned[1])))
        for target_id, seq, workers in pending:
            self._send_cleanup(target_id, seq, workers)

    def _send_cleanup(self, lookup_id: str, seq: int, workers: Iterable[int]) -> None:
        buf = encode(LookupCleanupMsg(lookup_id=lookup_id, seq=seq))
        sent, failed = self._sockets.send(buf, workers)
        for worker in failed:  # queue full or closed: the worker's lock TTL releases them
            logger.debug("could not send the cleanup of %r to worker %d", lookup_id, worker)
        with self._lock:
            self._table.counts["cleanups_sent"] += sent

    # ------------------------------------------------------------------ thread

    def _poll_timeout_ms(self) -> int:
        """Until the first deadline of a lookup still running (-1: none)."""
        with self._lock:
            head = self._table.first_deadline()
        if head is None:
            return -1
        return max(0, int((head - self._clock()) * 1000) + 1)

    def _drain(self) -> int:
        """Read up to ``_RECV_BATCH`` answers and record them; returns how many were read.

        The receive lock is held only for non-blocking receives (microseconds). A caller that finds
        the thread reading waits for it on the lock, which hands the thread the GIL at once (a busy
        poller would otherwise hold it for the 5 ms switch interval). Reading stops at EAGAIN, so the
        socket's FD signals the next message, or at the batch limit, where the thread reads on.
        """
        bufs = self._sockets.receive(_RECV_BATCH)
        if bufs:
            if len(bufs) >= _RECV_BATCH and not self._io.is_current():
                self._io.wake()
            self._handle(bufs)
        return len(bufs)

    def _handle(self, bufs: list[bytes]) -> None:
        msgs: list[LookupResponseMsg] = []
        for buf in bufs:
            try:
                msgs.append(decode_response(buf))
            except LMCacheError as exc:
                self._malformed += 1
                level = logging.WARNING if self._malformed <= _LOGGED_BAD else logging.DEBUG
                logger.log(level, "lookup client: dropping a malformed message (%d bytes): %s",
                           len(buf), exc)
        with self._lock:
            late = [msg for msg in msgs if not self._table.record(msg)]
            self._table.counts["late_answers"] += len(late)
        for msg in late:  # nobody waits for it: release what it pinned
            if msg.worker_id in self._worker_set:
                self._send_cleanup(msg.lookup_id, msg.seq, (msg.worker_id,))
        self._send_cleanups("", None)

    def _expire(self, now: float) -> None:
        with self._lock:
            expired = [(lookup_id, self._table.time_out(lookup_id, running))
                       for lookup_id, running in self._table.due(now)]
        for lookup_id, abandoned in expired:
            self._send_cleanups(lookup_id, abandoned)
