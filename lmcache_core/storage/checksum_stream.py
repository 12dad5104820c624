"""A store's checksums, taken off its reply path: each piece is hashed on a lane thread, part by part
while the gather still copies (for big stores) or whole right after it, and the digests are handed
to a callback once taken (``PieceChecksums.finish``); the store has replied by then.

Why: the hash reads every byte the gather just wrote. Waiting for it held stores at 0.6-0.8x the
raw gather on a 2-core host (``docs/benchmarks.md``). The store's pieces are visible as soon as
their bytes are in; whatever relies on a checksum (a tier write, a verified retrieve, room for
another store) waits for it in the engine (``PieceStore.wait_checksums``), while the hash holds
the pieces (their slots are not reused under it).

Streaming: the copy thread reports each part of a piece written (``written``), and the lane hashes
it while it is still in the CPU's cache, on another core (xxhash and torch's copies both release
the GIL). The digest is the same as ``integrity.checksum`` of the whole piece (xxh3-64 streamed
equals xxh3-64 in one call; 0 mapped to 1). A piece nobody reported (a copy from a GPU lands only
when its stream is synchronized) is hashed whole once the gather is done.

A lane is one single-thread executor, so a piece's parts and its digest are taken in order. A store
holds a lane while it gathers (a lane per copy thread: no wait for a free one) and gives it back
when it hands over its last step; the lane finishes the hash after. Small stores hash on the copy
thread before their commit (a hand-off costs about what their hash does).

Bounds: a store's digests that are not in ``LANE_TIMEOUT_S`` after its gather are given up
(``reap``, from the server's housekeeping): the callback gets None, the stuck lane is retired with
every store queued on it; a store that fails cancels its queued parts and waits (bounded) for the
one running, so no hash reads its slots once they are freed; ``close`` drains the lanes for a
bounded time and gives up the rest.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import xxhash

from lmcache_core.storage.integrity import checksum

logger = logging.getLogger(__name__)

# Parts are handed to the lane in steps of at least this many bytes (per hand-off ~10 us).
PART_BYTES = 4 << 20
# From this many bytes in a store, pieces are hashed part by part while the gather copies.
MIN_STREAMED_BYTES = 8 << 20
# Below this many bytes in a store, pieces are hashed on the copy thread before the commit: the
# hash (~20 us) costs no more than handing it to a lane.
MAX_INLINE_BYTES = 256 << 10
# The longest a store's hash may take after its gather (then given up, its lane retired), and the
# longest a failed store waits for its lane to stop reading its slots.
LANE_TIMEOUT_S = 60.0

#: ``on_digests(digests)``: one checksum per piece, or None when they could not be taken.
OnDigests = Callable[[list[int] | None], None]


class ChecksumLanes:
    """The lanes stores hash on; ``begin`` hands one to a store (created on first need), and the
    stores whose digests are still to come. Once closed, stores hash inline (no lane is created
    that nothing would shut down)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._free: queue.SimpleQueue[ThreadPoolExecutor] = queue.SimpleQueue()
        self._all: list[ThreadPoolExecutor] = []
        self._lock = threading.Lock()
        self._closed = False
        self._clock = clock
        #: Stores whose last step is on a lane: their lane and the time their digests are due by.
        self._due: dict[PieceChecksums, tuple[ThreadPoolExecutor, float]] = {}

    def begin(self, slots: Sequence[Any], piece_bytes: int) -> PieceChecksums:
        """Checksums for the pieces ``slots`` (flat uint8 tensors of ``piece_bytes`` each)."""
        total = len(slots) * piece_bytes
        if total < MAX_INLINE_BYTES:
            return PieceChecksums(None, self, slots, piece_bytes, streaming=False)
        return PieceChecksums(self._take(), self, slots, piece_bytes,
                              streaming=total >= MIN_STREAMED_BYTES)

    @property
    def pending(self) -> int:
        """Stores whose digests are still being taken."""
        with self._lock:
            return len(self._due)

    def _take(self) -> ThreadPoolExecutor | None:
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

    def _expect(self, job: PieceChecksums, lane: ThreadPoolExecutor) -> None:
        """``job``'s last step goes to ``lane`` now: its digests are due within
        ``LANE_TIMEOUT_S``."""
        with self._lock:
            self._due[job] = (lane, self._clock() + LANE_TIMEOUT_S)

    def _settled(self, job: PieceChecksums) -> None:
        with self._lock:
            self._due.pop(job, None)

    def retire(self, lane: ThreadPoolExecutor) -> None:
        """A lane that did not finish in time: never handed out again, shut down without a wait;
        the stores queued on it get no digests."""
        with self._lock:
            if lane in self._all:
                self._all.remove(lane)
            stuck = [job for job, (on, _) in self._due.items() if on is lane]
        lane.shutdown(wait=False, cancel_futures=True)
        for job in stuck:
            job.settle(None)

    def reap(self) -> int:
        """Give up the digests overdue (``LANE_TIMEOUT_S`` after their gather) and retire their
        lanes; how many stores' were given up."""
        now = self._clock()
        with self._lock:
            late = {lane for lane, due in self._due.values() if due <= now}
            stuck = sum(1 for lane, _ in self._due.values() if lane in late)
        for lane in late:
            logger.warning("store checksums: a hashing lane did not finish in %g s; retired, its "
                           "stores' pieces dropped", LANE_TIMEOUT_S)
            self.retire(lane)
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
        return not late


class PieceChecksums:
    """One store's pieces. The copier reports ``written(i, n)`` (piece ``i``'s first ``n`` bytes
    are in, in increasing ``n``). Then, without a lane (``deferred`` False), ``digests()`` hashes
    here; with one, ``finish(on_digests)`` hands the rest to the lane and returns at once. A store
    that failed calls ``abandon()`` instead (it gives the lane back)."""

    def __init__(self, lane: ThreadPoolExecutor | None, lanes: ChecksumLanes,
                 slots: Sequence[Any], piece_bytes: int, *, streaming: bool) -> None:
        self._lane = lane
        self._lanes = lanes
        self._slots = slots
        self._piece_bytes = piece_bytes
        self._streaming = streaming and lane is not None
        self._hashers: dict[int, Any] = {}
        self._hashed: dict[int, int] = {}
        self._parts: list[Future[None]] = []
        self.final: Future[None] | None = None  # the lane's last step (digests to the callback)
        self._on_digests: OnDigests | None = None
        self._settle_lock = threading.Lock()

    @property
    def streaming(self) -> bool:
        """Whether parts are hashed while the gather copies (``written`` is worth calling)."""
        return self._streaming

    @property
    def deferred(self) -> bool:
        """Whether the digests come after the store (``finish``), not before its commit."""
        return self._lane is not None

    def written(self, index: int, nbytes: int) -> None:
        """Piece ``index``'s bytes ``[0, nbytes)`` are in the pool: hash what is new once there
        is a part's worth (or the piece is complete)."""
        if not self._streaming:
            return
        start = self._hashed.get(index, 0)
        if nbytes - start < PART_BYTES and nbytes < self._piece_bytes:
            return
        hasher = self._hashers.get(index)
        if hasher is None:
            hasher = self._hashers[index] = xxhash.xxh3_64()
        part = self._slots[index][start:nbytes].numpy()
        assert self._lane is not None
        self._parts.append(self._lane.submit(hasher.update, part))
        self._hashed[index] = nbytes

    def digests(self) -> list[int]:
        """One checksum per piece, hashed here (a store without a lane)."""
        assert self._lane is None, "a store with a lane gets its digests through finish()"
        return [checksum(slot[: self._piece_bytes]) for slot in self._slots]

    def finish(self, on_digests: OnDigests) -> None:
        """Every piece's bytes are in (and the store committed): the lane takes what is left and
        calls ``on_digests`` with one checksum per piece, or None when they could not be taken
        (the lane failed, got stuck, or the server stopped first). Returns at once."""
        lane, self._lane = self._lane, None
        assert lane is not None, "finish() is for a store with a lane (deferred)"
        self._on_digests = on_digests
        self._lanes._expect(self, lane)  # before the submit: it may settle at once
        try:
            self.final = lane.submit(self._complete)
        except RuntimeError:  # the lane was shut down (the server is closing): hash here
            self._complete()
            return
        self._lanes._free.put(lane)  # free for the next store: it finishes this one first

    def abandon(self) -> None:
        """The store failed: its queued parts are cancelled and the one running waited for (it
        reads the slots about to be freed), for at most ``LANE_TIMEOUT_S``; the lane goes back.
        Never raises (its caller is failing already): a lane still busy then is logged and
        retired."""
        lane, parts = self._lane, self._parts
        self._lane, self._parts = None, []
        if lane is None:
            return
        # Only the part already running is waited for: a cancelled one counts as done for
        # ``wait`` only once the lane's thread reaches it, i.e. after whatever runs before it
        # (another store's part, possibly stuck) - the failed store would wait that out.
        running = [part for part in parts if not part.cancel()]
        _, late = wait(running, timeout=LANE_TIMEOUT_S)
        if late:
            logger.warning("store checksums: the hashing lane did not finish in %g s after a "
                           "failed store; retired", LANE_TIMEOUT_S)
            self._lanes.retire(lane)
        else:
            self._lanes._free.put(lane)

    def settle(self, digests: list[int] | None) -> None:
        """Hand ``digests`` (None: given up) to the callback, once: the first of the lane's last
        step, ``reap`` and ``close`` wins."""
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
        """The lane's last step (its parts are done: one thread, in order)."""
        try:
            for part in self._parts:
                part.result(timeout=0)  # done: re-raises a part that failed
            digests: list[int] | None = [self._digest(i, slot)
                                         for i, slot in enumerate(self._slots)]
        except Exception:
            logger.exception("store checksums: hashing failed; the store's pieces are dropped")
            digests = None
        self.settle(digests)

    def _digest(self, index: int, slot: Any) -> int:
        if self._hashed.get(index) == self._piece_bytes:
            return self._hashers[index].intdigest() or 1
        return checksum(slot[: self._piece_bytes])
