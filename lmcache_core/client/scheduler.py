"""The scheduler client: one prefix lookup per request, polled without ever blocking the scheduler.

``LMCacheMPSchedulerAdapter`` lives in vLLM's scheduler process. It sends one lookup per request,
which the server answers with the hit and locks for the coming load; the scheduler polls for the
answer (``check_lookup_result``) and gets None until it is in. What it keeps of each request is
one :class:`.lookups.Lookup` record, whose states and moves are :mod:`.lookups`' table. An ended
session's release rides on the next lookup (``LookupRequest.ended``) instead of a message of its
own, and every release goes behind the lookup whose locks it drops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from lmcache_core.client.connection import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_LOOKUP_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    LOGGER_NAME,
    Connection,
)
from lmcache_core.client.lookups import HELD, Lookup, LookupEvent, LookupState
from lmcache_core.errors import LMCacheError
from lmcache_core.protocol import messages as m
from lmcache_core.protocol import ops
from lmcache_core.protocol.ops import Op
from lmcache_core.protocol.pin_messages import PinRequest
from lmcache_core.transport.future import MessagingFuture

logger = logging.getLogger(LOGGER_NAME)

#: A pending ``check_lookup_result`` looks at the socket at most this often: a scheduler sweeping
#: its N waiting requests then pays one socket poll (~2 us, a system call), not N; a reply is seen
#: at most this much later.
LOOKUP_POLL_INTERVAL_S = 10e-6
#: How long an ended session waits for a lookup to ride on (``LookupRequest.ended``) before its
#: release goes out alone. vLLM looks up the next requests right after one ends: on its own, the
#: release was a message the server's loop served ahead of that lookup, its reply one more to
#: receive, and the lookup after it took 4.4x a bare echo instead of 1.5x
#: (scripts/bench/bench_scheduler_lookup.py, "after end"). A scheduler with nothing more to look up
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
        self._conn = Connection(server_url, context, model_name, world_size, kv_rank,
                                vllm_block_size, connect_timeout_s, request_timeout_s,
                                "lmcache-scheduler")
        #: The connection's ``MessageQueueClient`` (LMCache's adapters name theirs so too).
        self.mq_client = self._conn.mq_client
        self.chunk_size = self._conn.chunk_size
        self.lookup_timeout_s = lookup_timeout_s
        #: Loads shorter than this many tokens are declined (see ``check_lookup_result``).
        self.min_hit_tokens = min_hit_tokens
        self.declined_lookups = 0
        # One record per request id (lookups.py: its states and moves). A record in SUBMITTED,
        # DECLINED or GIVEN_UP is moved on this (the scheduler's) thread only; the client's I/O
        # thread also moves records out of FORGOTTEN, ENDING and RIDING: every move, and every
        # record added or dropped, happens under _lock (reentrant: a future settled while
        # sending runs its callbacks, which may end sessions).
        self._records: dict[str, Lookup] = {}
        self._lock = threading.RLock()
        # The outbox: the records whose ended session waits to ride on the next lookup (in the
        # order they ended), or goes alone after RELEASE_RIDE_S (on the client's I/O thread) or
        # when a thread waits on its future. Taken and sent under _lock, so no lookup overtakes
        # them.
        self._outbox: list[Lookup] = []
        self._flush_armed = False
        self._last_poll = 0.0

    # ------------------------------------------------------------------ records

    def _move(self, record: Lookup, event: LookupEvent) -> None:
        """One move of ``lookups.TRANSITIONS``; a record that reaches IDLE is dropped."""
        with self._lock:
            if record.move(event) is LookupState.IDLE \
                    and self._records.get(record.request_id) is record:
                del self._records[record.request_id]

    def _record(self, request_id: str) -> Lookup:
        """The id's record, a new one (IDLE, kept: the caller moves it at once) if none. Under
        ``_lock``."""
        record = self._records.get(request_id)
        if record is None:
            record = self._records[request_id] = Lookup(request_id)
        return record

    def lookup_state(self, request_id: str) -> LookupState:
        """What the client holds of this request (IDLE: nothing)."""
        record = self._records.get(request_id)
        return LookupState.IDLE if record is None else record.state

    def tracked(self) -> dict[str, LookupState]:
        """Every request the client holds a record of, and its state."""
        with self._lock:
            return {request_id: record.state for request_id, record in self._records.items()}

    # ------------------------------------------------------------------ lookups

    def maybe_submit_lookup_request(self, request_id: str, block_hashes: list[bytes],
                                    cache_salt: str | None = None) -> None:
        """Send this request's lookup unless one is already in flight or answered; returns at once.

        ``block_hashes``: vLLM block hashes, or the prompt's token ids (then ``cache_salt`` seeds
        their chain, as for the request's stores and retrieves)."""
        held = self._records.get(request_id)
        if held is not None and held.state in HELD:
            return
        hashes = self._conn.chunk_hashes(block_hashes, cache_salt)
        carrier: MessagingFuture[m.LookupReply] | None = None
        with self._lock:
            record = self._record(request_id)
            record.move(LookupEvent.SUBMIT)
            if not hashes:  # shorter than one chunk: nothing can hit, no round trip
                record.future = MessagingFuture.completed(m.LookupReply(hit_chunks=0))
                return
            record.deadline = self._clock() + self.lookup_timeout_s
            if record.carrier is None or record.carrier.query():
                record.future = self._send_lookup(request_id, hashes)
                return
            # This id's end rides on a lookup still in flight: look it up again once that landed.
            carrier = record.carrier
            lookup: MessagingFuture[m.LookupReply] = MessagingFuture(f"lmc.lookup for {request_id}")
            record.future = lookup
        carrier.add_done_callback(
            lambda _f: self._chain_watched(self._send_lookup(request_id, hashes), lookup))
        self.mq_client.watch(carrier)

    def _send_lookup(self, request_id: str, hashes: list[bytes]) -> MessagingFuture[m.LookupReply]:
        """Send the lookup, with the sessions ended since the last one riding on it."""
        with self._lock:
            riders, self._outbox = self._outbox, []
            request = m.LookupRequest(model_name=self._conn.model_name,
                                      world_size=self._conn.world_size, lookup_id=request_id,
                                      chunk_hashes=hashes, lock=True,
                                      ended=[r.request_id for r in riders])
            # polled: check_lookup_result takes the reply on the scheduler's thread (no hop)
            lookup = self.mq_client.submit(ops.LOOKUP, request, polled=True)
            if riders:
                self._ride(riders, lookup)
        return lookup

    def _ride(self, riders: list[Lookup], carrier: MessagingFuture[m.LookupReply]) -> None:
        """The riders' releases go with ``carrier``: settle their futures from its reply; if it
        failed (maybe before the server released them), release them alone. Under ``_lock``."""
        ending = [(r.request_id, r.released) for r in riders]
        for rider in riders:
            rider.released, rider.carrier = None, carrier
            if rider.state is LookupState.ENDING:
                self._move(rider, LookupEvent.RIDE)

        def landed(done: MessagingFuture[m.LookupReply]) -> None:
            with self._lock:
                for rider in riders:
                    if rider.carrier is done:
                        rider.carrier = None
                        if rider.state is LookupState.RIDING:
                            self._move(rider, LookupEvent.CARRIER_LANDS)
                reply = done.result(0) if done.exception(0) is None else None
                if reply is None or len(reply.released) != len(ending):
                    self._send_alone_locked(ending)
                    return
            for (_, released), count in zip(ending, reply.released, strict=True):
                assert released is not None
                released.set_result(m.ReleasedReply(released=count))

        carrier.add_done_callback(landed)

    def _chain_watched(self, source: MessagingFuture[m.LookupReply],
                       target: MessagingFuture[m.LookupReply]) -> None:
        # Sent from a callback, maybe after the scheduler stopped polling it: the I/O thread
        # takes its reply, so a release chained behind ``target`` does not wait for a poll.
        chain(source, target)
        self.mq_client.watch(source)

    def check_lookup_result(self, request_id: str, num_computed_tokens: int = 0) -> int | None:
        """Matched tokens once the answer is in (chunks every rank holds x chunk size), else None.

        Never blocks. A failed or timed-out lookup counts as 0 hits (the engine recomputes).
        With ``min_hit_tokens``, a hit whose load (the tokens past ``num_computed_tokens``, what
        the engine already has) would be shorter is declined: 0 from now on for this request,
        and the server's locks on it are released at once (not at the request's end)."""
        record = self._records.get(request_id)
        if record is None or record.state is not LookupState.SUBMITTED:
            return 0
        future = record.future
        assert future is not None
        if not future.query():
            now = time.perf_counter()
            if now - self._last_poll < LOOKUP_POLL_INTERVAL_S:
                return None
            self._last_poll = now
            self.mq_client.poll_replies()  # take arrived replies now, without a thread hop
            if not future.query():
                if self._clock() < record.deadline:
                    return None
                return self._give_up(record, future)
        try:
            reply = future.result(0)
        except LMCacheError as exc:
            logger.warning("lookup for %s failed, recomputing: %s", request_id, exc)
            return 0
        hit = reply.hit_chunks * self.chunk_size
        if 0 < hit - num_computed_tokens < self.min_hit_tokens:
            self._decline(record)
            return 0
        return hit

    def wait_lookup_result(self, request_id: str, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the answer to this request's lookup, receiving it on
        this thread (no hop); True once ``check_lookup_result`` has it. The adapter's one call
        that blocks: a caller bounds it (the connector gives all the lookups a step sends one
        small budget, ``timeouts.lookup_wait_us``). True at once for an id with no lookup."""
        record = self._records.get(request_id)
        future = record.future if record is not None and record.state in HELD else None
        if future is None or future.query():
            return True
        if timeout_s <= 0:
            return False
        return self.mq_client.wait(future, timeout_s)

    def _give_up(self, record: Lookup, lookup: MessagingFuture[m.LookupReply]) -> int:
        """The lookup passed ``lookup_timeout_s``: 0 for the scheduler from now on (it recomputes),
        and whatever it locks is released behind it (nobody will load those chunks)."""
        request_id = record.request_id
        logger.warning("lookup for %s got no answer within %gs, recomputing", request_id,
                       self.lookup_timeout_s)
        self._move(record, LookupEvent.GIVE_UP)

        def free(_answered: MessagingFuture[m.LookupReply]) -> None:
            # Only if no newer lookup of this id went out since (a preempted request resumed):
            # the free would release that one's locks.
            with self._lock:
                now = self._records.get(request_id)
                newer = now is not None and now.state in HELD and now.future is not lookup
            if not newer:
                self._release(ops.FREE_LOOKUP_LOCKS, request_id, None)

        lookup.add_done_callback(free)
        self.mq_client.watch(lookup)
        return 0

    def _decline(self, record: Lookup) -> None:
        """Forget a hit not worth loading and release its locks now (one message, not waited)."""
        self._move(record, LookupEvent.DECLINE)
        self.declined_lookups += 1
        self.free_lookup_locks(record.request_id)

    def num_blocks_per_chunk(self) -> int:
        return self._conn.num_blocks_per_chunk()

    def cleanup_lookup_result(self, request_id: str) -> None:
        """Forget the lookup's result (the server's locks stay until retrieve or end_session).
        One the server has not answered yet is kept until it does, for a release to go behind."""
        with self._lock:
            record = self._records.get(request_id)
            if record is None or record.state not in HELD:
                return
            lookup = record.future
            assert lookup is not None
            if lookup.query():
                self._move(record, LookupEvent.DROP)
                return
            self._move(record, LookupEvent.FORGET)

        def answered(done: MessagingFuture[m.LookupReply]) -> None:  # on the I/O thread
            with self._lock:  # end_session or a new lookup may have moved it meanwhile
                if record.state is LookupState.FORGOTTEN and record.future is done:
                    self._move(record, LookupEvent.LAND)

        lookup.add_done_callback(answered)

    # ------------------------------------------------------------------ releases

    def free_lookup_locks(self, request_id: str) -> MessagingFuture[Any]:
        """Release what the request's lookup still locks (e.g. on abort), without waiting."""
        record = self._records.get(request_id)
        return self._release(ops.FREE_LOOKUP_LOCKS, request_id,
                             record.future if record is not None else None, polled=True)

    def end_session(self, request_id: str) -> MessagingFuture[Any]:
        """The request is done: forget its lookup and release what it still locks on the server.

        The release rides on the next lookup (``LookupRequest.ended``: no message of its own),
        or goes alone within ``RELEASE_RIDE_S``, or at once if a thread waits on the future
        (which resolves to a ``ReleasedReply``). Either way it reaches the server before any
        later lookup. While the request's lookup is in flight it goes alone, behind it."""
        with self._lock:
            record = self._records.get(request_id)
            lookup = record.future if record is not None else None
            if record is not None and lookup is not None and not lookup.query():
                self._move(record, LookupEvent.END_BEHIND)
            else:
                released, arm = self._queue_end_locked(request_id)
                lookup = None
        if lookup is not None:
            return self._release(ops.END_SESSION, request_id, lookup)
        if arm:
            self.mq_client.call_later(RELEASE_RIDE_S, self._flush_ending)
        return released

    def _queue_end_locked(self, request_id: str) -> tuple[MessagingFuture[m.ReleasedReply], bool]:
        """Put the id's release in the outbox (once: ended again, the same future); a full
        outbox goes alone at once. The future, and whether a flush must be armed."""
        record = self._record(request_id)
        self._move(record, LookupEvent.END)
        released = record.released
        if released is None:
            released = MessagingFuture(f"{ops.END_SESSION.type.value} for {request_id}")
            released.driver = self._drive_release
            record.released = released
            self._outbox.append(record)
        if len(self._outbox) >= m.MAX_ENDED:  # more than one lookup may carry
            self._flush_outbox_locked()
        arm = not self._flush_armed
        self._flush_armed = True
        return released, arm

    def _flush_ending(self) -> None:
        """On the client's I/O thread, ``RELEASE_RIDE_S`` after an end: what no lookup took."""
        with self._lock:
            self._flush_armed = False
            self._flush_outbox_locked()

    def _drive_release(self, released: MessagingFuture[Any], timeout_s: float) -> bool:
        """A thread waits on an end_session's future: send it now if it still waits to ride."""
        with self._lock:
            if any(record.released is released for record in self._outbox):
                self._flush_outbox_locked()
        return self.mq_client.wait(released, timeout_s)

    def _flush_outbox_locked(self) -> list[MessagingFuture[Any]]:
        """Send every release of the outbox alone; their futures."""
        riders, self._outbox = self._outbox, []
        ending = [(r.request_id, r.released) for r in riders]
        for rider in riders:
            rider.released = None
            if rider.state is LookupState.ENDING:
                self._move(rider, LookupEvent.SEND_ALONE)
        self._send_alone_locked(ending)
        return [released for _, released in ending if released is not None]

    def _send_alone_locked(self, ending: list[tuple[str, MessagingFuture[Any] | None]]) -> None:
        for request_id, released in ending:
            assert released is not None
            chain(self._release(ops.END_SESSION, request_id, None), released)

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
            lookup.add_done_callback(lambda _f: chain(self._release(op, request_id, None), released))
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
        with self._lock:
            sent = self._flush_outbox_locked()
        deadline = time.monotonic() + CLOSE_FLUSH_S
        for released in sent:
            self.mq_client.wait(released, max(0.0, deadline - time.monotonic()))
        self.mq_client.close()

    shutdown = close


def chain(source: MessagingFuture[Any], target: MessagingFuture[Any]) -> None:
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

