"""Request handlers of ``lmcache serve``: each op's payload in, its reply out, over one CacheEngine.

Handlers raise ``LMCacheError`` subclasses for anything the client got wrong; the transport's single
error boundary turns those into typed ``ErrorReply``s. Store and retrieve run on worker threads; the
byte copies run outside the engine's lock, between its ``begin_*`` and ``finish_*``.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, NamedTuple

from lmcache_core import __version__
from lmcache_core.config import LMCacheConfig
from lmcache_core.engine import (
    MEMORY_TIER,
    CacheEngine,
    GroupTarget,
    PieceRow,
    Retention,
    RetrievePlan,
    StorePlan,
)
from lmcache_core.engine.tiered import TierCounts
from lmcache_core.errors import CopiesStalledError, IncompatibleError, ProtocolError
from lmcache_core.keys import ChunkKey, HeadRange, group_piece, is_mla, rank_heads
from lmcache_core.kv.copy import check_skip
from lmcache_core.kv.cuda_events import open_ipc_event
from lmcache_core.kv.mapped import MappedKVCache
from lmcache_core.protocol import messages as m
from lmcache_core.protocol.ops import RequestType
from lmcache_core.server.explain import ExplainHandler, StoreModes
from lmcache_core.server.layouts import LayoutResolver
from lmcache_core.server.pins import PinHandlers
from lmcache_core.server.registry import KVRegistry, Registration
from lmcache_core.stats import EventStats, GroupStats, ServerStats, TransportStats
from lmcache_core.storage.checksum_lanes import LANE_TIMEOUT_S, ChecksumLanes, PieceChecksums
from lmcache_core.storage.pool import process_rss_bytes
from lmcache_core.transport.routes import AfterReply
from lmcache_core.transport.server import Route

if TYPE_CHECKING:
    from lmcache_core.storage.remote import RemoteTier

#: Copy threads added per GPU with registered KV caches (a store waiting for that GPU's forward
#: pass, and a retrieve beside it).
COPY_THREADS_PER_GPU = 2


def _chunk_blocks(block_ids: Sequence[int], indices: Sequence[int], per_chunk: int) -> list[int]:
    """The block ids of the chunks at ``indices`` (one slice per chunk, not per block)."""
    if len(indices) * per_chunk == len(block_ids):
        return list(block_ids)
    out: list[int] = []
    for i in indices:
        out += block_ids[i * per_chunk:(i + 1) * per_chunk]
    return out


class _Blocks(NamedTuple):
    """A retrieve's block ids: ``per_chunk`` a chunk, the first chunk's leading
    ``skip_blocks`` not written (``RetrieveRequest.skip_blocks``)."""

    ids: Sequence[int]
    per_chunk: int
    skip_blocks: int = 0

    def of(self, indices: Sequence[int]) -> list[int]:
        """The block ids of the chunks at ``indices``."""
        return _chunk_blocks(self.ids, indices, self.per_chunk)

    def skip_for(self, indices: Sequence[int]) -> int:
        """The leading blocks a copy of the chunks at ``indices`` (increasing) leaves out: the
        request's ``skip_blocks`` when its first chunk is among them."""
        return self.skip_blocks if indices and indices[0] == 0 else 0


class _PartOutcome(NamedTuple):
    """One part of a retrieve: chunks copied, and the part's indexes of those not copied
    (sorted), of which ``late`` were cut by the deadline."""

    retrieved: int
    missing: list[int]
    late: int


#: Under a load deadline a retrieve copies runs of chunks of at most this many bytes (at least
#: one chunk), checking the deadline before each run: so a deadline is overrun by one run's copy
#: at most, and small chunks are not copied one call each. Chunk by chunk, a hybrid model's 2 MiB
#: pieces took 1.35x the CPU of one scatter per request in the server (scripts/profile_hit.py
#: --server-trace: each call's views, id checks and GIL hand-offs), and a Llama-8B chunk is 32
#: MiB already.
DEADLINE_RUN_BYTES = 16 << 20


def deadline_run(chunk_bytes: int, test_delay: bool = False) -> int:
    """Chunks per run of a retrieve under a deadline (``DEADLINE_RUN_BYTES``); one with the
    test-only copy delay, which is a delay per chunk."""
    if test_delay or chunk_bytes <= 0:
        return 1
    return max(1, DEADLINE_RUN_BYTES // chunk_bytes)


class CacheHandlers:
    """The op handlers of one server, sharing its engine, registry and config."""

    def __init__(self, config: LMCacheConfig, engine: CacheEngine, registry: KVRegistry,
                 transport_stats: Callable[[], TransportStats], url: str) -> None:
        self.config = config
        self.engine = engine
        self.registry = registry
        self.layouts = LayoutResolver(engine, registry)
        self.transport_stats = transport_stats  # the socket loop's section of SERVER_INFO
        self.url = url
        self.http_url: str | None = None  # set when the server's HTTP listener is bound
        self.started = time.monotonic()
        #: ``add_workers(extra)`` of the transport, to size copy threads by the GPUs registered.
        self.add_copy_threads: Callable[[int], int] | None = None
        #: Told why, when the GPU did not finish a request's copies in time (the server stops).
        self.on_copies_stalled: Callable[[str], None] | None = None
        self.events_stats: Callable[[], EventStats] | None = None  # the KV-event publisher's
        self.checksum_lanes = ChecksumLanes()  # stores' pieces hashed there, off their reply
        self.store_modes = StoreModes()  # stores per model by hash mode, for EXPLAIN
        #: What load deadlines are measured on (tests put their own clock here).
        self.deadline_clock: Callable[[], float] = time.monotonic

    def routes(self) -> dict[RequestType, Route]:
        pins = PinHandlers(self.engine, self.layouts)
        explain = ExplainHandler(self.engine, self.registry, self.store_modes, self.tier_budget_s)
        return {
            RequestType.PING: Route(self.ping),
            RequestType.GET_CHUNK_SIZE: Route(self.get_chunk_size),
            RequestType.REGISTER_KV_CACHE: Route(self.register_kv_cache, blocking=True),
            RequestType.UNREGISTER_KV_CACHE: Route(self.unregister_kv_cache, blocking=True),
            # The worker's CUDA event is waited for in the transport's gate, not on a copy thread.
            RequestType.STORE: Route(self.store, blocking=True, gate=self.event_gate),
            RequestType.RETRIEVE: Route(self.retrieve, blocking=True, gate=self.event_gate),
            # With a disk or remote tier a lookup may read files or wait on Redis: off the loop.
            RequestType.LOOKUP: Route(self.lookup, blocking=self.engine.has_tiers),
            RequestType.FREE_LOOKUP_LOCKS: Route(self.free_lookup_locks),
            RequestType.END_SESSION: Route(self.end_session),
            RequestType.CLEAR: Route(self.clear),
            RequestType.SERVER_INFO: Route(self.server_info),
            # With tiers, a listing reads the disk index and SCANs Redis (within its budget).
            RequestType.LIST_CHUNKS: Route(self.list_chunks, blocking=self.engine.has_tiers),
            RequestType.PEEK: Route(self.peek, blocking=self.engine.has_tiers),
            RequestType.PIN: Route(pins.pin),
            RequestType.UNPIN: Route(pins.unpin),
            # It looks through every (model, layout) held and may wait on Redis: off the loop.
            RequestType.EXPLAIN: Route(explain.explain, blocking=True),
        }

    # ------------------------------------------------------------------ control

    def ping(self, request: m.PingRequest, client: bytes) -> m.PingReply:
        known = (None if request.instance_id is None
                 else self.registry.touch(request.instance_id, client))
        return m.PingReply(version=__version__, chunk_size=self.config.chunk_size,
                           uptime_s=time.monotonic() - self.started, pid=os.getpid(),
                           registered=known)

    def get_chunk_size(self, _request: m.NoArgs, _client: bytes) -> m.ChunkSizeReply:
        return m.ChunkSizeReply(chunk_size=self.config.chunk_size)

    def register_kv_cache(self, request: m.RegisterKVCacheRequest,
                          client: bytes) -> m.RegisterKVCacheReply:
        if request.kv_rank >= request.world_size:  # each is bounded by its type
            raise ProtocolError(
                f"kv_rank {request.kv_rank} is outside world size {request.world_size}")
        registration = self.registry.register(request, client)
        if registration.device_uuid and self.add_copy_threads is not None:
            self.add_copy_threads(COPY_THREADS_PER_GPU * self.registry.gpu_count())
        mapped = registration.mapped
        return m.RegisterKVCacheReply(chunk_bytes=mapped.chunk_bytes,
                                      blocks_per_chunk=mapped.blocks_per_chunk,
                                      layout=registration.layout, head_lo=registration.heads[0],
                                      head_hi=registration.heads[1])

    def open_mapping(self, request: m.RegisterKVCacheRequest) -> MappedKVCache:
        """Map a worker's tensors; check its chunk pieces fit the pool and its heads
        divide among its world size."""
        mapped = MappedKVCache.open(request.layers, request.layout, request.block_size,
                                    self.piece_tokens(request), owner_pid=request.pid,
                                    allowed_uids=self.config.server.allowed_uids)
        try:
            if not self.engine.pool.fits(mapped.chunk_bytes):
                raise IncompatibleError(
                    f"a chunk of this KV cache is {mapped.chunk_bytes} bytes per rank but the "
                    f"pool holds {self.engine.pool.max_alloc_bytes} (raise server.pool_size)")
            try:
                rank_heads(mapped.fingerprint(request.world_size), request.world_size,
                           request.kv_rank)
            except ValueError as exc:
                raise IncompatibleError(str(exc)) from None
        except BaseException:
            mapped.close()
            raise
        return mapped

    def piece_tokens(self, request: m.RegisterKVCacheRequest) -> int:
        """The tokens of each chunk this registration's pieces hold: the chunk's, or for a
        sliding-window group its last ``piece_blocks`` blocks' (``keys.group_piece``).
        IncompatibleError naming the sizes when the chunk size is no multiple of the group's
        block size. A Mamba group's piece is one state row (the state at the chunk's end)."""
        chunk_size, group = self.config.chunk_size, request.group
        if group is None:
            return chunk_size
        if chunk_size % group.block_size:
            raise IncompatibleError(
                f"the lmcache chunk size {chunk_size} is not a multiple of KV cache group "
                f"{group.index}'s ({group.kind}) block size {group.block_size}: every group's "
                f"block size must divide the chunk size")
        if group.kind == "mamba":
            return request.block_size  # one block of state rows
        piece = group_piece(chunk_size, group.block_size, group.kind, group.window_tokens)
        return piece.piece_blocks * group.block_size

    def unregister_kv_cache(self, request: m.UnregisterKVCacheRequest,
                            _client: bytes) -> m.OkReply:
        self.registry.unregister(request.instance_id)
        return m.OkReply()

    # ------------------------------------------------------------------ data path

    def store(self, request: m.StoreRequest, _client: bytes) -> m.StoreReply | AfterReply:
        """Copy the request's chunks in and commit them. A store big enough to hash on a lane
        returns its reply with the hash to start once that reply is out (``AfterReply``)."""
        with self.registry.lease(request.instance_id) as reg:
            per_chunk = self._check_blocks(reg, request.chunk_hashes, request.block_ids)
            self.store_modes.count(reg.model_name, request.hash_mode)
            keys = self._keys(reg, request.chunk_hashes)
            plan = self.engine.begin_store(keys, reg.mapped.chunk_bytes, Retention(
                request.ttl_s, request.pin, request.priority), request.tenant)
            sums: PieceChecksums | None = None
            start_hash: Callable[[], None] | None = None
            ok = stalled = False
            try:
                if plan.writes:
                    sums = self._gather(reg, request.block_ids, plan, per_chunk,
                                        request.event_handle)
                ok = True
            except CopiesStalledError as exc:
                stalled = True
                self._copies_stalled(exc)
                raise
            finally:
                if not stalled:  # a late copy may still write its slots: they stay reserved
                    start_hash = self._commit(plan, ok, sums)
        reply = m.StoreReply(stored=len(plan.writes), already_present=plan.already_present,
                             skipped_full=plan.skipped_full, skipped_quota=plan.skipped_quota,
                             pin_refused=plan.pin_refused)
        return reply if start_hash is None else AfterReply(reply, start_hash)

    def _gather(self, reg: Registration, block_ids: Sequence[int], plan: StorePlan,
                per_chunk: int, event_handle: bytes) -> PieceChecksums:
        """Copy the plan's chunks into their slots; their pieces' checksums to take."""
        slots = [w[2] for w in plan.writes]
        blocks = _chunk_blocks(block_ids, [w[0] for w in plan.writes], per_chunk)
        with self.checksum_lanes.copies.running(), \
                reg.copy_stream.run(event_handle, self.event_timeout_s):  # (GPU: synced inside)
            reg.mapped.gather(blocks, slots)
        return self.checksum_lanes.begin(slots, reg.mapped.chunk_bytes)

    def _commit(self, plan: StorePlan, ok: bool,
                sums: PieceChecksums | None) -> Callable[[], None] | None:
        """Make the store's pieces visible (or free them when not ``ok``). A small store's
        checksums are taken before; for others the reply does not wait for them: the pieces
        commit as pending, and what is returned starts their hash (``checksum_lanes``), to be
        called once the reply is out; the lane records the digests (whatever relies on them
        waits: ``PieceStore.wait_checksums``)."""
        if not ok or sums is None or not sums.deferred:
            if ok and sums is not None:
                plan.checksums = sums.digests()
            self.engine.finish_store(plan, ok)
            return None
        self.engine.finish_store(plan, checksums_pending=True)
        engine = self.engine
        return sums.finish(lambda digests: engine.record_checksums(plan, digests))

    def retrieve(self, request: m.RetrieveRequest, _client: bytes) -> m.RetrieveReply:
        """Copy the found chunks into the worker's blocks, within the load deadline.

        Without a deadline (and without the test-only copy delay) a part's chunks go in one
        scatter. With one, the deadline is checked before each run of chunks (``deadline_run``):
        once it passed, the rest are not copied and are answered in ``missing`` (``late`` counts
        them). A run that started always finishes (on GPU: is synchronized) before the next
        check and before the reply, so nothing lands in a block after the client was told it was
        not loaded. With ``integrity.verify_on_retrieve`` every found piece is checked against its
        checksum first: a chunk with a corrupt piece is dropped (counted) and answered in
        ``missing``.

        The parts (``RetrieveRequest.more``: a hybrid model's other groups) are all leased and
        their block ids checked before anything is copied; then copied in order under the one
        deadline, and answered together, ``missing`` indexing every part's chunks in order. A
        part that raises ends the request (its error is the reply); the later parts' chunks stay
        locked for the lookup id until its session ends or the locks expire, as after a lookup
        that was never retrieved."""
        deadline_s = self.load_deadline_s(request)
        until: float | None = None  # one scatter a part, unless a deadline (or delay) cuts runs
        if deadline_s is not None:
            until = self.deadline_clock() + deadline_s
        elif self.copy_delay_s:
            until = math.inf
        parts = request.parts()
        with contextlib.ExitStack() as leases:
            checked: list[tuple[Registration, _Blocks]] = []
            for part in parts:
                reg = leases.enter_context(self.registry.lease(part.instance_id))
                per_chunk = self._check_blocks(reg, part.chunk_hashes, part.block_ids,
                                               part.skip_blocks)
                checked.append((reg, _Blocks(part.block_ids, per_chunk, part.skip_blocks)))
            retrieved, missing, late, offset = 0, [], 0, 0
            for part, (reg, part_blocks) in zip(parts, checked, strict=True):
                outcome = self._retrieve_part(reg, part.chunk_hashes, part_blocks, request,
                                              deadline_s, until)
                retrieved += outcome.retrieved
                missing += [offset + i for i in outcome.missing]
                late += outcome.late
                offset += len(part.chunk_hashes)
        return m.RetrieveReply(retrieved=retrieved, missing=missing, late=late)

    def _retrieve_part(self, reg: Registration, hashes: Sequence[bytes], blocks: _Blocks,
                       request: m.RetrieveRequest, deadline_s: float | None,
                       until: float | None) -> _PartOutcome:
        """One registration's chunks of a retrieve: ``until`` (on ``deadline_clock``) when its
        copy goes in runs under a deadline (or the test delay), else None (one scatter)."""
        plan = self.engine.begin_retrieve(reg.model_name, reg.layout, reg.heads, hashes,
                                          request.lookup_id)
        copied: int | None = None
        stalled = False
        try:
            if plan.found and self.config.integrity.verify_on_retrieve:
                # corrupt chunks (or whose checksum is not taken within the deadline): missing
                self.engine.integrity.verify_retrieve(plan, LANE_TIMEOUT_S if deadline_s is None
                                                      else deadline_s)
            if plan.found:
                with self.checksum_lanes.copies.running(), \
                        reg.copy_stream.run(request.event_handle, self.event_timeout_s):
                    if until is None:
                        self._scatter(reg, plan, range(len(plan.found)), blocks)
                    else:
                        copied = self._scatter_until(reg, plan, blocks, until)
        except CopiesStalledError as exc:
            stalled = True
            self._copies_stalled(exc)
            raise
        finally:
            if not stalled:  # a late copy may still read its pieces: they stay held
                self.engine.finish_retrieve(plan, copied)
        if copied is None or copied == len(plan.found):
            return _PartOutcome(len(plan.found), list(plan.missing), 0)
        late = [f[0] for f in plan.found[copied:]]
        return _PartOutcome(copied, sorted(plan.missing + late), len(late))

    @staticmethod
    def _scatter(reg: Registration, plan: RetrievePlan, positions: Sequence[int],
                 blocks: _Blocks) -> None:
        """Copy ``plan.found[p]`` for ``p`` in ``positions`` into their blocks: chunks held as one
        piece of exactly this rank's heads in one scatter, the others (pieces stored by another
        tensor-parallel size) by head-range copies; the request's first chunk without its
        ``skip_blocks`` leading blocks."""
        exact = [p for p in positions if plan.is_exact(p)]
        other = [p for p in positions if not plan.is_exact(p)]
        if exact:
            indices = [plan.found[p][0] for p in exact]
            reg.mapped.scatter([plan.found[p][1][0][0] for p in exact], blocks.of(indices),
                               blocks.skip_for(indices))
        if other:
            indices = [plan.found[p][0] for p in other]
            reg.mapped.scatter_heads([plan.found[p][1] for p in other], plan.heads,
                                     blocks.of(indices), blocks.skip_for(indices))

    def _scatter_until(self, reg: Registration, plan: RetrievePlan, blocks: _Blocks,
                       deadline: float) -> int:
        """Copy ``plan.found`` in runs of chunks (``deadline_run``) while ``deadline`` (on
        ``deadline_clock``) is not reached; returns how many were copied (a prefix). Each run is
        complete before the next check."""
        delay_s = self.copy_delay_s
        run = deadline_run(reg.mapped.chunk_bytes, delay_s > 0)
        clock = self.deadline_clock
        found = len(plan.found)
        for done in range(0, found, run):
            if clock() >= deadline:
                return done
            if delay_s:
                time.sleep(delay_s)  # server.test_copy_delay_ms: test-only fault injection
            self._scatter(reg, plan, range(done, min(done + run, found)), blocks)
            reg.copy_stream.synchronize(self.event_timeout_s)  # no-op on CPU
        return found

    def _copies_stalled(self, exc: CopiesStalledError) -> None:
        """The GPU did not finish this request's copies in time. They cannot be cancelled and may
        land later: in slots a new piece would get, or read from pieces evicted meanwhile. So
        the request's memory stays held, and the server stops (its supervisor logs why and
        exits non-zero, to be restarted) rather than serve with copies it cannot account for."""
        if self.on_copies_stalled is not None:
            self.on_copies_stalled(f"GPU copies stalled: {exc}")

    def load_deadline_s(self, request: m.RetrieveRequest) -> float | None:
        """The retrieve's deadline in seconds: its own ``deadline_ms``, else ``timeouts.load_ms``;
        None when that is 0 (no deadline)."""
        ms = request.deadline_ms
        if ms is None:
            ms = self.config.timeouts.load_ms
        return ms / 1000 if ms else None

    @property
    def copy_delay_s(self) -> float:
        return self.config.server.test_copy_delay_ms / 1000

    def event_gate(self, request: m.StoreRequest | m.RetrieveRequest) -> tuple[Any, float] | None:
        """The worker's CUDA event a store/retrieve waits for, opened, and how long it may take:
        the transport parks the request until the event completes, so no copy thread waits for
        a forward pass. None when there is nothing to wait for here (no handle, a CPU or unknown
        instance: the handler answers those). A retrieve waits at most its load deadline: past
        it, the transport answers a timeout without copying anything, which the worker adapter
        reports as load errors for all the request's blocks (the same outcome as a deadline that
        passed before the first chunk)."""
        if not request.event_handle:
            return None
        device = self.registry.cuda_device(request.instance_id)
        if device is None:
            return None
        event = open_ipc_event(request.event_handle, device)
        if event is None:
            return None
        timeout_s = self.event_timeout_s
        if isinstance(request, m.RetrieveRequest):
            deadline_s = self.load_deadline_s(request)
            if deadline_s is not None:
                timeout_s = min(timeout_s, deadline_s)
        return event, timeout_s

    @property
    def event_timeout_s(self) -> float:
        """How long a copy waits for the worker's CUDA event, then for its own copies: the
        client's request timeout (a later reply would find no one waiting)."""
        return self.config.timeouts.request_s

    @staticmethod
    def _keys(reg: Registration, hashes: Sequence[bytes]) -> list[ChunkKey]:
        model, layout, (lo, hi) = reg.model_name, reg.layout, reg.heads
        return [ChunkKey(model, layout, lo, hi, h) for h in hashes]

    @staticmethod
    def _check_blocks(reg: Registration, hashes: Sequence[bytes], block_ids: Sequence[int],
                      skip_blocks: int = 0) -> int:
        """Blocks per chunk, once the request's block ids are checked whole (count and range,
        and the first chunk's ``skip_blocks``) before anything is copied: a retrieve copies
        chunk by chunk, and some paths (pieces of other TP sizes) check ids only as they copy,
        so a bad id late in the list would leave the earlier chunks written."""
        per_chunk: int = reg.mapped.blocks_per_chunk
        if len(block_ids) != len(hashes) * per_chunk:
            raise ProtocolError(
                f"{len(hashes)} chunks need {len(hashes) * per_chunk} block ids "
                f"({per_chunk} per chunk), got {len(block_ids)}")
        check_skip(skip_blocks, per_chunk, len(hashes))
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= reg.mapped.num_blocks):
            raise ProtocolError(f"block ids must be in [0, {reg.mapped.num_blocks}) for this KV "
                                f"cache, got {min(block_ids)}..{max(block_ids)}")
        return per_chunk

    def lookup(self, request: m.LookupRequest, _client: bytes, readers: int = 1) -> m.LookupReply:
        """Hit chunks for ``world_size`` ranks in the request's layout (``layouts``: its own, else
        the registered workers', else every one held for the model; the best of several).

        Each rank's lock on a chunk goes with ``readers`` retrieves of it by that rank (LMCache's
        ``num_kv_readers``); for MLA, whose one piece every rank reads, by each of the
        ``world_size`` ranks: the first rank's retrieve must not unlock what the others read.
        The sessions in ``ended`` are ended first (``end_session``, riding on this lookup)."""
        released = [self.engine.end_session(ended) for ended in request.ended]
        if request.layout is None:
            groups = self.layouts.groups(request.model_name, request.world_size)
            if groups is not None:
                hits = self._lookup_groups(request, groups, readers)
                return m.LookupReply(hit_chunks=hits, released=released)
        target = self.layouts.best(request.model_name, request.world_size, request.layout,
                                   request.chunk_hashes)
        if target is None:  # no layout whose heads divide by world_size
            return m.LookupReply(hit_chunks=0, released=released)
        layout, ranges = target
        shared = request.world_size if is_mla(layout) else 1
        hits = self.engine.lookup(request.model_name, layout, ranges, request.chunk_hashes,
                                  request.lookup_id, request.lock,
                                  tier_timeout_s=self.tier_budget_s, readers=readers,
                                  shared=shared)
        return m.LookupReply(hit_chunks=hits, released=released)

    def _lookup_groups(self, request: m.LookupRequest, groups: list[GroupTarget],
                       readers: int) -> int:
        """A hybrid model's hit: the chunks at whose end every KV-cache group can be restored,
        every group's pieces locked under the one lookup id (``CacheEngine.lookup_groups``);
        0 while its registered groups are incomplete."""
        if not groups:
            if request.lock:  # a miss holds nothing, as any lookup's
                self.engine.free_lookup_locks(request.lookup_id)
            return 0
        shared = request.world_size if all(is_mla(g.layout) for g in groups) else 1
        return self.engine.lookup_groups(request.model_name, groups, request.chunk_hashes,
                                         request.lookup_id, request.lock,
                                         tier_timeout_s=self.tier_budget_s, readers=readers,
                                         shared=shared)

    def peek(self, request: m.PeekRequest, _client: bytes) -> m.PeekReply:
        """The leading chunks every tier holds together for the request's ranks, and where each
        is (``TieredStorage.peek``): in the best of the candidate layouts (its own; else the
        registered workers', else the resident ones, and ``hint_layout`` beside them). Nothing
        is loaded, locked, touched or counted; Redis is asked once per layout, in the budget."""
        tiers = self.engine.tiers
        names = [name for name in ("disk", "remote") if getattr(self.config, name) is not None]
        if request.layout is None:
            groups = self.layouts.groups(request.model_name, request.world_size)
            if groups is not None:
                return self._peek_groups(request, groups, names)
        best: tuple[tuple[int, int, bool], m.PeekReply] | None = None
        deadline = time.monotonic() + self.tier_budget_s
        for layout, ranges in self._peek_targets(request):
            if tiers is None:
                counts = TierCounts(memory=self.engine.held(
                    request.model_name, layout, ranges, request.chunk_hashes))
            else:
                counts = tiers.peek(request.model_name, layout, ranges, request.chunk_hashes,
                                    max(0.0, deadline - time.monotonic()))
            reply = m.PeekReply(layout=layout, hit_chunks=counts.hits, memory_chunks=counts.memory,
                                disk_chunks=counts.disk, remote_chunks=counts.remote_chunks,
                                remote=counts.remote, tiers=names)
            rank = (counts.hits, counts.memory, layout == request.hint_layout)
            if best is None or rank > best[0]:
                best = (rank, reply)
        return best[1] if best is not None else m.PeekReply(layout="", hit_chunks=0, tiers=names)

    def _peek_groups(self, request: m.PeekRequest, groups: list[GroupTarget],
                     names: list[str]) -> m.PeekReply:
        """A hybrid model's peek: the chunks at whose end every KV-cache group can be restored,
        as its lookup counts them (``TieredStorage.peek_groups``), in the registered workers'
        groups (``groups`` names their layouts; none while those do not cover every group)."""
        layouts = [group.layout for group in groups]
        if not groups:
            return m.PeekReply(layout="", hit_chunks=0, tiers=names, groups=layouts)
        tiers, model, hashes = self.engine.tiers, request.model_name, request.chunk_hashes
        if tiers is None:
            counts = TierCounts(memory=self.engine.held_groups(model, groups, hashes))
        else:
            counts = tiers.peek_groups(model, groups, hashes, self.tier_budget_s)
        return m.PeekReply(layout="", hit_chunks=counts.hits, memory_chunks=counts.memory,
                           disk_chunks=counts.disk, remote_chunks=counts.remote_chunks,
                           remote=counts.remote, tiers=names, groups=layouts)

    def _peek_targets(self, request: m.PeekRequest) -> list[tuple[str, tuple[HeadRange, ...]]]:
        """The layouts a peek counts in, each with its ranks' head ranges (layouts whose heads do
        not divide among the world size are left out: they never hold a hit for it)."""
        model, world = request.model_name, request.world_size
        if request.layout is not None:
            return self.layouts.candidates(model, world, request.layout)
        targets = self.layouts.candidates(model, world, None)
        hint = request.hint_layout
        if hint is not None and all(layout != hint for layout, _ in targets):
            targets += self.layouts.candidates(model, world, hint)
        return targets

    @property
    def tier_budget_s(self) -> float:
        """How long a lookup may spend on disk and Redis: 80 % of the lookup timeout, so the
        reply still reaches a client that waits ``timeouts.lookup_ms``."""
        return self.config.timeouts.lookup_ms / 1000 * 0.8

    def free_lookup_locks(self, request: m.LookupIdRequest, _client: bytes) -> m.ReleasedReply:
        return m.ReleasedReply(released=self.engine.free_lookup_locks(request.lookup_id))

    def end_session(self, request: m.LookupIdRequest, _client: bytes) -> m.ReleasedReply:
        return m.ReleasedReply(released=self.engine.end_session(request.lookup_id))

    # ------------------------------------------------------------------ admin

    def clear(self, request: m.ClearRequest, _client: bytes) -> m.ClearReply:
        removed, kept = self.engine.clear(request.force)
        return m.ClearReply(removed=removed, kept_locked=kept)

    def server_info(self, _request: m.NoArgs, _client: bytes) -> m.ServerInfoReply:
        pool = self.engine.pool
        registered = self.registry.models()
        models = self.engine.model_stats()
        for row in models:
            row.registered = registered.pop(row.model_name, 0)
        models += [m.ModelStats(model_name=name, pieces=0, bytes_used=0, registered=count,
                                quota_bytes=self.engine.quotas.get(name))
                   for name, count in sorted(registered.items())]
        for row in models:
            row.groups = [GroupStats(index=g.index, count=g.count, kind=g.kind,
                                     block_size=g.block_size, window_tokens=g.window_tokens,
                                     layout=layout)
                          for layout, g in sorted(self.registry.groups(row.model_name, None),
                                                  key=lambda item: (item[1].index, item[0]))]
        return m.ServerInfoReply(
            version=__version__, url=self.url, pid=os.getpid(), chunk_size=self.config.chunk_size,
            uptime_s=time.monotonic() - self.started, pool_bytes=self.engine.pool.nbytes,
            slab_bytes=self.engine.pool.slab_bytes, eviction=self.config.server.eviction,
            stats=self.server_stats(), http_url=self.http_url, models=models,
            tenants=self.engine.tenant_stats(),
            tiers=[name for name in ("disk", "remote") if getattr(self.config, name) is not None],
            pool_populate=pool.populate_state, pool_populated_bytes=pool.populated_bytes,
            pool_populate_s=pool.populate_s, pool_huge_pages=pool.huge_pages,
            rss_bytes=process_rss_bytes())

    def server_stats(self) -> ServerStats:
        """Every component's section, read now: SERVER_INFO's ``stats``, and what ``/metrics``
        exports (``server.metrics``). A section is None where its component is not configured."""
        disk, remote, events = self.engine.disk, self.engine.remote, self.events_stats
        return ServerStats(
            engine=self.engine.snapshot(), transport=self.transport_stats(),
            workers=self.registry.stats(),
            disk=disk.stats() if disk is not None else None,
            remote=remote.stats() if remote is not None else None,
            events=events() if events is not None else None)

    def list_chunks(self, request: m.ListChunksRequest, _client: bytes) -> m.ChunkListReply:
        """Up to ``limit`` pieces of the listed tiers (memory, and the disk's index) in the
        request's order, how many match in all, and each tier's total: for Redis a count of keys
        by pattern within ``remote_budget_ms`` (``RemoteTier.count_keys``; Redis is never listed)."""
        model, limit, sort = request.model_name, request.limit, request.sort
        rows: list[m.ChunkInfo] = []
        totals: list[m.TierTotal] = []
        if "memory" in request.tiers:
            memory_rows, pieces = self.engine.list_chunks(model, limit, sort)
            rows += [_chunk_info(row) for row in memory_rows]
            totals.append(m.TierTotal(tier=MEMORY_TIER, pieces=pieces, nbytes=sum(
                row.bytes_used for row in self.engine.model_stats()
                if model is None or row.model_name == model)))
        disk = self.engine.disk
        if disk is not None and "disk" in request.tiers:
            found = disk.listing(model)
            totals.append(m.TierTotal(tier=disk.name, pieces=len(found),
                                      nbytes=sum(nbytes for _, nbytes, _ in found)))
            rows += _disk_rows(found, limit, sort)
        remote = self.engine.remote
        if remote is not None and "remote" in request.tiers:
            totals.append(self._count_remote(remote, request))
        rows.sort(key=LISTING_ORDER[sort])  # memory's rows are in this order: a merge
        listed = sum(t.pieces for t in totals if t.tier != "remote")
        return m.ChunkListReply(chunks=rows[:limit], total=listed, tiers=totals)

    def _count_remote(self, remote: RemoteTier, request: m.ListChunksRequest) -> m.TierTotal:
        """Redis's keys matching the request's pattern (default: the model's keys, or all), counted
        on the tier's own thread for at most the request's budget."""
        from lmcache_core.storage.remote import glob_escape  # (imports redis: here, it is in)

        match = request.remote_match
        if match is None:
            match = "*" if request.model_name is None else glob_escape(request.model_name) + ":*"
        budget_s = request.remote_budget_ms / 1000
        deadline = time.monotonic() + budget_s
        try:
            # A SCAN step is checked against the deadline before it starts; one that hangs is
            # bounded by the tier's socket timeout, which the wait here allows for.
            count = remote.run(remote.count_keys, match, deadline).result(
                timeout=budget_s + remote.timeout_s)
        except FutureTimeout:
            return m.TierTotal(tier=remote.name, pieces=0, complete=False,
                               error=f"Redis did not answer within {budget_s + remote.timeout_s:.1f}s")
        except RuntimeError:  # the tier is shutting down
            return m.TierTotal(tier=remote.name, pieces=0, complete=False, error="stopping")
        return m.TierTotal(tier=remote.name, pieces=count.keys, complete=count.complete,
                           pattern=count.pattern, error=count.error)


#: A listing's order over the rows of every tier (``CacheEngine.list_chunks``'s, on ChunkInfo):
#: ``age`` newest first, ``hits`` and ``size`` most first, ``key`` so a chunk's pieces sit together.
LISTING_ORDER: dict[str, Callable[[m.ChunkInfo], Any]] = {
    "age": lambda c: c.age_s,
    "hits": lambda c: (-c.hits, c.age_s),
    "size": lambda c: (-c.nbytes, c.age_s),
    "key": lambda c: (c.model_name, c.layout, c.chunk_hash, c.head_lo, c.tier),
}


def _chunk_info(row: PieceRow) -> m.ChunkInfo:
    """A memory piece as a listing row."""
    return m.ChunkInfo(chunk_hash=row.chunk_hash, model_name=row.model_name, layout=row.layout,
                       head_lo=row.head_lo, head_hi=row.head_hi, tier=MEMORY_TIER,
                       nbytes=row.nbytes, locks=row.locks, hits=row.hits, age_s=row.age_s,
                       pinned=row.pinned, expires_in_s=row.expires_in_s, priority=row.priority)


#: The same orders over the disk index's ``(key, nbytes, written)`` (no hits on disk: by age), so
#: that only the ``limit`` rows shown are made.
_DISK_ORDER: dict[str, Callable[[tuple[ChunkKey, int, float]], Any]] = {
    "age": lambda item: -item[2],
    "hits": lambda item: -item[2],
    "size": lambda item: (-item[1], -item[2]),
    "key": lambda item: (item[0].model_name, item[0].layout, item[0].chunk_hash, item[0].head_lo),
}


def _disk_rows(found: list[tuple[ChunkKey, int, float]], limit: int, sort: str) -> list[m.ChunkInfo]:
    """The first ``limit`` disk pieces in ``sort``'s order, as listing rows (no locks or hits: a
    piece on disk has neither until it is loaded)."""
    now = time.time()
    return [m.ChunkInfo(chunk_hash=key.chunk_hash, model_name=key.model_name, layout=key.layout,
                        head_lo=key.head_lo, head_hi=key.head_hi, tier="disk", nbytes=nbytes,
                        locks=0, hits=0, age_s=max(0.0, now - written))
            for key, nbytes, written in heapq.nsmallest(limit, found, key=_DISK_ORDER[sort])]
