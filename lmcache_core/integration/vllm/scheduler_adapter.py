"""The scheduler's side of the seed adapters: one prefix lookup per request, polled without blocking.

Part of :mod:`.vllm_multi_process_adapter`, which re-exports ``LMCacheMPSchedulerAdapter``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from lmcache_core.errors import LMCacheError
from lmcache_core.integration.vllm.adapter_common import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_LOOKUP_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    _Connection,
)
from lmcache_core.protocol import messages as m
from lmcache_core.protocol import ops
from lmcache_core.protocol.ops import Op
from lmcache_core.protocol.pin_messages import PinRequest
from lmcache_core.transport.future import MessagingFuture

# The adapters' one logger, named as before the split, so logging configured for it still applies.
logger = logging.getLogger("lmcache_core.integration.vllm.vllm_multi_process_adapter")

#: A pending ``check_lookup_result`` looks at the socket at most this often: a scheduler sweeping
#: its N waiting requests then pays one socket poll (~2 us, a system call), not N; a reply is seen
#: at most this much later.
LOOKUP_POLL_INTERVAL_S = 10e-6
#: How long an ended session waits for a lookup to ride on (``LookupRequest.ended``) before its
#: release goes out alone. vLLM looks up the next requests right after one ends: on its own, the
#: release was a message the server's loop served ahead of that lookup, its reply one more to
#: receive, and the lookup after it took 4.4x a bare echo instead of 1.5x
#: (scripts/bench_scheduler_lookup.py, "after end"). A scheduler with nothing more to look up
#: still releases within this.
RELEASE_RIDE_S = 0.005
#: How long ``close`` waits for the answers to the ended sessions it sends.
CLOSE_FLUSH_S = 1.0


class LMCacheMPSchedulerAdapter:
    """Prefix lookups for vLLM's scheduler: submit once per request, poll without blocking."""

    def __init__(self, server_url: str, context: zmq.Context[Any], model_name: str,
                 world_size: int, kv_rank: int, vllm_block_size: int, *,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 min_hit_tokens: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: what ``lookup_timeout_s`` is measured on (tests pass a fake one)."""
        self._clock = clock
        self._conn = _Connection(server_url, context, model_name, world_size, kv_rank,
                                 vllm_block_size, connect_timeout_s, request_timeout_s,
                                 "lmcache-scheduler")
        self.mq_client = self._conn.mq_client
        self.chunk_size = self._conn.chunk_size
        self.lookup_timeout_s = lookup_timeout_s
        #: Loads shorter than this many tokens are declined (see ``check_lookup_result``).
        self.min_hit_tokens = min_hit_tokens
        self.declined_lookups = 0
        self._lookups: dict[str, MessagingFuture[m.LookupReply]] = {}
        # The scheduler's own deadline per lookup (on ``clock``), apart from the server's answer:
        # past it the scheduler is told 0 (it recomputes), but the lookup stays in flight until
        # the server answers (the request timeout bounds that), so a release is sent behind it.
        self._give_up_at: dict[str, float] = {}
        self._given_up: set[str] = set()
        # Lookups forgotten (cleanup_lookup_result) before the server answered them.
        self._unanswered: dict[str, MessagingFuture[m.LookupReply]] = {}
        self._last_poll = 0.0
        # Ended sessions not sent yet, with the futures end_session returned: they ride on the
        # next lookup, or go alone after RELEASE_RIDE_S (on the client's I/O thread) or when a
        # thread waits on one. Taken and sent under _ending_lock, so no lookup overtakes them
        # (reentrant: a future settled while sending runs its callbacks, which may end sessions).
        self._ending: dict[str, MessagingFuture[m.ReleasedReply]] = {}
        self._ending_lock = threading.RLock()
        self._flush_armed = False
        # Ended sessions riding on a lookup not answered yet: a new lookup of such an id waits
        # for it (a tiered server runs lookups on several threads: the release could come
        # second and drop the new lookup's locks).
        self._riding: dict[str, MessagingFuture[m.LookupReply]] = {}

    def maybe_submit_lookup_request(self, request_id: str, block_hashes: list[bytes],
                                    cache_salt: str | None = None) -> None:
        """Send this request's lookup unless one is already in flight or answered; returns at once.

        ``block_hashes``: vLLM block hashes, or the prompt's token ids (then ``cache_salt`` seeds
        their chain, as for the request's stores and retrieves)."""
        if request_id in self._lookups:
            return
        hashes = self._conn.chunk_hashes(block_hashes, cache_salt)
        if not hashes:  # shorter than one chunk: nothing can hit, no round trip
            self._lookups[request_id] = MessagingFuture.completed(m.LookupReply(hit_chunks=0))
            return
        self._give_up_at[request_id] = self._clock() + self.lookup_timeout_s
        carrier = self._riding.get(request_id)
        if carrier is None or carrier.query():
            self._lookups[request_id] = self._send_lookup(request_id, hashes)
            return
        # This id's end rides on a lookup still in flight: look it up again once that landed.
        lookup: MessagingFuture[m.LookupReply] = MessagingFuture(f"lmc.lookup for {request_id}")
        self._lookups[request_id] = lookup
        carrier.add_done_callback(
            lambda _f: self._chain_watched(self._send_lookup(request_id, hashes), lookup))
        self.mq_client.watch(carrier)

    def _send_lookup(self, request_id: str, hashes: list[bytes]) -> MessagingFuture[m.LookupReply]:
        """Send the lookup, with the sessions ended since the last one riding on it."""
        with self._ending_lock:
            ending, self._ending = self._ending, {}
            request = m.LookupRequest(model_name=self._conn.model_name,
                                      world_size=self._conn.world_size, lookup_id=request_id,
                                      chunk_hashes=hashes, lock=True, ended=list(ending))
            # polled: check_lookup_result takes the reply on the scheduler's thread (no hop)
            lookup = self.mq_client.submit(ops.LOOKUP, request, polled=True)
        if ending:
            self._ride(ending, lookup)
        return lookup

    def _ride(self, ending: dict[str, MessagingFuture[m.ReleasedReply]],
              carrier: MessagingFuture[m.LookupReply]) -> None:
        """Settle the ended sessions' futures from the lookup that carries them; if it failed
        (maybe before the server released them), release them alone."""
        for request_id in ending:
            self._riding[request_id] = carrier

        def landed(done: MessagingFuture[m.LookupReply]) -> None:
            for request_id in ending:
                if self._riding.get(request_id) is done:
                    del self._riding[request_id]
            reply = done.result(0) if done.exception(0) is None else None
            if reply is None or len(reply.released) != len(ending):
                with self._ending_lock:
                    self._send_alone_locked(ending)
                return
            for released, count in zip(ending.values(), reply.released, strict=True):
                released.set_result(m.ReleasedReply(released=count))

        carrier.add_done_callback(landed)

    def _chain_watched(self, source: MessagingFuture[m.LookupReply],
                       target: MessagingFuture[m.LookupReply]) -> None:
        # Sent from a callback, maybe after the scheduler stopped polling it: the I/O thread
        # takes its reply, so a release chained behind ``target`` does not wait for a poll.
        _chain(source, target)
        self.mq_client.watch(source)

    def check_lookup_result(self, request_id: str, num_computed_tokens: int = 0) -> int | None:
        """Matched tokens once the answer is in (chunks every rank holds x chunk size), else None.

        Never blocks. A failed or timed-out lookup counts as 0 hits (the engine recomputes).
        With ``min_hit_tokens``, a hit whose load (the tokens past ``num_computed_tokens``, what
        the engine already has) would be shorter is declined: 0 from now on for this request,
        and the server's locks on it are released at once (not at the request's end)."""
        future = self._lookups.get(request_id)
        if future is None or request_id in self._given_up:
            return 0
        if not future.query():
            now = time.perf_counter()
            if now - self._last_poll < LOOKUP_POLL_INTERVAL_S:
                return None
            self._last_poll = now
            self.mq_client.poll_replies()  # take arrived replies now, without a thread hop
            if not future.query():
                if self._clock() < self._give_up_at.get(request_id, math.inf):
                    return None
                return self._give_up(request_id, future)
        try:
            reply = future.result(0)
        except LMCacheError as exc:
            logger.warning("lookup for %s failed, recomputing: %s", request_id, exc)
            return 0
        hit = reply.hit_chunks * self.chunk_size
        if 0 < hit - num_computed_tokens < self.min_hit_tokens:
            self._decline(request_id)
            return 0
        return hit

    def wait_lookup_result(self, request_id: str, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the answer to this request's lookup, receiving it on
        this thread (no hop); True once ``check_lookup_result`` has it. The adapter's one call
        that blocks: a caller bounds it (the connector gives all the lookups a step sends one
        small budget, ``timeouts.lookup_wait_us``). True at once for an id with no lookup."""
        future = self._lookups.get(request_id)
        if future is None or future.query():
            return True
        if timeout_s <= 0:
            return False
        return self.mq_client.wait(future, timeout_s)

    def _give_up(self, request_id: str, lookup: MessagingFuture[m.LookupReply]) -> int:
        """The lookup passed ``lookup_timeout_s``: 0 for the scheduler from now on (it recomputes),
        and whatever it locks is released behind it (nobody will load those chunks)."""
        logger.warning("lookup for %s got no answer within %gs, recomputing", request_id,
                       self.lookup_timeout_s)
        self._given_up.add(request_id)

        def free(_answered: MessagingFuture[m.LookupReply]) -> None:
            # Only if no newer lookup of this id went out since (a preempted request resumed):
            # the free would release that one's locks.
            if self._lookups.get(request_id, lookup) is lookup:
                self._release(ops.FREE_LOOKUP_LOCKS, request_id, None)

        lookup.add_done_callback(free)
        self.mq_client.watch(lookup)
        return 0

    def _decline(self, request_id: str) -> None:
        """Forget a hit not worth loading and release its locks now (one message, not waited)."""
        self._lookups[request_id] = MessagingFuture.completed(m.LookupReply(hit_chunks=0))
        self.declined_lookups += 1
        self.free_lookup_locks(request_id)

    def num_blocks_per_chunk(self) -> int:
        return self._conn.num_blocks_per_chunk()

    def cleanup_lookup_result(self, request_id: str) -> None:
        """Forget the lookup's result (the server's locks stay until retrieve or end_session).
        One the server has not answered yet is kept until it does, for a release to go behind."""
        lookup = self._lookups.pop(request_id, None)
        self._drop_deadline(request_id)
        if lookup is None or lookup.query():
            return
        self._unanswered[request_id] = lookup

        def answered(done: MessagingFuture[m.LookupReply]) -> None:  # on the I/O thread
            if self._unanswered.get(request_id) is done:
                self._unanswered.pop(request_id, None)  # end_session may have taken it meanwhile

        lookup.add_done_callback(answered)

    def _drop_deadline(self, request_id: str) -> None:
        self._give_up_at.pop(request_id, None)
        self._given_up.discard(request_id)

    def free_lookup_locks(self, request_id: str) -> MessagingFuture[Any]:
        """Release what the request's lookup still locks (e.g. on abort), without waiting."""
        return self._release(ops.FREE_LOOKUP_LOCKS, request_id,
                             self._lookups.get(request_id) or self._unanswered.get(request_id),
                             polled=True)

    def end_session(self, request_id: str) -> MessagingFuture[Any]:
        """The request is done: forget its lookup and release what it still locks on the server.

        The release rides on the next lookup (``LookupRequest.ended``: no message of its own),
        or goes alone within ``RELEASE_RIDE_S``, or at once if a thread waits on the future
        (which resolves to a ``ReleasedReply``). Either way it reaches the server before any
        later lookup. While the request's lookup is in flight it goes alone, behind it."""
        lookup = self._lookups.pop(request_id, None) or self._unanswered.pop(request_id, None)
        self._drop_deadline(request_id)
        if lookup is not None and not lookup.query():
            return self._release(ops.END_SESSION, request_id, lookup)
        with self._ending_lock:
            released = self._ending.get(request_id)
            if released is None:
                released = MessagingFuture(f"{ops.END_SESSION.type.value} for {request_id}")
                released.driver = self._drive_release
                self._ending[request_id] = released
            if len(self._ending) >= m.MAX_ENDED:  # more than one lookup may carry
                ending, self._ending = self._ending, {}
                self._send_alone_locked(ending)
            arm = not self._flush_armed
            self._flush_armed = True
        if arm:
            self.mq_client.call_later(RELEASE_RIDE_S, self._flush_ending)
        return released

    def _flush_ending(self) -> None:
        """On the client's I/O thread, ``RELEASE_RIDE_S`` after an end: what no lookup took."""
        with self._ending_lock:
            self._flush_armed = False
            ending, self._ending = self._ending, {}
            self._send_alone_locked(ending)

    def _drive_release(self, released: MessagingFuture[Any], timeout_s: float) -> bool:
        """A thread waits on an end_session's future: send it now if it still waits to ride."""
        with self._ending_lock:
            if any(pending is released for pending in self._ending.values()):
                ending, self._ending = self._ending, {}
                self._send_alone_locked(ending)
        return self.mq_client.wait(released, timeout_s)

    def _send_alone_locked(self, ending: dict[str, MessagingFuture[Any]]) -> None:
        for request_id, released in ending.items():
            _chain(self._release(ops.END_SESSION, request_id, None), released)

    def _release(self, op: Op[m.LookupIdRequest, m.ReleasedReply], request_id: str,
                 lookup: MessagingFuture[m.LookupReply] | None,
                 polled: bool = False) -> MessagingFuture[Any]:
        """Send ``op`` now, or, while the request's lookup is still in flight, once it has landed:
        sent earlier, the release could reach the server first (a lookup on a tiered server runs on
        its worker pool) and the lookup's locks would then outlive the request until their TTL.

        ``polled`` (sent now from the scheduler's thread, which goes on polling): its reply is
        taken by the next poll, not by waking the I/O thread (less CPU and fewer context switches
        per release, docs/benchmarks.md). A release sent from the I/O thread or a callback has
        no poller behind it: the I/O thread takes its reply."""
        if lookup is not None and not lookup.query():
            released: MessagingFuture[Any] = MessagingFuture(f"{op.type.value} for {request_id}")
            lookup.add_done_callback(lambda _f: _chain(self._release(op, request_id, None), released))
            self.mq_client.watch(lookup)  # nobody may poll it any more: take its reply at once
            return released
        future = self.mq_client.submit(op, m.LookupIdRequest(lookup_id=request_id), polled=polled)
        future.add_done_callback(lambda f: _log_failure(f, f"{op.type.value} for {request_id}"))
        return future

    def pin(self, block_hashes: list[bytes], ttl_s: float | None = None,
            cache_salt: str | None = None) -> MessagingFuture[Any]:
        """Pin the leading chunks of this prefix that the server holds (kept from eviction until
        ``ttl_s`` passes or ``unpin``), without waiting: the future resolves to a ``PinReply``,
        or raises ``PinLimitError`` when ``server.max_pinned`` would be passed (nothing pinned)."""
        return self._pin_op(ops.PIN, block_hashes, cache_salt, ttl_s)

    def unpin(self, block_hashes: list[bytes], cache_salt: str | None = None
              ) -> MessagingFuture[Any]:
        """Unpin this prefix's chunks, without waiting (the future: an ``UnpinReply``)."""
        return self._pin_op(ops.UNPIN, block_hashes, cache_salt, None)

    def _pin_op(self, op: Op[PinRequest, Any], block_hashes: list[bytes], cache_salt: str | None,
                ttl_s: float | None) -> MessagingFuture[Any]:
        request = PinRequest(model_name=self._conn.model_name, world_size=self._conn.world_size,
                               chunk_hashes=self._conn.chunk_hashes(block_hashes, cache_salt),
                               ttl_s=ttl_s)
        return self.mq_client.submit(op, request)

    def close(self) -> None:
        """Close the connection. Ended sessions still waiting to ride go out first, and are
        waited for (``CLOSE_FLUSH_S`` in all): closed at once, the socket would drop them."""
        with self._ending_lock:
            ending, self._ending = self._ending, {}
            self._send_alone_locked(ending)
        deadline = time.monotonic() + CLOSE_FLUSH_S
        for released in ending.values():
            self.mq_client.wait(released, max(0.0, deadline - time.monotonic()))
        self.mq_client.close()

    shutdown = close


def _chain(source: MessagingFuture[Any], target: MessagingFuture[Any]) -> None:
    """Resolve ``target`` with ``source``'s outcome once it has one."""
    def settle(done: MessagingFuture[Any]) -> None:
        exc = done.exception(0)
        if exc is None:
            target.set_result(done.result(0))
        else:
            target.set_exception(exc)

    source.add_done_callback(settle)


def _log_failure(future: MessagingFuture[Any], what: str) -> None:
    exc = future.exception(0)
    if exc is not None:
        logger.warning("%s failed: %s", what, exc)

