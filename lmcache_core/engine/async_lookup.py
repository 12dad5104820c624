"""``AsyncLookups``: the engine's half of ``lmcache_core.lookup_client`` (in-process async lookup).

A worker's ``LMCacheAsyncLookupServer`` calls ``CacheEngine.async_lookup_and_prefetch`` and
``cleanup_memory_objs`` from its thread, for the engine's own rank only; the engine hands both to
the ``AsyncLookups`` it holds. Without lower tiers a lookup answers at once on the caller's thread;
with them the prefix is brought into memory by ``lookup_tiers`` on a small prefetch thread pool
(made on first use), so the caller never waits on tier I/O. ``close`` shuts that pool down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Protocol

from lmcache_core.errors import ProtocolError
from lmcache_core.keys import HeadRange, opaque_layout, rank_heads


class LookupEngine(Protocol):
    """What the async lookups need of the engine (``cache.CacheEngine`` is one)."""

    chunk_size: int

    @property
    def has_tiers(self) -> bool: ...

    def lookup(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
               chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool = True) -> int: ...

    def lookup_tiers(self, model_name: str, layout: str, ranges: Sequence[HeadRange],
                     chunk_hashes: Sequence[bytes], lookup_id: str, lock: bool = True,
                     timeout_s: float = 1.0) -> int: ...

    def free_lookup_locks(self, lookup_id: str) -> int: ...

logger = logging.getLogger(__name__)
PREFETCH_THREADS = 4


class AsyncLookups:
    """Answers async lookups against one engine; owns the prefetch threads of tiered ones."""

    def __init__(self, engine: LookupEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._prefetch: ThreadPoolExecutor | None = None
        self._in_flight: set[Future[None]] = set()
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
        engine = self.engine
        chunk_size = engine.chunk_size

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
            ranges = [rank_heads(layout, world_size, worker_id)]
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        if not engine.has_tiers:
            return answer(engine.lookup(model_name, layout, ranges, hashes, lookup_id, lock=pin))
        if on_result is None:  # nobody to call back: wait here
            return answer(engine.lookup_tiers(model_name, layout, ranges, hashes, lookup_id, pin))

        def prefetch() -> None:
            try:
                chunks = engine.lookup_tiers(model_name, layout, ranges, hashes, lookup_id, pin)
            except Exception:
                logger.exception("async lookup %r failed", lookup_id)
                engine.free_lookup_locks(lookup_id)
                chunks = 0
            answer(chunks)

        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed: no more tiered async lookups")
            if self._prefetch is None:
                self._prefetch = ThreadPoolExecutor(PREFETCH_THREADS,
                                                    thread_name_prefix="lmcache-prefetch")
            future = self._prefetch.submit(prefetch)
            self._in_flight.add(future)
        future.add_done_callback(self._finished)
        return None

    def _finished(self, future: Future[None]) -> None:
        with self._lock:
            self._in_flight.discard(future)

    def cleanup(self, lookup_id: str) -> int:
        """Release what ``lookup_id``'s async lookup pinned (it was cancelled or timed out)."""
        return self.engine.free_lookup_locks(lookup_id)

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
