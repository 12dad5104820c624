"""Request handlers of ``lmcache serve``: each op's payload in, its reply out, over the engine's
store (and its tiers, for lookups and peeks).

Handlers raise ``LMCacheError`` subclasses for anything the client got wrong; the transport's single
error boundary turns those into typed ``ErrorReply``s. Store and retrieve run on worker threads; the
byte copies run outside the store's lock, between its ``begin_*`` and ``finish_*``. What the server
tells about itself (SERVER_INFO, LIST_CHUNKS) is ``listing``'s.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from lmcache_core import __version__
from lmcache_core.config import LMCacheConfig
from lmcache_core.engine import CacheEngine, GroupTarget, Retention, RetrievePlan, StorePlan
from lmcache_core.engine.tiered import TierCounts
from lmcache_core.errors import CopiesStalledError, ProtocolError
from lmcache_core.keys import ChunkKey, is_mla
from lmcache_core.kv.copy import check_skip
from lmcache_core.kv.cuda_events import open_ipc_event
from lmcache_core.log_budget import LogBudget
from lmcache_core.protocol import messages as m
from lmcache_core.protocol.ops import RequestType
from lmcache_core.server.explain import ExplainHandler, StoreModes
from lmcache_core.server.layouts import LayoutResolver
from lmcache_core.server.pins import PinHandlers
from lmcache_core.server.registry import KVRegistry, Registration
from lmcache_core.storage.checksum_lanes import LANE_TIMEOUT_S, ChecksumLanes, PieceChecksums
from lmcache_core.transport.routes import AfterReply
from lmcache_core.transport.server import Route

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


logger = logging.getLogger(__name__)

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
    """The op handlers of one server: the data path (stores, retrieves, lookups, peeks) over the
    engine's store and tiers, registrations, pins and explain.

    Given at construction what they use: the config, the engine, the registry, the checksum
    lanes stores are hashed on (their maker's to close), when the server started, and the
    hooks: ``add_copy_threads`` (the transport's ``add_workers``: copy threads sized by the GPUs
    registered), ``copies_stalled`` (told why when a GPU did not finish a request's copies in
    time: the server stops), ``deadline_clock`` (what load deadlines are measured on)."""

    def __init__(self, config: LMCacheConfig, engine: CacheEngine, registry: KVRegistry,
                 lanes: ChecksumLanes, *, started: float,
                 add_copy_threads: Callable[[int], int] | None = None,
                 copies_stalled: Callable[[str], None] | None = None,
                 deadline_clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.engine = engine
        self._store = engine.store  # every store, retrieve, lock and pin goes to it directly
        self.registry = registry
        self.layouts = LayoutResolver(engine.store, registry)
        self.checksum_lanes = lanes  # stores' pieces hashed there, off their reply
        self.started = started
        self.add_copy_threads = add_copy_threads
        self.copies_stalled = copies_stalled
        self.deadline_clock = deadline_clock
        self.store_modes = StoreModes()  # stores per model by hash mode, for EXPLAIN
        # stores past their copy_by_ns come in floods (all queued behind one stall): a few lines
        self._late_stores_log = LogBudget(lines=5, window_s=60.0, logger=logger)

    def routes(self) -> dict[RequestType, Route]:
        tiered = self.engine.tiers is not None
        pins = PinHandlers(self._store, self.layouts)
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
            RequestType.LOOKUP: Route(self.lookup, blocking=tiered),
            RequestType.FREE_LOOKUP_LOCKS: Route(self.free_lookup_locks),
            RequestType.END_SESSION: Route(self.end_session),
            RequestType.CLEAR: Route(self.clear),
            RequestType.PEEK: Route(self.peek, blocking=tiered),
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
                                      head_hi=registration.heads[1], copy_by=True)

    def unregister_kv_cache(self, request: m.UnregisterKVCacheRequest,
                            _client: bytes) -> m.OkReply:
        self.registry.unregister(request.instance_id)
        return m.OkReply()

    # ------------------------------------------------------------------ data path

    def store(self, request: m.StoreRequest, _client: bytes) -> m.StoreReply | AfterReply:
        """Copy the request's chunks in and commit them. A store big enough to hash on a lane
        returns its reply with the hash to start once that reply is out (``AfterReply``). One
        taken up past its ``copy_by_ns`` copies nothing (its worker may have given up on it, and
        vLLM handed its blocks to another request): ``late``, counted, a warning logged."""
        if request.copy_by_ns and self.deadline_clock() * 1e9 >= request.copy_by_ns:
            late = len(request.chunk_hashes)
            self._store.count_late_store(late)
            self._late_stores_log.log(
                logging.WARNING, "a store of %d chunk(s) reached a copy thread past its "
                "copy_by_ns (the server stalled for half the worker's request timeout or more): "
                "not copied, its blocks may hold other KV by now", late)
            return m.StoreReply(stored=0, late=late)
        with self.registry.lease(request.instance_id) as reg:
            per_chunk = self._check_blocks(reg, request.chunk_hashes, request.block_ids)
            self.store_modes.count(reg.model_name, request.hash_mode)
            keys = self._keys(reg, request.chunk_hashes)
            plan = self._store.begin_store(keys, reg.mapped.chunk_bytes, Retention(
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
            self._store.finish_store(plan, ok)
            return None
        store = self._store
        store.finish_store(plan, checksums_pending=True)
        return sums.finish(lambda digests: store.record_checksums(plan, digests))

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
        plan = self._store.begin_retrieve(reg.model_name, reg.layout, reg.heads, hashes,
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
                self._store.finish_retrieve(plan, copied)
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
        if self.copies_stalled is not None:
            self.copies_stalled(f"GPU copies stalled: {exc}")

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
        """Hit chunks for ``world_size`` ranks in the request's layout (``layouts.resolve``: its
        own, else a hybrid model's registered groups, else the registered workers' layouts, else
        every one held for the model; the best of several).

        Each rank's lock on a chunk goes with ``readers`` retrieves of it by that rank (LMCache's
        ``num_kv_readers``); for MLA, whose one piece every rank reads, by each of the
        ``world_size`` ranks: the first rank's retrieve must not unlock what the others read.
        The sessions in ``ended`` are ended first (``end_session``, riding on this lookup).
        With nothing to count in (no layout whose heads divide by ``world_size``, a hybrid
        model's groups not all registered) it misses, and a locking one holds nothing."""
        store = self._store
        released = [store.free_lookup_locks(ended) for ended in request.ended]
        groups = self.layouts.resolve(request.model_name, request.world_size, request.layout,
                                      request.chunk_hashes)
        if not groups:
            if request.lock:  # a miss holds nothing, as any lookup's
                store.free_lookup_locks(request.lookup_id)
            return m.LookupReply(hit_chunks=0, released=released)
        shared = request.world_size if all(is_mla(g.layout) for g in groups) else 1
        hits = self.engine.lookup(request.model_name, groups, request.chunk_hashes,
                                  request.lookup_id, request.lock,
                                  tier_timeout_s=self.tier_budget_s, readers=readers,
                                  shared=shared)
        return m.LookupReply(hit_chunks=hits, released=released)

    def peek(self, request: m.PeekRequest, _client: bytes) -> m.PeekReply:
        """The leading chunks every tier holds together for the request's ranks, and where each
        is (``TieredStorage.peek``): a hybrid model's in its registered workers' groups (as its
        lookup counts them: ``groups`` names their layouts; none while those do not cover every
        group), else in the best of the candidate layouts (its own; else the registered
        workers', else the resident ones, and ``hint_layout`` beside them). Nothing is loaded,
        locked, touched or counted; Redis is asked once per layout, in the budget."""
        names = [name for name in ("disk", "remote") if getattr(self.config, name) is not None]
        model, hashes = request.model_name, request.chunk_hashes
        groups = (self.layouts.groups(model, request.world_size) if request.layout is None
                  else None)
        if groups is not None:  # a hybrid model's
            layouts = [group.layout for group in groups]
            if not groups:
                return m.PeekReply(layout="", hit_chunks=0, tiers=names, groups=layouts)
            counts = self._count(model, groups, hashes, self.tier_budget_s)
            return m.PeekReply(layout="", hit_chunks=counts.hits, memory_chunks=counts.memory,
                               disk_chunks=counts.disk, remote_chunks=counts.remote_chunks,
                               remote=counts.remote, tiers=names, groups=layouts)
        best: tuple[tuple[int, int, bool], m.PeekReply] | None = None
        deadline = time.monotonic() + self.tier_budget_s
        for target in self._peek_targets(request):
            counts = self._count(model, [target], hashes, max(0.0, deadline - time.monotonic()))
            reply = m.PeekReply(layout=target.layout, hit_chunks=counts.hits,
                                memory_chunks=counts.memory, disk_chunks=counts.disk,
                                remote_chunks=counts.remote_chunks, remote=counts.remote,
                                tiers=names)
            rank = (counts.hits, counts.memory, target.layout == request.hint_layout)
            if best is None or rank > best[0]:
                best = (rank, reply)
        return best[1] if best is not None else m.PeekReply(layout="", hit_chunks=0, tiers=names)

    def _count(self, model_name: str, groups: list[GroupTarget], chunk_hashes: Sequence[bytes],
               budget_s: float) -> TierCounts:
        """What a peek counts of ``groups``: in every tier (``TieredStorage.peek``), or in
        memory alone without tiers (``PieceStore.held``)."""
        tiers = self.engine.tiers
        if tiers is None:
            return TierCounts(memory=self._store.held(model_name, groups, chunk_hashes))
        return tiers.peek(model_name, groups, chunk_hashes, budget_s)

    def _peek_targets(self, request: m.PeekRequest) -> list[GroupTarget]:
        """The layouts a peek counts in, each with its ranks' head ranges (layouts whose heads do
        not divide among the world size are left out: they never hold a hit for it)."""
        model, world = request.model_name, request.world_size
        if request.layout is not None:
            return self.layouts.candidates(model, world, request.layout)
        targets = self.layouts.candidates(model, world, None)
        hint = request.hint_layout
        if hint is not None and all(target.layout != hint for target in targets):
            targets += self.layouts.candidates(model, world, hint)
        return targets

    @property
    def tier_budget_s(self) -> float:
        """How long a lookup may spend on disk and Redis: 80 % of the lookup timeout, so the
        reply still reaches a client that waits ``timeouts.lookup_ms``."""
        return self.config.timeouts.lookup_ms / 1000 * 0.8

    def free_lookup_locks(self, request: m.LookupIdRequest, _client: bytes) -> m.ReleasedReply:
        return m.ReleasedReply(released=self._store.free_lookup_locks(request.lookup_id))

    def end_session(self, request: m.LookupIdRequest, _client: bytes) -> m.ReleasedReply:
        """A request is over: release its remaining locks (unlike LMCache, which keeps them)."""
        return m.ReleasedReply(released=self._store.free_lookup_locks(request.lookup_id))

    # ------------------------------------------------------------------ admin

    def clear(self, request: m.ClearRequest, _client: bytes) -> m.ClearReply:
        removed, kept = self._store.clear(request.force)
        return m.ClearReply(removed=removed, kept_locked=kept)
