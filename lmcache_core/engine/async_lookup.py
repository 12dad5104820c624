"""``AsyncLookups``: the engine's half of ``lmcache_core.lookup_client`` (in-process async lookup).

A worker's ``LMCacheAsyncLookupServer`` calls ``CacheEngine.async_lookup_and_prefetch`` and
``cleanup_memory_objs`` from its thread, for the engine's own rank only; the engine hands both to
the ``AsyncLookups`` it holds, built with what it needs of the engine: its lookup (the tiers' when
given a budget), the store's ``free_lookup_locks``, the chunk size, and whether there are tiers.
Without lower tiers a lookup answers at once on the caller's thread; with them the prefix is
brought into memory by a lookup with a tier budget (``TIER_TIMEOUT_S``) on a small prefetch
thread pool (made on first use), so the caller never waits on tier I/O. ``close`` shuts that pool down.

``cleanup`` (the request was cancelled or timed out) releases the lookup's locks. A tiered lookup
still in flight then would lock again when it ends (its final re-lookup), with nobody left to
release them, so each one is tracked by lookup id from its submission: one that a cleanup cancelled
skips its I/O if it has not started, releases what it locked when it ends, and answers 0 (a reported
hit is always locked). When a newer lookup of the same id was submitted after the cleanup, the locks
of that id are the newer one's: the cancelled one answers 0 and leaves them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from lmcache_core.engine.index import GroupTarget
from lmcache_core.errors import ProtocolError
from lmcache_core.keys import opaque_layout, rank_heads


class Lookup(Protocol):
    """The engine's lookup (``CacheEngine.lookup``)."""

    def __call__(self, model_name: str, groups: Sequence[GroupTarget],
                 chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool = True, *,
                 tier_timeout_s: float | None = None) -> int: ...

logger = logging.getLogger(__name__)
PREFETCH_THREADS = 4
TIER_TIMEOUT_S = 1.0  # how long a tiered async lookup may spend bringing its prefix in


@dataclass(slots=True)
class _Tracked:
    """One lookup id's tiered lookups in flight (kept only while one is)."""

    running: int = 0  # submitted, not finished
    submitted: int = 0  # numbers each submission (1, 2, ...)
    cancelled_upto: int = 0  # a cleanup cancelled the submissions up to this number


class AsyncLookups:
    """Answers async lookups against one engine; owns the prefetch threads of tiered ones.
    ``lookup``: the engine's; ``release``: frees a lookup id's locks; ``tiered``: lookups bring
    the prefix in from lower tiers (on the prefetch threads)."""

    def __init__(self, lookup: Lookup, release: Callable[[str], int], chunk_size: int,
                 tiered: bool) -> None:
        self._lookup = lookup
        self._release = release
        self._chunk_size = chunk_size
        self._tiered = tiered
        self._lock = threading.Lock()
        self._prefetch: ThreadPoolExecutor | None = None
        self._in_flight: set[Future[None]] = set()
        self._tracked: dict[str, _Tracked] = {}  # lookup id -> its tiered lookups in flight
        self._closed = False

    def lookup_and_prefetch(self, lookup_id: str, hashes: Sequence[bytes],
                            offsets: Sequence[int] | None = None, pin: bool = True, *,
                            model_name: str = "", world_size: int = 1, worker_id: int = 0,
                            layout: str | None = None,
                            on_result: Callable[[str, int], None] | None = None) -> int | None:
        """``CacheEngine.async_lookup_and_prefetch`` (see there)."""
        if not 0 <= worker_id < world_size:
            raise ProtocolError(f"worker_id {worker_id} must be in [0, world_size={world_size})")
        if offsets is not None and len(offsets) != len(hashes):
            raise ProtocolError(f"{len(offsets)} offsets for {len(hashes)} chunk hashes")
        chunk_size = self._chunk_size

        def answer(chunks: int) -> int:
            if not chunks:
                tokens = 0
            else:
                tokens = int(offsets[chunks - 1]) if offsets is not None else chunks * chunk_size
            if on_result is not None:
                on_result(lookup_id, tokens)
            return tokens

        if layout is None:
            layout = opaque_layout(world_size)
        try:
            groups = [GroupTarget(layout, (rank_heads(layout, world_size, worker_id),))]
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        if not self._tiered:
            return answer(self._lookup(model_name, groups, hashes, lookup_id, lock=pin))
        if on_result is None:  # nobody to call back: wait here
            return answer(self._lookup(model_name, groups, hashes, lookup_id, pin,
                                       tier_timeout_s=TIER_TIMEOUT_S))

        lookup = partial(self._lookup, model_name, groups, hashes, lookup_id, pin,
                         tier_timeout_s=TIER_TIMEOUT_S)
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed: no more tiered async lookups")
            if self._prefetch is None:
                self._prefetch = ThreadPoolExecutor(PREFETCH_THREADS,
                                                    thread_name_prefix="lmcache-prefetch")
            number = self._track(lookup_id)  # before it can run: a cleanup from now on sees it
            future = self._prefetch.submit(self._prefetch_one, lookup_id, number, lookup, answer)
            self._in_flight.add(future)
        future.add_done_callback(partial(self._finished, lookup_id, number))
        return None

    def _prefetch_one(self, lookup_id: str, number: int, lookup: Callable[[], int],
                      answer: Callable[[int], int]) -> None:
        """Submission ``number`` of ``lookup_id``, on a prefetch thread: look up, then answer."""
        chunks = 0
        with self._lock:
            started = number > self._tracked[lookup_id].cancelled_upto
        if started:  # else cancelled while queued: no I/O, nothing locked
            try:
                chunks = lookup()
            except Exception:
                logger.exception("async lookup %r failed", lookup_id)
                self._release(lookup_id)
                chunks = 0
        with self._lock:
            if self._untrack(lookup_id, number):
                chunks = 0
        answer(chunks)

    def _track(self, lookup_id: str) -> int:
        """Under ``_lock``: count a submission of ``lookup_id`` in flight; its number."""
        tracked = self._tracked.get(lookup_id)
        if tracked is None:
            tracked = self._tracked[lookup_id] = _Tracked()
        tracked.running += 1
        tracked.submitted += 1
        return tracked.submitted

    def _untrack(self, lookup_id: str, number: int) -> bool:
        """Under ``_lock`` (so no newer submission slips in): submission ``number`` ended; True
        when a cleanup cancelled it, whose locks are released here unless a newer submission of
        the id (made after that cleanup) owns them."""
        tracked = self._tracked[lookup_id]
        tracked.running -= 1
        if not tracked.running:
            del self._tracked[lookup_id]
        if number > tracked.cancelled_upto:
            return False
        if tracked.submitted == tracked.cancelled_upto:
            self._release(lookup_id)
        return True

    def _finished(self, lookup_id: str, number: int, future: Future[None]) -> None:
        with self._lock:
            self._in_flight.discard(future)
            if future.cancelled():  # by ``close``: it never ran, so never untracked itself
                self._untrack(lookup_id, number)

    def cleanup(self, lookup_id: str) -> int:
        """Release what ``lookup_id``'s async lookup pinned (it was cancelled or timed out); its
        tiered lookups in flight are cancelled (they release what they lock and answer 0)."""
        with self._lock:
            tracked = self._tracked.get(lookup_id)
            if tracked is not None:
                tracked.cancelled_upto = tracked.submitted
        return self._release(lookup_id)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Shut the prefetch pool down: lookups not started yet are cancelled (unanswered, nothing
        pinned), those running get up to ``timeout_s`` to finish and answer. True if none is left
        running. Idempotent; a tiered async lookup after it raises ``RuntimeError``."""
        with self._lock:
            self._closed = True
            executor, self._prefetch = self._prefetch, None
            running = list(self._in_flight)
        if executor is None:
            return True
        executor.shutdown(wait=False, cancel_futures=True)
        _, not_done = wait_futures(running, timeout=timeout_s)
        if not_done:
            logger.warning("%d async lookup(s) still running after %.1fs at close",
                           len(not_done), timeout_s)
        return not not_done
