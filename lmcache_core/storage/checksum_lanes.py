"""A store's checksums, taken off its reply path: once the store's reply has gone out, each of its
pieces is hashed whole on a lane thread, and the digests are handed to a callback
(``PieceChecksums.finish`` registers it; the ``start`` it returns hands the hash to a lane).

Why after the reply, not during the gather: the hash reads every byte the gather just wrote, and on
a small host its core is one the gather's and the reply's threads need. Measured on 2 cores
(``docs/benchmarks.md``, "Checksums off the store's reply path"): hashing inside the copy held
stores at 0.6-0.8x the raw gather; hashing each layer's part as the gather wrote it (this module's
earlier "streaming" mode, memory read while still in cache) replied at 0.66x/0.84x (4/8 chunks)
against 0.84x/0.95x for hashing whole pieces after the gather, and starting that hash only once
the reply is sent matches a server with no hashing at all (both 0.9x at 4 chunks). On a GPU host
the gather's bytes land at the stream's end anyway, so a streamed hash never applied there.

The store's pieces are visible as soon as their bytes are in (committed as PENDING); whatever
relies on a checksum (a tier write, a verified retrieve, room for another store) waits for it in
the engine (``PieceStore.wait_checksums``), and the hash holds the pieces (their slots are not
reused under it). Small stores hash on the copy thread before their commit: a hand-off costs about
what their hash does.

A lane is one single-thread executor, taken by a store when its hash starts and given back right
after the hand-off (it finishes that hash before the next store's): as many lanes as stores hash
at once. A hash first lets the copies running then finish (``Copies``: the server's gathers and
scatters), for at most ``YIELD_S``: a hybrid model stores one request per KV-cache group side by
side, and the first group's hash beside the others' gathers held its stores at 0.63-0.67x the raw
gather against 0.80-0.82x with no hash (``bench_server.py --only hybrid``); a retrieve on a hit's
path is not slowed by an earlier store's hash either. Bounded, so a stream of copies never starves
a hash (its pieces stay pending meanwhile).

Bounds: a store's digests that are not in ``LANE_TIMEOUT_S`` after its commit are given up
(``reap``, from the server's housekeeping): the callback gets None, and a stuck lane is retired
with every store queued on it; ``close`` drains the lanes for a bounded time and gives up the rest.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

from lmcache_core.storage.integrity import checksum

logger = logging.getLogger(__name__)

# Below this many bytes in a store, pieces are hashed on the copy thread before the commit: the
# hash (~20 us) costs no more than handing it to a lane.
MAX_INLINE_BYTES = 256 << 10
# The longest a store's hash may take after its commit (then given up, its lane retired).
LANE_TIMEOUT_S = 60.0
# The longest a hash waits for the copies running when it starts (about one 256 MiB gather).
YIELD_S = 0.05

#: ``on_digests(digests)``: one checksum per piece, or None when they could not be taken.
OnDigests = Callable[[list[int] | None], None]


class Copies:
    """How many copies (gathers, scatters) run now, for the hashes to let them finish first."""

    def __init__(self) -> None:
        self._running = 0
        self._idle = threading.Condition()

    @contextmanager
    def running(self) -> Iterator[None]:
        with self._idle:
            self._running += 1
        try:
            yield
        finally:
            with self._idle:
                self._running -= 1
                if not self._running:
                    self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Until no copy runs (True), or ``timeout_s`` passed (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._running, timeout_s)


class ChecksumLanes:
    """The lanes stores hash on (created on first need, reused once given back), and the stores
    whose digests are still to come. Once closed, stores hash inline (no lane is created that
    nothing would shut down)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.copies = Copies()  # the server's copies mark themselves here (``Copies.running``)
        self._free: queue.SimpleQueue[ThreadPoolExecutor] = queue.SimpleQueue()
        self._all: list[ThreadPoolExecutor] = []
        self._lock = threading.Lock()
        self._closed = False
        self._clock = clock
        #: Stores whose digests are to come: the time they are due by.
        self._due: dict[PieceChecksums, float] = {}

    def begin(self, slots: Sequence[Any], piece_bytes: int) -> PieceChecksums:
        """Checksums for the pieces ``slots`` (flat uint8 tensors of ``piece_bytes`` each)."""
        deferred = len(slots) * piece_bytes >= MAX_INLINE_BYTES and not self._closed
        return PieceChecksums(self, slots, piece_bytes, deferred=deferred)

    @property
    def pending(self) -> int:
        """Stores whose digests are still being taken."""
        with self._lock:
            return len(self._due)

    def _take(self) -> ThreadPoolExecutor | None:
        """A free lane (a new one when none is), or None once closed."""
        with self._lock:
            if self._closed:
                return None
            while True:
                try:
                    lane = self._free.get_nowait()
                except queue.Empty:
                    lane = ThreadPoolExecutor(1, thread_name_prefix="lmcache-checksum")
                    self._all.append(lane)
                    return lane
                if lane in self._all:  # (a retired lane given back late is dropped)
                    return lane

    def _expect(self, job: PieceChecksums) -> None:
        """``job`` committed: its digests are due within ``LANE_TIMEOUT_S``."""
        with self._lock:
            self._due[job] = self._clock() + LANE_TIMEOUT_S

    def _settled(self, job: PieceChecksums) -> None:
        with self._lock:
            self._due.pop(job, None)

    def retire(self, lane: ThreadPoolExecutor) -> None:
        """A lane that did not finish in time: never handed out again, shut down without a wait;
        the stores queued on it get no digests."""
        with self._lock:
            if lane in self._all:
                self._all.remove(lane)
            stuck = [job for job in self._due if job.lane is lane]
        lane.shutdown(wait=False, cancel_futures=True)
        for job in stuck:
            job.settle(None)

    def reap(self) -> int:
        """Give up the digests overdue (``LANE_TIMEOUT_S`` after their commit), retiring the
        lanes they are stuck on; how many stores' were given up."""
        now = self._clock()
        with self._lock:
            late = [job for job, due in self._due.items() if due <= now]
            lanes = {job.lane for job in late if job.lane is not None}
            stuck = sum(1 for job in self._due if job in late or job.lane in lanes)
        for lane in lanes:
            logger.warning("store checksums: a hashing lane did not finish in %g s; retired, its "
                           "stores' pieces dropped", LANE_TIMEOUT_S)
            self.retire(lane)
        for job in late:  # (one never started, e.g. its reply never went: no lane to retire)
            job.settle(None)
        return stuck

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop handing out lanes, let the digests still being taken finish for at most
        ``timeout_s``, give up the others, and shut the lanes down. True if all were taken.
        Idempotent."""
        with self._lock:
            self._closed = True
            finals = [job.final for job in self._due if job.final is not None]
            lanes, self._all = self._all, []
        _, late = wait(finals, timeout=timeout_s)
        for lane in lanes:
            lane.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            left = list(self._due)
        for job in left:
            job.settle(None)
        return not late and not left


class PieceChecksums:
    """One store's pieces, once their bytes are in. Not ``deferred``: ``digests()`` hashes them
    here, before the commit. ``deferred``: ``finish(on_digests)`` at the commit, then the
    ``start`` it returns once the store's reply is out hands the hash to a lane; the lane calls
    ``on_digests``."""

    def __init__(self, lanes: ChecksumLanes, slots: Sequence[Any], piece_bytes: int, *,
                 deferred: bool) -> None:
        self._lanes = lanes
        self._slots = slots
        self._piece_bytes = piece_bytes
        self.deferred = deferred
        self.lane: ThreadPoolExecutor | None = None  # the lane hashing them, once started
        self.final: Future[None] | None = None  # that lane's job (digests to the callback)
        self._on_digests: OnDigests | None = None
        self._settle_lock = threading.Lock()

    def digests(self) -> list[int]:
        """One checksum per piece, hashed here (a store that is not ``deferred``)."""
        return [checksum(slot[: self._piece_bytes]) for slot in self._slots]

    def finish(self, on_digests: OnDigests) -> Callable[[], None]:
        """The store committed its pieces as pending: ``on_digests`` gets one checksum per piece,
        or None when they could not be taken (the hash failed, got stuck or never started in
        ``LANE_TIMEOUT_S``, or the server stopped first). Returns ``start``: call it once the
        store's reply is out; it hands the hash to a lane and returns at once (closed: it hashes
        right there)."""
        assert self.deferred, "finish() is for a deferred store; others call digests()"
        self._on_digests = on_digests
        self._lanes._expect(self)
        return self._start

    def _start(self) -> None:
        lane = self._lanes._take()
        if lane is None:  # the server is closing: no lane is left to hand it to
            self._complete()
            return
        self.lane = lane
        try:
            self.final = lane.submit(self._complete)
        except RuntimeError:  # the lane was shut down meanwhile (closing): hash here
            self._complete()
            return
        self._lanes._free.put(lane)  # free for the next store: it finishes this one first

    def settle(self, digests: list[int] | None) -> None:
        """Hand ``digests`` (None: given up) to the callback, once: the first of the lane's job,
        ``reap`` and ``close`` wins."""
        with self._settle_lock:
            on_digests, self._on_digests = self._on_digests, None
        if on_digests is None:
            return
        self._lanes._settled(self)
        try:
            on_digests(digests)
        except Exception:  # a bug in the callback: logged, the lane goes on for other stores
            logger.exception("store checksums: recording them failed")

    def _complete(self) -> None:
        self._lanes.copies.wait_idle(YIELD_S)
        try:
            digests: list[int] | None = self.digests()
        except Exception:
            logger.exception("store checksums: hashing failed; the store's pieces are dropped")
            digests = None
        self.settle(digests)
