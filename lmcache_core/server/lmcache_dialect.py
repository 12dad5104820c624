"""LMCache 0.5.6's clients on our socket: each of its ops served by our handlers.

The transport hands every request whose op frame is LMCache's (an int 1-33 or one of its names) to
:meth:`LMCacheDialect.serve`; the frames are decoded and answered by
:mod:`lmcache_core.protocol.lmcache_wire`, the work is done by :class:`CacheHandlers`, over the
same engine, tiers and copies as our own dialect. What LMCache's server does differently, and what
this one chose, is listed in the README ("LMCache's own clients").

Failures: every request is answered at once, a malformed, unserved, refused or failed one with
what LMCache's client takes as a failure (``lmcache_wire.failure_frames``: a store or retrieve
``(b"", False)``, a lookup its ack and 0 hits, any other op a reply naming another op, which its
client raises as a ``ValueError`` carrying our message), where LMCache's own server sends
nothing and its client waits out a 300 s timeout. The one frame left unanswered is a stream's
credit, to which LMCache's protocol defines no reply. LMCache's engine-driven ops are refused
with a message naming ``LMCACHE_MP_TRANSFER_MODE=lmcache_driven`` (also logged once per client).
A key naming more chunks than one request may (``Limits.max_keys_per_request``, as for our own
requests) is refused before it is hashed.

Lookups: LMCache's LOOKUP acknowledges at once and its hit count is handed over once, by
``query_prefetch_status`` or ``wait_prefetch_status`` (``prefetch_status.PrefetchResults``). With
lower tiers a lookup runs on a worker thread after its ack; a wait on it is parked there and
answered through the transport's ``post`` when the lookup finishes or its timeout passes. A long
prompt's lookup (over ``INLINE_LOOKUP_BYTES``) is decoded, hashed and answered on a worker thread,
its ack sent once its result is in, so no request holds the loop thread for long.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lmcache_core.errors import LMCacheError, NotRegisteredError, ProtocolError, clip
from lmcache_core.protocol import lmcache_wire as w
from lmcache_core.protocol import messages as m
from lmcache_core.protocol.codec import DEFAULT_LIMITS, Limits
from lmcache_core.server.handlers import CacheHandlers
from lmcache_core.server.lmcache_registrations import DialectRegistrations, registration_request
from lmcache_core.server.prefetch_status import DEFERRED, PrefetchResults
from lmcache_core.transport.counters import LogBudget

logger = logging.getLogger(__name__)
#: What an answered-at-once retrieve or store replies when it failed: no device work, not ok.
_FAILED = (b"", False)
#: Why a store or retrieve found no registration to use (none, dropped, or no such rank); not a
#: NotRegisteredError, which would also forget a registration that is fine for its other ranks.
_UNUSABLE = ProtocolError("no registration of this instance for that rank")
#: A lookup frame longer than this (~64k token ids) is decoded and hashed on a worker thread.
INLINE_LOOKUP_BYTES = 256 << 10
#: ``run()`` -> reply frames or None (silence): a request to serve on a worker thread.
Task = Callable[[], list[bytes] | None]
#: ``post([identity, *reply])``: sends a reply later, from any thread (the transport's ``post``).
Post = Callable[[list[bytes]], None]
#: Clients told in the log that the engine-driven path is not served; forgotten beyond this many.
_MAX_TOLD = 4096


class LMCacheDialect:
    """Serves LMCache's ops over ``handlers``; one per server."""

    def __init__(self, handlers: CacheHandlers, limits: Limits = DEFAULT_LIMITS) -> None:
        self.handlers = handlers
        self.limits = limits  # the transport's: what one request may weigh, in either dialect
        self.post: Post | None = None  # set by ``attach``; without it, waits answer at once
        self.results = PrefetchResults()  # lookup results by request id; parked waits
        self.registrations = DialectRegistrations(handlers)  # in step with the registry
        # Bad frames and failures are the client's to cause at any rate: a few lines each.
        self._rejections = LogBudget(logger=logger)
        self._failures = LogBudget(logger=logger)
        self._told: set[bytes] = set()  # clients warned that engine-driven transfer is unserved

    # ------------------------------------------------------------------ entry point

    def attach(self, post: Post) -> None:
        """The transport's ``post``: how a reply is sent later (a parked wait, an early ack)."""
        self.post = post

    @staticmethod
    def owns(frames: list[bytes]) -> str | None:
        """LMCache's op name when this request is LMCache's; None for ours (and for frames whose
        uid could not address a reply: our codec answers them with a typed error)."""
        return w.frames_op(frames)

    def serve(self, op: str, frames: list[bytes], client: bytes) -> list[bytes] | Task | None:
        """The reply frames of an inline op, None for no reply now, or a task for a worker
        thread. Every request gets one reply, at once or later, except a stream's credit."""
        if op == w.STREAM_CONTROL:  # no stream is served (get_experimental offers none)
            return None
        if op in w.ENGINE_DRIVEN:
            return self._engine_driven(op, frames, client)
        if op == "lookup" and sum(map(len, frames)) > INLINE_LOOKUP_BYTES:
            # Decoding and hashing a long prompt takes the loop thread ~40 ms per MiB of token
            # ids: a worker does it.
            return lambda: self._long_lookup(frames, client)
        call = self._decode(op, frames)
        if isinstance(call, list):
            return call
        if self._over_limit(call):  # refused unhashed
            return self._failure(call.uid_frame, call.op_frame, op, "too many chunks")
        if op == "lookup":  # its result is kept only while this marker is (``end_session``)
            self.results.pending(call.args[0].request_id)
        if op == "lookup" and self.handlers.engine.has_tiers:
            # It may read disk or Redis: on a copy thread, its status None until it is done.
            # Acknowledged at once, as LMCache's (its prefetch runs behind the ack).
            if self.post is None:
                return lambda: self._answer(call, client)
            self.post([client, *w.reply_frames(call, None)])

            def run() -> None:
                self._answer(call, client)  # acknowledged already: its result is the status

            return run
        if op in w.BLOCKING:
            return lambda: self._answer(call, client)
        return self._answer(call, client)

    def _decode(self, op: str, frames: list[bytes]) -> w.Call | list[bytes]:
        """The typed call, or the failure that answers frames that are not one."""
        try:
            return w.decode_call(frames, op)
        except w.DialectError as exc:
            self._reject(op, exc)
            return self._failure(frames[0], frames[1], op, str(exc))

    def _failure(self, uid_frame: bytes, op_frame: bytes, op: str, why: str) -> list[bytes]:
        return w.failure_frames(uid_frame, op_frame, op, f"{op} not served: {why}")

    def _engine_driven(self, op: str, frames: list[bytes], client: bytes) -> list[bytes]:
        """LMCache's engine-driven ops, refused at once with a message saying what to set (vLLM's
        start then fails in a second, naming it); logged once per client too."""
        if client not in self._told:
            if len(self._told) >= _MAX_TOLD:
                self._told.clear()
            self._told.add(client)
            logger.warning("an LMCache client (%s) sent %s: %s", client.hex(), op,
                           w.ENGINE_DRIVEN_REFUSAL)
        return w.failure_frames(frames[0], frames[1], op, w.ENGINE_DRIVEN_REFUSAL)

    def _long_lookup(self, frames: list[bytes], client: bytes) -> list[bytes] | None:
        """A long prompt's lookup, on a worker thread: decoded, hashed and answered there; its
        ack goes once its result is in (a status asked after the ack finds it)."""
        call = self._decode("lookup", frames)
        if isinstance(call, list):
            return call
        if self._over_limit(call):
            return self._failure(call.uid_frame, call.op_frame, "lookup", "too many chunks")
        self.results.pending(call.args[0].request_id)
        self._answer(call, client)
        return w.reply_frames(call, None)

    def refuse(self, op: str, frames: list[bytes], client: bytes, why: str) -> list[bytes]:
        """The reply to a request the transport will not serve (e.g. too large): LMCache's
        failure of its op, at once."""
        self._rejections.log(logging.INFO, "LMCache %s refused: %s", op, why)
        return self._failure(frames[0], frames[1], op, why)

    def dropped(self, op: str, frames: list[bytes], client: bytes) -> list[bytes] | None:
        """The reply to a request whose task (from ``serve``) will not run: the copy threads'
        queue was full. A lookup acknowledged already (a tiered server's, ``post`` set) ends
        with no hits, so its client recomputes instead of seeing it "running" until its own
        timeout, and needs no other reply; anything else is refused (a long lookup, not
        acknowledged yet, is acknowledged undecoded: decoding it is the loop thread's work it
        was sent away from, and its status is then unknown, 0)."""
        acked = op == "lookup" and self.handlers.engine.has_tiers and self.post is not None \
            and sum(map(len, frames)) <= INLINE_LOOKUP_BYTES
        if not acked:
            return self.refuse(op, frames, client, "the copy threads' queue is full")
        call = self._decode(op, frames)
        if not isinstance(call, list):
            self.results.set(call.args[0].request_id, 0)
        return None

    def _answer(self, call: w.Call, client: bytes) -> list[bytes] | None:
        try:
            if call.op == "wait_prefetch_status":  # may be answered later: needs the frames
                result = self._wait_prefetch_status(call, client)
            else:
                result = getattr(self, "_op_" + call.op)(*call.args, client=client)
            return None if result is DEFERRED else w.reply_frames(call, result)
        except (w.DialectError, LMCacheError) as exc:
            self._reject(call.op, exc)
            why = str(exc)
        except Exception as exc:  # a bug, but one any client may trigger at will: rationed
            self._failures.log(logging.ERROR, "LMCache %s failed", call.op, exc_info=True)
            why = f"{type(exc).__name__}: {exc}"
        if call.op == "lookup":  # the prefetch job ends with no hits, as LMCache's would
            self.results.set(call.args[0].request_id, 0)
        return self._failure(call.uid_frame, call.op_frame, call.op, why)

    def _over_limit(self, call: w.Call) -> bool:
        """Whether the call's key names more chunks than one request may
        (``Limits.max_keys_per_request``, as for our own requests). Every chunk of its tokens up
        to ``end`` is chain-hashed, on the loop thread for a memory-only lookup: a 4 MiB frame of
        token ids took ~0.2 s there."""
        key = call.args[0] if call.args else None
        if not isinstance(key, w.IPCCacheServerKey):
            return False
        chunks = key.end // self.handlers.config.chunk_size
        if chunks <= self.limits.max_keys_per_request:
            return False
        self._rejections.log(logging.INFO, "LMCache %s refused: %d chunks, at most %d per request",
                             call.op, chunks, self.limits.max_keys_per_request)
        return True

    def _reject(self, op: str, exc: Exception) -> None:
        self._rejections.log(logging.INFO, "LMCache %s request failed: %s", op, clip(str(exc)))

    # ------------------------------------------------------------------ control ops

    def _op_noop(self, *, client: bytes) -> str:
        return "OK"

    def _op_get_chunk_size(self, *, client: bytes) -> int:
        return self.handlers.config.chunk_size

    def _op_get_experimental(self, *, client: bytes) -> list[str]:
        return []  # neither transfer_query nor kv_event_stream: the client skips both paths

    def _op_ping(self, instance_id: int | None, *, client: bytes) -> bool:
        if instance_id is not None:
            self.handlers.registry.touch(instance_id, client)
        return True

    def _op_clear(self, force: bool, *, client: bytes) -> None:
        self.handlers.clear(m.ClearRequest(force=bool(force)), client)

    def _op_report_block_allocation(self, _iid: int, _model: str, _records: Any, *,
                                    client: bytes) -> None:
        return None  # an observability event in LMCache; nothing to do here

    # ------------------------------------------------------------------ registration

    def _op_register_kv_cache(self, instance_id: int, layers: list[Any], model_name: str,
                              world_size: int, _engine: str, hints: w.LayoutHints,
                              groups: list[w.EngineGroupInfo], *, client: bytes) -> None:
        request = registration_request(instance_id, layers, model_name, world_size, hints, groups)
        self.registrations.register(request, client)

    def _op_unregister_kv_cache(self, instance_id: int, *, client: bytes) -> None:
        self.registrations.unregister(instance_id, client)

    # ------------------------------------------------------------------ data path

    def _op_store(self, key: w.IPCCacheServerKey, instance_id: int, groups: list[list[int]],
                  event: bytes, *, client: bytes) -> tuple[bytes, bool]:
        chunk = self.handlers.config.chunk_size
        w.check_range(key, chunk)
        try:
            reg = self.registrations.for_rank(instance_id, key.worker_id, client)
        except LMCacheError as exc:  # mapping it for this rank failed: in-band, not silence
            return self._failed("store", instance_id, exc)
        if reg is None:
            return self._failed("store", instance_id, _UNUSABLE)
        try:
            request = w.store_request(key, instance_id, groups, chunk, chunk // reg.block_size)
        except ValueError:
            return _FAILED
        if request.chunk_hashes:
            try:
                self.handlers.store(request, client)
            except LMCacheError as exc:  # e.g. reaped meanwhile: in-band, so the client goes on
                return self._failed("store", instance_id, exc)
        return _FAILED[0], True

    def _op_retrieve(self, key: w.IPCCacheServerKey, instance_id: int, groups: list[list[int]],
                     event: bytes, skip_first_n_tokens: int, *, client: bytes) -> tuple[bytes, bool]:
        chunk = self.handlers.config.chunk_size
        w.check_range(key, chunk)
        try:
            reg = self.registrations.for_rank(instance_id, key.worker_id, client)
        except LMCacheError as exc:  # mapping it for this rank failed: in-band, not silence
            return self._failed("retrieve", instance_id, exc)
        if reg is None:
            return self._failed("retrieve", instance_id, _UNUSABLE)
        try:
            request, skipped = w.retrieve_request(key, instance_id, groups, chunk,
                                                  chunk // reg.block_size, skip_first_n_tokens)
        except ValueError:
            return _FAILED
        try:
            if not request.chunk_hashes:
                return _FAILED[0], True
            reply = self.handlers.retrieve(request, client)
        except LMCacheError as exc:  # in-band: vLLM recomputes at once instead of timing out
            return self._failed("retrieve", instance_id, exc)
        finally:
            if skipped:
                self._read_skipped(key.request_id, instance_id, skipped)
        return _FAILED[0], not reply.missing

    def _read_skipped(self, request_id: str, instance_id: int, hashes: list[bytes]) -> None:
        """LMCache's retrieve counts one read of each chunk of its range for its rank, the whole
        chunks ``skip_first_n_tokens`` left out too (their locks must not wait for the TTL).
        Runs in the retrieve's ``finally``: it never raises (it must not hide the retrieve's
        own exception), a failure is logged and the locks wait for their TTL."""
        heads = self.registrations.heads(instance_id)
        if heads is None:
            return
        try:
            self.handlers.engine.release_lookup_reads(request_id, set(hashes), 1, heads)
        except Exception:
            self._failures.log(logging.ERROR, "LMCache retrieve: releasing the skipped chunks' "
                               "locks failed", exc_info=True)

    def _failed(self, op: str, instance_id: int, exc: LMCacheError) -> tuple[bytes, bool]:
        if isinstance(exc, NotRegisteredError):
            self.registrations.forget(instance_id)
        self._rejections.log(logging.INFO, "LMCache %s answered not ok: %s", op, clip(str(exc)))
        return _FAILED

    # ------------------------------------------------------------------ lookups

    def _op_lookup(self, key: w.IPCCacheServerKey, _tp: int, *, client: bytes) -> None:
        request = w.lookup_request(key, self.handlers.config.chunk_size)
        reply = self.handlers.lookup(request, client, readers=key.num_kv_readers)
        if not self.results.set(key.request_id, reply.hit_chunks) and reply.hit_chunks:
            # Its session ended while it ran on a worker (end_session is served at once, and
            # found nothing to release yet): nobody will read these chunks, release them now.
            self.handlers.engine.free_lookup_locks(key.request_id)

    def _op_query_prefetch_status(self, request_id: str, *, client: bytes) -> int | None:
        return self.results.take(request_id)  # once; an unknown id is 0, as in LMCache

    def _wait_prefetch_status(self, call: w.Call, client: bytes) -> int | object | None:
        """As LMCache's: the hits once the lookup is done, None when ``timeout`` passed first; a
        wait on a running lookup is answered later (``PrefetchResults``), never blocking."""
        request_id, timeout = call.args
        post = self.post
        if post is None:
            return self.results.take(request_id)

        def reply(hits: int | None) -> None:
            post([client, *w.reply_frames(call, hits)])

        return self.results.wait(request_id, timeout, reply)

    def _op_free_lookup_locks(self, key: w.IPCCacheServerKey, _tp: int, *, client: bytes) -> None:
        """As LMCache's: ``num_kv_readers`` reads of every rank's lock on each chunk of
        ``[start, end)`` (only chunks the lookup hit are locked); the lookup's result is handed
        over first if it was not; while the lookup runs, nothing."""
        if key.num_kv_readers < 1:
            raise w.DialectError("num_kv_readers must be at least 1")
        if key.start >= key.end or self.results.take(key.request_id) is None:
            return None
        hashes = w.key_hashes(key, self.handlers.config.chunk_size)
        self.handlers.engine.release_lookup_reads(key.request_id, set(hashes),
                                                  key.num_kv_readers)
        return None

    def _op_end_session(self, request_id: str, *, client: bytes) -> None:
        self.results.drop(request_id)
        self.handlers.end_session(m.LookupIdRequest(lookup_id=request_id), client)

