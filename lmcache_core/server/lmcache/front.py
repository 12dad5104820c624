"""LMCache 0.5.6's clients on our socket: a front end of the server's one request pipeline.

The transport's LMCache wire (``protocol.lmcache_wire.LMCacheWire``) claims every request whose op
frame is LMCache's (an int 1-33 or one of its names) and reads its head; the routes built here
(:meth:`LMCacheFrontEnd.routes`) serve each op through :class:`CacheHandlers`, over the same
engine, tiers and copies as our own dialect, with LMCache's behaviours as route policies: copies
and registrations on a worker thread, a long prompt's lookup decoded and hashed there, a tiered
server's lookup acknowledged first (its prefetch runs behind the ack, as LMCache's), a wait on a
running lookup answered later (``routes.LATER``), a stream's credit left unanswered (its protocol
defines no reply). What LMCache's server does differently, and what this one chose, is listed in
``docs/lmcache-compatibility.md``.

Failures: every request is answered at once, a malformed, unserved, refused or failed one by the
pipeline's error boundary in LMCache's own form (``lmcache_wire.failure_frames``: a store or
retrieve ``(b"", False)``, a lookup its ack and 0 hits, any other op a reply naming another op,
which its client raises as a ``ValueError`` carrying our message), where LMCache's own server sends
nothing and its client waits out a 300 s timeout. A store or retrieve that fails in a way LMCache
reports in-band (an unknown instance, too few block ids, a chunk missing) is answered
``(b"", False)`` by its handler. LMCache's engine-driven ops are refused with a message naming
``LMCACHE_MP_TRANSFER_MODE=lmcache_driven`` (also logged once per client). A key naming more
chunks than one request may (``Limits.max_keys_per_request``, as for our own requests) is refused
before it is hashed.

Lookups: LMCache's LOOKUP acknowledges at once and its hit count is handed over once, by
``query_prefetch_status`` or ``wait_prefetch_status`` (``prefetch_status.PrefetchResults``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lmcache_core.engine import PieceStore
from lmcache_core.errors import LMCacheError, NotRegisteredError, ProtocolError, clip
from lmcache_core.log_budget import LogBudget
from lmcache_core.protocol import lmcache_wire as w
from lmcache_core.protocol import messages as m
from lmcache_core.protocol.codec import DEFAULT_LIMITS, Limits
from lmcache_core.server.handlers import CacheHandlers
from lmcache_core.server.lmcache import translate as t
from lmcache_core.server.lmcache.prefetch_status import DEFERRED, PrefetchResults
from lmcache_core.server.lmcache.registrations import DialectRegistrations, registration_request
from lmcache_core.server.registry import KVRegistry
from lmcache_core.transport.routes import LATER, AfterReply, Route, silent_route

logger = logging.getLogger(__name__)
#: The event handle of a reply whose copies were synchronous (no device work to wait for).
_NO_EVENT = b""
#: What a store or retrieve replies when it failed in a way LMCache reports in-band.
_FAILED = (_NO_EVENT, False)
#: Why a store or retrieve found no registration to use (none, dropped, or no such rank); not a
#: NotRegisteredError, which would also forget a registration that is fine for its other ranks.
_UNUSABLE = ProtocolError("no registration of this instance for that rank")
#: A lookup frame longer than this (~64k token ids) is decoded and hashed on a worker thread.
INLINE_LOOKUP_BYTES = 256 << 10
#: ``post([identity, *reply])``: sends a reply later, from any thread (the transport's ``post``).
Post = Callable[[list[bytes]], None]
#: Clients told in the log that the engine-driven path is not served; forgotten beyond this many.
_MAX_TOLD = 4096


class LMCacheFrontEnd:
    """LMCache's ops as routes over ``handlers``; one per server. Given what else it uses: the
    registry, the engine's ``store`` (LMCache's lock releases go to it directly), the
    ``chunk_size``, whether lookups may read lower tiers (``tiered``: they then run behind their
    ack), ``post`` (the transport's: a later reply) and the transport's ``limits``."""

    def __init__(self, handlers: CacheHandlers, registry: KVRegistry, store: PieceStore,
                 chunk_size: int, *, tiered: bool, post: Post,
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.handlers = handlers
        self.registry = registry
        self._store = store
        self.chunk_size = chunk_size
        self.tiered = tiered
        self.limits = limits  # the transport's: what one request may weigh, in either dialect
        self.wire = w.LMCacheWire(limits.max_request_bytes)
        self.post = post
        self.results = PrefetchResults()  # lookup results by request id; parked waits
        self.registrations = DialectRegistrations(handlers, registry)  # in step with the registry
        self._rejections = LogBudget(logger=logger)  # the client's to cause at any rate
        self._failures = LogBudget(logger=logger)
        self._told: set[bytes] = set()  # clients warned that engine-driven transfer is unserved

    def routes(self) -> dict[str, Route]:
        """Each served op's route (payload: a ``lmcache_wire.Call``), keyed by LMCache's name."""
        def on(handler: Callable[..., Any], **policy: Any) -> Route:
            return Route(lambda call, client: handler(*call.args, client=client), **policy)

        tiered = self.tiered
        routes = {
            "noop": on(lambda *, client: "OK"),
            "get_chunk_size": on(lambda *, client: self.chunk_size),
            # Neither transfer_query nor kv_event_stream: the client skips both paths.
            "get_experimental": on(lambda *, client: []),
            "ping": on(self.ping),
            "clear": on(self.clear),
            # An observability event in LMCache; nothing to do here.
            "report_block_allocation": on(lambda _iid, _model, _records, *, client: None),
            "register_kv_cache": on(self.register_kv_cache, blocking=True),
            "unregister_kv_cache": on(self.registrations.unregister, blocking=True),
            "store": on(self.store, blocking=True),
            "retrieve": on(self.retrieve, blocking=True),
            # It may read disk or Redis: on a copy thread behind its ack, its status None until
            # it is done; a long prompt's (~40 ms per MiB to decode and hash) on a copy thread.
            "lookup": on(self.lookup, blocking=tiered, ack_first=tiered,
                         blocking_over=INLINE_LOOKUP_BYTES, before=self._lookup_started),
            "query_prefetch_status": on(self.query_prefetch_status),
            "wait_prefetch_status": Route(self.wait_prefetch_status),
            "free_lookup_locks": on(self.free_lookup_locks),
            "end_session": on(self.end_session),
            w.STREAM_CONTROL: silent_route(),  # no stream is served (get_experimental)
        }
        routes.update({op: Route(self._engine_driven) for op in w.ENGINE_DRIVEN})
        return routes

    # ------------------------------------------------------------------ control ops

    def ping(self, instance_id: int | None, *, client: bytes) -> bool:
        if instance_id is not None:
            self.registry.touch(instance_id, client)
        return True

    def clear(self, force: bool, *, client: bytes) -> None:
        self.handlers.clear(m.ClearRequest(force=bool(force)), client)

    def _engine_driven(self, call: w.Call, client: bytes) -> None:
        """LMCache's engine-driven ops, refused at once with a message saying what to set (vLLM's
        start then fails in a second, naming it); logged once per client too."""
        if client not in self._told:
            if len(self._told) >= _MAX_TOLD:
                self._told.clear()
            self._told.add(client)
            logger.warning("an LMCache client (%s) sent %s: %s", client.hex(), call.op,
                           w.ENGINE_DRIVEN_REFUSAL)
        raise w.DialectError(w.ENGINE_DRIVEN_REFUSAL)

    # ------------------------------------------------------------------ registration

    def register_kv_cache(self, instance_id: int, layers: list[Any], model_name: str,
                          world_size: int, _engine: str, hints: w.LayoutHints,
                          groups: list[w.EngineGroupInfo], *, client: bytes) -> None:
        request = registration_request(instance_id, layers, model_name, world_size, hints, groups)
        self.registrations.register(request, client)

    # ------------------------------------------------------------------ data path

    def store(self, key: w.IPCCacheServerKey, instance_id: int, groups: list[list[int]],
              event: bytes, *, client: bytes) -> tuple[bytes, bool] | AfterReply:
        chunk = self.chunk_size
        reg = self._registration("store", key, instance_id, client)
        if isinstance(reg, tuple):
            return reg
        try:
            request = t.store_request(key, instance_id, groups, chunk, chunk // reg.block_size,
                                      _event_of(reg, event))
        except ValueError:
            return _FAILED
        if not request.chunk_hashes:
            return _NO_EVENT, True
        try:
            stored = self.handlers.store(request, client)
        except LMCacheError as exc:  # e.g. reaped meanwhile: in-band, so the client goes on
            return self._failed("store", instance_id, exc)
        if isinstance(stored, AfterReply):  # its checksums start once this reply is out
            return AfterReply((_NO_EVENT, True), stored.then)
        return _NO_EVENT, True

    def retrieve(self, key: w.IPCCacheServerKey, instance_id: int, groups: list[list[int]],
                 event: bytes, skip_first_n_tokens: int, *, client: bytes) -> tuple[bytes, bool]:
        chunk = self.chunk_size
        reg = self._registration("retrieve", key, instance_id, client)
        if isinstance(reg, tuple):
            return reg
        try:
            request, skipped = t.retrieve_request(key, instance_id, groups, chunk,
                                                  chunk // reg.block_size, skip_first_n_tokens,
                                                  _event_of(reg, event))
        except ValueError:
            return _FAILED
        try:
            if not request.chunk_hashes:
                return _NO_EVENT, True
            reply = self.handlers.retrieve(request, client)
        except LMCacheError as exc:  # in-band: vLLM recomputes at once instead of timing out
            return self._failed("retrieve", instance_id, exc)
        finally:
            if skipped:
                self._read_skipped(key.request_id, instance_id, skipped)
        return _NO_EVENT, not reply.missing

    def _registration(self, op: str, key: w.IPCCacheServerKey, instance_id: int,
                      client: bytes) -> m.RegisterKVCacheRequest | tuple[bytes, bool]:
        """The instance's registration for the key's rank, or the in-band failure to answer
        (LMCache's: none to use, or mapping it for this rank failed); a key of more chunks than
        one request may, or not chunk-aligned within its tokens, raises (LMCache's failure)."""
        self._check_size(key)
        t.check_range(key, self.chunk_size)
        try:
            reg = self.registrations.for_rank(instance_id, key.worker_id, client)
        except LMCacheError as exc:
            return self._failed(op, instance_id, exc)
        return reg if reg is not None else self._failed(op, instance_id, _UNUSABLE)

    def _read_skipped(self, request_id: str, instance_id: int, hashes: list[bytes]) -> None:
        """LMCache's retrieve counts one read of each chunk of its range for its rank, the whole
        chunks ``skip_first_n_tokens`` left out too (their locks must not wait for the TTL).
        Runs in the retrieve's ``finally``: it never raises (it must not hide the retrieve's
        own exception), a failure is logged and the locks wait for their TTL."""
        heads = self.registrations.heads(instance_id)
        if heads is None:
            return
        try:
            self._store.release_lookup_reads(request_id, set(hashes), 1, heads)
        except Exception:
            self._failures.log(logging.ERROR, "LMCache retrieve: releasing the skipped chunks' "
                               "locks failed", exc_info=True)

    def _failed(self, op: str, instance_id: int, exc: LMCacheError) -> tuple[bytes, bool]:
        if isinstance(exc, NotRegisteredError):
            self.registrations.forget(instance_id)
        self._rejections.log(logging.INFO, "LMCache %s answered not ok: %s", op, clip(str(exc)))
        return _FAILED

    def _check_size(self, key: w.IPCCacheServerKey) -> None:
        """Refuse a key naming more chunks than one request may (``Limits.max_keys_per_request``,
        as for our own requests) before it is hashed: every chunk of its tokens up to ``end``
        is chain-hashed, on the loop thread for a memory-only lookup (a 4 MiB frame of token ids
        took ~0.2 s there)."""
        chunks = key.end // self.chunk_size
        if chunks > self.limits.max_keys_per_request:
            raise w.DialectError(f"{chunks} chunks; at most {self.limits.max_keys_per_request} "
                                 "per request")

    # ------------------------------------------------------------------ lookups

    def _lookup_started(self, call: w.Call, _client: bytes) -> None:
        """Before a lookup runs (and before its ack): its status is None until it is done, and
        its result is kept only while this marker is (``end_session`` drops it)."""
        self.results.pending(call.args[0].request_id)

    def lookup(self, key: w.IPCCacheServerKey, _tp: int, *, client: bytes) -> None:
        try:
            self._check_size(key)
            request = t.lookup_request(key, self.chunk_size)
            reply = self.handlers.lookup(request, client, readers=key.num_kv_readers)
        except BaseException:  # the prefetch job ends with no hits, as LMCache's would
            self.results.set(key.request_id, 0)
            raise
        if not self.results.set(key.request_id, reply.hit_chunks) and reply.hit_chunks:
            # Its session ended while it ran on a worker (end_session is served at once, and
            # found nothing to release yet): nobody will read these chunks, release them now.
            self._store.free_lookup_locks(key.request_id)

    def query_prefetch_status(self, request_id: str, *, client: bytes) -> int | None:
        return self.results.take(request_id)  # once; an unknown id is 0, as in LMCache

    def wait_prefetch_status(self, call: w.Call, client: bytes) -> int | object | None:
        """As LMCache's: the hits once the lookup is done, None when ``timeout`` passed first; a
        wait on a running lookup is answered later (``PrefetchResults``), never blocking."""
        request_id, timeout = call.args

        def reply(hits: int | None) -> None:
            self.post([client, *w.reply_frames(call, hits)])

        result = self.results.wait(request_id, timeout, reply)
        return LATER if result is DEFERRED else result

    def free_lookup_locks(self, key: w.IPCCacheServerKey, _tp: int, *, client: bytes) -> None:
        """As LMCache's: ``num_kv_readers`` reads of every rank's lock on each chunk of
        ``[start, end)`` (only chunks the lookup hit are locked); the lookup's result is handed
        over first if it was not; while the lookup runs, nothing."""
        if key.num_kv_readers < 1:
            raise w.DialectError("num_kv_readers must be at least 1")
        self._check_size(key)
        if key.start >= key.end or self.results.take(key.request_id) is None:
            return None
        hashes = t.key_hashes(key, self.chunk_size)
        self._store.release_lookup_reads(key.request_id, set(hashes), key.num_kv_readers)
        return None

    def end_session(self, request_id: str, *, client: bytes) -> None:
        self.results.drop(request_id)
        self.handlers.end_session(m.LookupIdRequest(lookup_id=request_id), client)


def _event_of(reg: m.RegisterKVCacheRequest, event: bytes) -> bytes:
    """The worker's CUDA event for a GPU registration's copies to wait on (LMCache's client
    records it after the forward pass, as ours); on the CPU LMCache sends a stub: none."""
    return event if reg.layers[0].kind == "cuda" else b""
