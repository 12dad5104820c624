"""Checksums taken while a store is still copying: each piece is hashed part by part on a lane
thread as soon as the copy thread reports its bytes written, so hashing chunk ``i`` overlaps the
gather of what follows (xxhash and torch's copies both release the GIL).

Hashing after the whole gather reads every byte back from memory once more: on a 2-core host that
cost a store ~20 % of the raw gather's speed. Parts are hashed while they are still in the CPU's
cache, on another core. The digest is the same as ``integrity.checksum`` of the whole piece
(xxh3-64 streamed equals xxh3-64 in one call; 0 mapped to 1).

A lane is one single-thread executor, so the parts of one piece are hashed in order; a store
holds one lane for its duration (a lane per copy thread is enough: no wait for a free lane). A
piece nobody reported (a copy from a GPU lands only when its stream is synchronized) is hashed
whole by ``digests``. Small stores skip the lane (a hand-off costs more than it saves).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import xxhash

from lmcache_core.errors import LMCacheTimeoutError
from lmcache_core.storage.integrity import checksum

logger = logging.getLogger(__name__)

# Parts are handed to the lane in steps of at least this many bytes (per hand-off ~10 us).
PART_BYTES = 4 << 20
# Below this many bytes in a store, pieces are hashed on the copy thread after the gather.
MIN_STREAMED_BYTES = 8 << 20
# The longest a store waits for its lane's parts (a stuck lane fails the store, never hangs it;
# the lane is then retired, not given back).
LANE_TIMEOUT_S = 60.0


class ChecksumLanes:
    """The lanes stores hash on; ``begin`` hands one to a store (created on first need). Once
    closed, stores hash inline (no lane is created that nothing would shut down)."""

    def __init__(self) -> None:
        self._free: queue.SimpleQueue[ThreadPoolExecutor] = queue.SimpleQueue()
        self._all: list[ThreadPoolExecutor] = []
        self._lock = threading.Lock()
        self._closed = False

    def begin(self, slots: Sequence[Any], piece_bytes: int) -> PieceChecksums:
        """Checksums for the pieces ``slots`` (flat uint8 tensors of ``piece_bytes`` each)."""
        if len(slots) * piece_bytes < MIN_STREAMED_BYTES:
            return PieceChecksums(None, self, slots, piece_bytes)
        with self._lock:
            if self._closed:
                lane = None
            else:
                try:
                    lane = self._free.get_nowait()
                except queue.Empty:
                    lane = ThreadPoolExecutor(1, thread_name_prefix="lmcache-checksum")
                    self._all.append(lane)
        return PieceChecksums(lane, self, slots, piece_bytes)

    def give_back(self, lane: ThreadPoolExecutor) -> None:
        self._free.put(lane)

    def retire(self, lane: ThreadPoolExecutor) -> None:
        """A lane that did not finish in time: never handed out again, shut down without a wait."""
        with self._lock:
            if lane in self._all:
                self._all.remove(lane)
        lane.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes, self._all = self._all, []
        for lane in lanes:
            lane.shutdown(wait=True)


class PieceChecksums:
    """One store's pieces: ``written(i, n)`` says piece ``i``'s first ``n`` bytes are in (called
    by the copier, in increasing ``n``); ``digests()`` waits for the lane and returns one checksum
    per piece. Always call ``digests`` (or ``abandon``): it gives the lane back."""

    def __init__(self, lane: ThreadPoolExecutor | None, lanes: ChecksumLanes,
                 slots: Sequence[Any], piece_bytes: int) -> None:
        self._lane = lane
        self._lanes = lanes
        self._slots = slots
        self._piece_bytes = piece_bytes
        self._hashers: dict[int, Any] = {}
        self._hashed: dict[int, int] = {}
        self._pending: list[Future[None]] = []

    @property
    def streaming(self) -> bool:
        return self._lane is not None

    def written(self, index: int, nbytes: int) -> None:
        """Piece ``index``'s bytes ``[0, nbytes)`` are in the pool: hash what is new once there
        is a part's worth (or the piece is complete)."""
        if self._lane is None:
            return
        start = self._hashed.get(index, 0)
        if nbytes - start < PART_BYTES and nbytes < self._piece_bytes:
            return
        hasher = self._hashers.get(index)
        if hasher is None:
            hasher = self._hashers[index] = xxhash.xxh3_64()
        part = self._slots[index][start:nbytes].numpy()
        self._pending.append(self._lane.submit(hasher.update, part))
        self._hashed[index] = nbytes

    def digests(self) -> list[int]:
        """One checksum per piece (waits for the lane; hashes here what it was not given).
        ``LMCacheTimeoutError`` when the lane did not finish within ``LANE_TIMEOUT_S``."""
        pending = self._finish()
        if pending is None:
            raise LMCacheTimeoutError(
                f"store checksums: the hashing lane did not finish in {LANE_TIMEOUT_S:g} s")
        for future in pending:
            future.result(timeout=0)  # done: re-raises a part that failed
        return [self._digest(i, slot) for i, slot in enumerate(self._slots)]

    def abandon(self) -> None:
        """The store failed: wait for the lane to be idle (it reads the slots) and give it back.
        Never raises (its caller is failing already): a lane still busy after ``LANE_TIMEOUT_S``
        is logged and retired."""
        if self._finish() is None:
            logger.warning("store checksums: the hashing lane did not finish in %g s after a "
                           "failed store; retired", LANE_TIMEOUT_S)

    def _digest(self, index: int, slot: Any) -> int:
        if self._hashed.get(index) == self._piece_bytes:
            return self._hashers[index].intdigest() or 1
        return checksum(slot[: self._piece_bytes])

    def _finish(self) -> list[Future[None]] | None:
        """Wait (``LANE_TIMEOUT_S`` in all) for the lane's parts and give the lane back: the
        parts, or None when some did not finish (then cancelled, and the lane retired)."""
        lane, pending = self._lane, self._pending
        self._lane, self._pending = None, []
        if lane is None:
            return pending
        _, late = wait(pending, timeout=LANE_TIMEOUT_S)
        if late:
            self._lanes.retire(lane)
            return None
        self._lanes.give_back(lane)
        return pending
