"""``LMCacheAsyncLookupClient``: the scheduler-side half of the async lookup.

``lookup()`` hashes the prompt (``TokenDatabase``, the one prefix-chain implementation), PUSHes one
request to every lookup-server worker and returns ``None`` at once. A background thread polls the
client's PULL socket and an eventfd ``Waker`` (shutdown, and the first deadline of an idle client),
records each worker's answer, and when every expected worker has answered stores the minimum.
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
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import zmq

from lmcache_core.errors import LMCacheError
from lmcache_core.keys import TokenDatabase
from lmcache_core.lookup_client import _ipc
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
from lmcache_core.transport.waker import Waker

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_MAX_RESPONSE_BYTES = 64 * 2**10
_HWM = 100_000
_RECV_BATCH = 512
#: Results nobody cleared are dropped (oldest first, their pins released) beyond this many.
MAX_RESULTS = 1 << 17
_LOGGED_BAD = 10
#: While a caller has received answers itself this recently, the thread does not watch the socket.
_ATTENDED_S = 0.005
_instances = itertools.count()


class _Running:
    """One attempt at a lookup that not every expected worker has answered yet."""

    __slots__ = ("answers", "deadline", "seq")

    def __init__(self, seq: int, deadline: float) -> None:
        self.seq = seq
        self.deadline = deadline
        self.answers: dict[int, int] = {}  # worker id -> hit tokens


class LMCacheAsyncLookupClient(LookupClientInterface):
    """Non-blocking lookups from the scheduler to the workers' ``LMCacheAsyncLookupServer``s."""

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheMetadata, *,
                 context: zmq.Context[Any] | None = None) -> None:
        self.config = config
        self.metadata = metadata
        self.timeout_s = config.lookup_timeout_ms / 1000.0
        self.token_database = TokenDatabase(config.chunk_size)
        self.worker_ids: tuple[int, ...] = metadata.server_worker_ids
        self._worker_set = frozenset(self.worker_ids)
        self._num_workers = len(self.worker_ids)
        self._context = context if context is not None else zmq.Context.instance()
        ensure_private_dir(metadata.runtime_path())
        for path in metadata.scheduler_sockets():  # answer sockets of clients that died
            _ipc.remove_if_stale(path)
        self._pull_path = metadata.scheduler_socket(f"{os.getpid()}-{next(_instances)}")
        self.reply_to = self._pull_path.name
        self._pull, self._pull_inode = _ipc.bind_pull(
            self._context, self._pull_path, _MAX_RESPONSE_BYTES, _HWM)
        self._push: dict[int, zmq.Socket[Any]] = {}
        try:
            for worker in self.worker_ids:
                self._push[worker] = _ipc.connect_push(
                    self._context, metadata.worker_socket(worker), _HWM)
        except Exception:
            self._close_push()
            _ipc.unbind(self._pull, self._pull_path, self._pull_inode)
            raise
        self._lock = threading.Lock()  # guards the state below
        self._send_lock = threading.Lock()  # guards the PUSH sockets
        self._recv_lock = threading.Lock()  # guards the PULL socket
        self._pull_open = True
        # lookup id -> (thread id, waker) of each wait_for_result() caller waiting on it
        self._waiters: dict[str, list[tuple[int, Waker]]] = {}
        self._local = threading.local()  # a waiting caller thread's own poller
        self._attended_at = 0.0  # when a caller last received answers itself
        self._running: dict[str, _Running] = {}
        # lookup id -> (hit tokens, seq, whether workers may still hold pins for it)
        self._results: dict[str, tuple[int, int, bool]] = {}
        self._pending_cleanups: list[tuple[str, int, list[int]]] = []  # queued under the lock
        self._deadlines: deque[tuple[float, int, str]] = deque()  # in deadline order
        # Attempt numbers: next() is atomic under the GIL; starting at the clock keeps them rising
        # across client restarts, so a worker never mistakes a new attempt for an older one.
        self._seqs = itertools.count(time.time_ns())
        self._counts = {"lookups": 0, "completed": 0, "timeouts": 0, "cancelled": 0,
                        "late_answers": 0, "cleanups_sent": 0, "send_failures": 0}
        self._malformed = 0
        self._waker = Waker()
        self._closing = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self.process_responses_from_workers,
                                        name="lmcache-lookup-client", daemon=True)
        self._thread.start()
        logger.info("lookup client for %s: %d lookup servers, answers at %s",
                    metadata.engine_id, self._num_workers, self._pull_path)

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
            self._counts["lookups"] += 1
            abandoned = self._forget(lookup_id)
            started = bool(hashes) and not self._closed
            if started:
                deadline = time.monotonic() + self.timeout_s
                self._running[lookup_id] = _Running(seq, deadline)
                wake = not self._deadlines  # deadlines are appended in order: only a new head wakes
                self._deadlines.append((deadline, seq, lookup_id))
            else:  # nothing to look up (no complete chunk), or closed: 0 at once
                self._finish(lookup_id, 0, seq, pinned=False)
                wake = False
        self._send_cleanups(lookup_id, abandoned)
        if not started:
            return None
        failed = self._send_all(buf)
        if failed:  # a worker's queue is full (it is not reading): recompute now, not at the timeout
            logger.warning("lookup %r: could not reach lookup server(s) %s; reporting 0 hit tokens",
                           lookup_id, failed)
            with self._lock:
                running = self._running.get(lookup_id)
                if running is not None and running.seq == seq:
                    del self._running[lookup_id]
                    self._finish(lookup_id, 0, seq, pinned=False)
                    abandoned = (seq, list(running.answers))
                else:
                    abandoned = None
            self._send_cleanups(lookup_id, abandoned)
        elif wake:
            self._waker.wake()  # the thread may be polling with no deadline at all
        return None

    def lookup_cache(self, lookup_id: str) -> int | None:
        """``-1``: never asked (or cancelled/cleared); ``None``: still running; ``n >= 0``: hit tokens.

        A lookup still running ``lookup_timeout_ms`` after ``lookup()`` reports 0 (and is cancelled).
        Never sleeps: a dict read under a lock held only for dict work and, while the lookup runs, a
        non-blocking read of the answers that have arrived.
        """
        with self._lock:
            running = self._state_locked(lookup_id)
            if isinstance(running, int):
                return running
            now = time.monotonic()
            expired = now >= running.deadline
            if expired:
                abandoned = self._time_out(lookup_id, running)
        if expired:
            self._send_cleanups(lookup_id, abandoned)
            return 0
        self._attended_at = now
        if not self._drain():
            return None
        with self._lock:
            state = self._state_locked(lookup_id)
        return state if isinstance(state, int) else None

    def process_responses_from_workers(self) -> None:
        """The background thread's loop (started by the constructor; do not call it yourself).

        It expires lookups at their deadlines and receives the answers nobody else does. While a
        caller has been receiving answers itself (``lookup_cache`` on a running lookup,
        ``wait_for_result``) within ``_ATTENDED_S``, it does not watch the socket: woken by every
        answer, it would only compete for the GIL and the receive lock with the caller reading that
        answer. It then looks again (and drains) every ``_ATTENDED_S``, so an answer nobody reads
        waits at most that long.
        """
        poller = select.poll()
        poller.register(self._waker.fd, select.POLLIN)
        zmq_fd: Any = self._pull.get(zmq.FD)
        waker_fd = self._waker.fd
        watching = False
        try:
            while not self._closing.is_set():
                while self._drain() >= _RECV_BATCH:
                    pass
                now = time.monotonic()
                self._expire(now)
                timeout_ms = self._poll_timeout_ms()
                unattended_s = now - self._attended_at
                watch = unattended_s >= _ATTENDED_S
                if not watch:
                    look_ms = int((_ATTENDED_S - unattended_s) * 1000) + 1
                    timeout_ms = look_ms if timeout_ms < 0 else min(timeout_ms, look_ms)
                if watch != watching:
                    # Registering after a drain that read to EAGAIN: ZMQ_FD signals what comes next.
                    if watch:
                        poller.register(zmq_fd, select.POLLIN)
                    else:
                        poller.unregister(zmq_fd)
                    watching = watch
                for fd, _ in poller.poll(timeout_ms):
                    if fd == waker_fd:
                        self._waker.drain()
        except Exception:
            logger.exception("lookup client thread failed")
        finally:
            self._closing.set()
            with self._recv_lock:
                self._pull_open = False
                _ipc.unbind(self._pull, self._pull_path, self._pull_inode)
            self._waker.close()

    def clear_lookup_status(self, lookup_id: str) -> None:
        """Forget ``lookup_id``'s result (the scheduler used it). A lookup still running is abandoned."""
        with self._lock:
            self._results.pop(lookup_id, None)
            running = self._running.pop(lookup_id, None)
            abandoned = (running.seq, list(running.answers)) if running is not None else None
        self._send_cleanups(lookup_id, abandoned)

    def cancel_lookup(self, lookup_id: str) -> None:
        """The request is gone: forget the lookup and make the workers release what it pinned."""
        with self._lock:
            if lookup_id in self._running or lookup_id in self._results:
                self._counts["cancelled"] += 1
            abandoned = self._forget(lookup_id)
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
            abandoned = list(self._running.items())
            for lookup_id, running in abandoned:
                self._finish(lookup_id, 0, running.seq, pinned=False)
            self._running.clear()
            for waiters in self._waiters.values():
                for _, waker in waiters:
                    waker.wake()
        for lookup_id, running in abandoned:  # what already answered can be released now
            self._send_cleanups(lookup_id, (running.seq, list(running.answers)))
        self._closing.set()
        self._waker.wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("lookup client thread did not stop in %.1fs", timeout_s)
        with self._send_lock:
            self._close_push()

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
        me = (threading.get_ident(), self._wait_state())
        with self._lock:
            state = self._state_locked(lookup_id)
            if isinstance(state, int):
                return state
            self._waiters.setdefault(lookup_id, []).append(me)
        poller, waker = self._local.poller, me[1]
        try:
            while True:
                self._attended_at = time.monotonic()
                self._drain()
                with self._lock:
                    running = self._state_locked(lookup_id)
                    if isinstance(running, int):
                        return running
                    now = time.monotonic()
                    if now >= running.deadline or now >= end:
                        break
                    wait_ms = int((min(running.deadline, end) - now) * 1000) + 1
                if not self._pull_open:  # the thread failed and closed the socket: wait on the
                    self._local.waker_only.poll(wait_ms)  # waker (close, answers) and the deadline
                    waker.drain()
                    continue
                for fd, _ in poller.poll(min(wait_ms, int(_ATTENDED_S * 1000))):
                    if fd == waker.fd:
                        waker.drain()
        finally:
            with self._lock:
                waiters = self._waiters.get(lookup_id)
                if waiters is not None:
                    waiters.remove(me)
                    if not waiters:
                        del self._waiters[lookup_id]
        return self.lookup_cache(lookup_id)

    def _state_locked(self, lookup_id: str) -> int | _Running:
        """What ``lookup_cache`` answers for a settled id (hit tokens, or -1 if never asked), or
        the lookup still running."""
        result = self._results.get(lookup_id)
        if result is not None:
            return result[0]
        running = self._running.get(lookup_id)
        return -1 if running is None else running

    def _wait_state(self) -> Waker:
        """This thread's waker, and its poller of the answer socket and that waker (made once)."""
        waker: Waker | None = getattr(self._local, "waker", None)
        if waker is None:
            waker = Waker()
            poller = select.poll()
            zmq_fd: Any = self._pull.get(zmq.FD)
            poller.register(zmq_fd, select.POLLIN)
            poller.register(waker.fd, select.POLLIN)
            waker_only = select.poll()
            waker_only.register(waker.fd, select.POLLIN)
            self._local.waker, self._local.poller, self._local.waker_only = waker, poller, waker_only
        return waker

    def _notify(self, lookup_id: str) -> None:
        """``lookup_id`` is done (under the lock): wake the callers waiting on it on other threads."""
        waiters = self._waiters.get(lookup_id)
        if waiters:
            me = threading.get_ident()
            for ident, waker in waiters:
                if ident != me:
                    waker.wake()

    def stats(self) -> dict[str, int]:
        """Counters (lookups, completed, timeouts, cancelled, late answers, cleanups sent, ...)."""
        with self._lock:
            out = dict(self._counts)
            out.update(malformed=self._malformed, running=len(self._running),
                       results=len(self._results))
        return out

    @property
    def socket_path(self) -> str:
        return str(self._pull_path)

    # ------------------------------------------------------------------ state (under self._lock)

    def _finish(self, lookup_id: str, hit_tokens: int, seq: int, pinned: bool) -> None:
        """Store a result; ``pinned``: workers may hold pins for it until a retrieve or a cleanup."""
        results = self._results
        results[lookup_id] = (hit_tokens, seq, pinned)
        if len(results) > MAX_RESULTS:  # never cleared: drop the oldest, and its pins
            old_id = next(iter(results))
            _, old_seq, old_pinned = results.pop(old_id)
            if old_pinned:
                self._pending_cleanups.append((old_id, old_seq, list(self.worker_ids)))

    def _forget(self, lookup_id: str) -> tuple[int, list[int]] | None:
        """Drop ``lookup_id``'s attempt; returns ``(seq, workers to clean up)`` if it held pins."""
        result = self._results.pop(lookup_id, None)
        if result is not None:
            _, seq, pinned = result
            return (seq, list(self.worker_ids)) if pinned else None
        running = self._running.pop(lookup_id, None)
        if running is not None:
            return running.seq, list(running.answers)
        return None

    def _time_out(self, lookup_id: str, running: _Running) -> tuple[int, list[int]]:
        del self._running[lookup_id]
        self._finish(lookup_id, 0, running.seq, pinned=False)  # the caller cleans up what answered
        self._counts["timeouts"] += 1
        self._notify(lookup_id)
        timeouts = self._counts["timeouts"]
        if timeouts <= _LOGGED_BAD or timeouts % 1000 == 0:  # a dead worker must not flood the log
            missing = [w for w in self.worker_ids if w not in running.answers]
            logger.warning("lookup %r: no answer from worker(s) %s within %d ms; reporting 0 hit "
                           "tokens (%d timeouts so far)", lookup_id, missing,
                           self.config.lookup_timeout_ms, timeouts)
        return running.seq, list(running.answers)

    # ------------------------------------------------------------------ sockets

    def _send_all(self, buf: bytes) -> list[int]:
        failed: list[int] = []
        with self._send_lock:
            for worker, sock in self._push.items():
                try:
                    sock.send(buf, zmq.NOBLOCK)
                except (zmq.Again, zmq.ZMQError):
                    failed.append(worker)
        if failed:
            with self._lock:
                self._counts["send_failures"] += 1
        return failed

    def _send_cleanups(self, lookup_id: str, abandoned: tuple[int, Iterable[int]] | None) -> None:
        pending = self._take_pending_cleanups()
        if abandoned is not None:
            pending.append((lookup_id, abandoned[0], list(abandoned[1])))
        for target_id, seq, workers in pending:
            self._send_cleanup(target_id, seq, workers)

    def _send_cleanup(self, lookup_id: str, seq: int, workers: Iterable[int]) -> None:
        buf = encode(LookupCleanupMsg(lookup_id=lookup_id, seq=seq))
        sent = 0
        with self._send_lock:
            for worker in workers:
                sock = self._push.get(worker)
                if sock is None:
                    continue
                try:
                    sock.send(buf, zmq.NOBLOCK)
                    sent += 1
                except zmq.ZMQError:  # queue full or closed: the worker's lock TTL releases them
                    logger.debug("could not send the cleanup of %r to worker %d", lookup_id, worker)
        with self._lock:
            self._counts["cleanups_sent"] += sent

    def _take_pending_cleanups(self) -> list[tuple[str, int, list[int]]]:
        if not self._pending_cleanups:
            return []
        with self._lock:
            pending = list(self._pending_cleanups)
            self._pending_cleanups.clear()
        return pending

    def _close_push(self) -> None:
        for sock in self._push.values():
            sock.close(0)
        self._push.clear()

    # ------------------------------------------------------------------ thread

    def _poll_timeout_ms(self) -> int:
        """Until the first deadline of a lookup still running (-1: none); stale heads are dropped."""
        with self._lock:
            deadlines, running = self._deadlines, self._running
            while deadlines:
                _, seq, lookup_id = deadlines[0]
                attempt = running.get(lookup_id)
                if attempt is not None and attempt.seq == seq:
                    break
                deadlines.popleft()
            if not deadlines:
                return -1
            head = deadlines[0][0]
        return max(0, int((head - time.monotonic()) * 1000) + 1)

    def _drain(self) -> int:
        """Read up to ``_RECV_BATCH`` answers and record them; returns how many were read.

        The receive lock is held only for non-blocking receives (microseconds). A caller that finds
        the thread reading waits for it on the lock, which hands the thread the GIL at once (a busy
        poller would otherwise hold it for the 5 ms switch interval). Reading stops at EAGAIN, so the
        socket's FD signals the next message, or at the batch limit, where the thread reads on.
        """
        bufs: list[bytes] = []
        with self._recv_lock:
            if not self._pull_open:
                return 0
            sock = self._pull
            for _ in range(_RECV_BATCH):  # to EVENTS without POLLIN: re-arms ZMQ_FD, raises nothing
                if not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
                    break
                try:
                    bufs.append(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
        if bufs:
            if len(bufs) >= _RECV_BATCH and threading.current_thread() is not self._thread:
                self._waker.wake()
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
            late = [msg for msg in msgs if not self._record(msg)]
            self._counts["late_answers"] += len(late)
        for msg in late:  # nobody waits for it: release what it pinned
            if msg.worker_id in self._worker_set:
                self._send_cleanup(msg.lookup_id, msg.seq, (msg.worker_id,))
        self._send_cleanups("", None)

    def _record(self, msg: LookupResponseMsg) -> bool:
        """Count one worker's answer (under the lock); False when nobody waits for it."""
        running = self._running.get(msg.lookup_id)
        if running is None or running.seq != msg.seq:
            return False
        answers = running.answers
        if msg.worker_id not in self._worker_set or msg.worker_id in answers:
            logger.warning("lookup %r: dropping an unexpected answer from worker %d",
                           msg.lookup_id, msg.worker_id)
            return True
        answers[msg.worker_id] = msg.num_hit_tokens
        if len(answers) == self._num_workers:
            del self._running[msg.lookup_id]
            self._finish(msg.lookup_id, min(answers.values()), msg.seq,
                         pinned=max(answers.values()) > 0)
            self._counts["completed"] += 1
            if self._waiters:
                self._notify(msg.lookup_id)
        return True

    def _expire(self, now: float) -> None:
        expired: list[tuple[str, tuple[int, list[int]]]] = []
        with self._lock:
            deadlines = self._deadlines
            while deadlines and deadlines[0][0] <= now:
                _, seq, lookup_id = deadlines.popleft()
                running = self._running.get(lookup_id)
                if running is not None and running.seq == seq:
                    expired.append((lookup_id, self._time_out(lookup_id, running)))
        for lookup_id, abandoned in expired:
            self._send_cleanups(lookup_id, abandoned)
