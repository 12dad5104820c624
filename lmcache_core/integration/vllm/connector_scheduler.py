"""The scheduler-side half of ``LMCacheConnector``: lookups, and the loads and stores of each step.

``get_num_new_matched_tokens`` looks a request's complete chunks up once (waiting for the answer
only within the step's small ``lookup_wait_us`` budget);
``update_state_after_alloc`` settles what to load; ``build_connector_meta`` sends the step's loads
and the stores of every chunk it completes; ``request_finished_all_groups`` ends the request's
session on the server. Block ids are kept per KV cache group (one list per group, as vLLM's hybrid
KV cache manager gives them); a single-group model is the case of one group.
:class:`.lmcache_connector.LMCacheConnector` joins this half and the worker-side one
(:mod:`.connector_worker`); its ``__init__`` sets the state both use.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

from lmcache_core.client.scheduler import LMCacheMPSchedulerAdapter
from lmcache_core.integration.vllm.connector_config import KVGroupInfo
from lmcache_core.integration.vllm.connector_hints import request_hints
from lmcache_core.integration.vllm.connector_log import logger
from lmcache_core.integration.vllm.connector_metadata import (
    LMCacheConnectorMetadata,
    TransferSpec,
    per_block_hashes,
)
from lmcache_core.integration.vllm.connector_requests import (
    RequestTracker,
    request_prefix,
    uncacheable_reason,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request



#: ``kv_connector_extra_config`` ``sync_loads``: when a hit is loaded in the step that schedules
#: its request (``ConnectorSchedulerSide._load_in_the_step``).
SYNC_LOADS = ("auto", "always", "never")


class ConnectorSchedulerSide(KVConnectorBase_V1, SupportsHMA):
    """``LMCacheConnector``'s methods that vLLM calls in its scheduler process."""

    _scheduler: LMCacheMPSchedulerAdapter | None
    _chunk_size: int
    _bpc: int  # vLLM blocks per chunk
    _block_size: int
    _groups: list[KVGroupInfo]
    _group_bpc: list[int]  # each group's vLLM blocks per chunk
    _trackers: dict[str, RequestTracker]
    _with_stores: set[str]
    _orphan_loads: list[str]
    _uncacheable_logged: set[str]
    _lookup_wait_s: float  # timeouts.lookup_wait_us: what a step may wait for its lookups
    _lookup_wait_left_s: float  # what is left of it in this step
    _sync_loads: str  # SYNC_LOADS: when a hit is loaded in the step that schedules it
    _engine_busy: bool  # the last step computed tokens
    _wait_clock = staticmethod(time.perf_counter)  # what the budget is measured on (tests: fake)

    def _tracker(self, request: Request) -> RequestTracker:
        from vllm.v1.request import RequestStatus

        request_id = request.request_id
        tracker = self._trackers.get(request_id)
        if tracker is not None and request.status == RequestStatus.PREEMPTED and tracker.ran:
            # Resuming after a preemption: its blocks were freed; look up afresh (the server
            # replaces this lookup id's locks). A request that never ran since its load is
            # not resumed but retried after a failed load: it keeps its tracker (no reload).
            assert self._scheduler is not None
            self._scheduler.cleanup_lookup_result(request_id)
            tracker = None
        if tracker is None:
            reason = uncacheable_reason(request)
            if reason and request_id not in self._uncacheable_logged:
                self._uncacheable_logged.add(request_id)
                logger.debug("lmcache: request %s has %s; not cached", request_id, reason)
            tracker = RequestTracker(request, request_prefix(request), not reason,
                               hints=request_hints(request))
            self._trackers[request_id] = tracker
        return tracker

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        tracker = self._tracker(request)
        if not tracker.cacheable:
            return 0, False
        if tracker.state != "lookup":
            # Asked again after its load: the load failed and vLLM reset the request to
            # recompute. Do not load again (a persistent failure would loop forever); store its
            # chunks again, as the server may have lost some (already-present ones cost nothing).
            tracker.stored_chunks = 0
            return 0, False
        size = self._chunk_size
        n_chunks = len(request.all_token_ids) // size
        if n_chunks == 0:
            return 0, False
        if num_computed_tokens >= n_chunks * size and not tracker.looked_up:
            # vLLM's own prefix cache holds every whole chunk: nothing could be loaded, so no
            # lookup (its round trip, or a step, would only delay this hit), and no store of
            # what vLLM's cache holds (it was computed or loaded here, and stored or found then).
            tracker.stored_chunks = n_chunks
            return 0, False
        hit_tokens = self._look_up(tracker, n_chunks, num_computed_tokens)
        if hit_tokens is None:
            return None, False  # still waiting for the server: vLLM asks again next step
        tracker.hit_chunks = min(hit_tokens // size, n_chunks)
        tracker.stored_chunks = max(tracker.stored_chunks, tracker.hit_chunks)
        hit = tracker.hit_chunks * size
        if hit <= num_computed_tokens or num_computed_tokens % size:
            # Nothing past vLLM's own hit, or that hit ends inside a chunk: loading the chunk
            # would write blocks vLLM's prefix cache shares. vLLM computes the rest.
            tracker.load = None
            return 0, False
        tracker.load = (num_computed_tokens // size, tracker.hit_chunks)
        tracker.load_sync = not tracker.async_promised and self._load_in_the_step()
        # vLLM computes at least one token in the step that admits a request (its scheduler
        # asserts so): it trims an asynchronous hit of every token itself, a synchronous one is
        # ours to trim.
        tracker.load_holds_last_token = tracker.load_sync and hit == len(request.all_token_ids)
        return hit - num_computed_tokens - tracker.load_holds_last_token, not tracker.load_sync

    def _load_in_the_step(self) -> bool:
        """Whether a hit is loaded in the step that schedules the request, before that step's
        forward pass (vLLM told the load is synchronous), rather than asynchronously.

        ``sync_loads`` "auto" (the default): synchronously while the engine is busy (the last
        step computed tokens, so this one will too). An asynchronous load starts after the
        forward pass of the step that admits the request and is reported after the next one's,
        so the request waits two whole steps: under load, steps that prefill other requests'
        prompts, hundreds of ms against the few ms of the copy. An idle engine's steps are
        empty and short, and waits for the load in the one after it (``IDLE_WAIT_S``): there
        the load stays asynchronous, which measured a little faster alone (the step's OpenMP
        team, woken, spins beside a synchronous wait and takes the cores from the server's
        copy). A hybrid model never loads synchronously: vLLM takes a failed load of several
        KV cache groups only per request, from an asynchronous one."""
        if self._sync_loads == "auto":
            return self._engine_busy
        return self._sync_loads == "always"

    def _look_up(self, tracker: RequestTracker, n_chunks: int, num_computed_tokens: int) -> int | None:
        """The request's hit in tokens (None while the answer is out): its lookup is sent once,
        and the call that sends it waits for the answer within what is left of the step's
        budget."""
        assert self._scheduler is not None
        request_id = tracker.request.request_id
        hashes = tracker.ensure_hashes(n_chunks, self._chunk_size)[:n_chunks]
        self._scheduler.maybe_submit_lookup_request(request_id,
                                                    per_block_hashes(hashes, self._bpc))
        sent_now, tracker.looked_up = not tracker.looked_up, True
        hit_tokens = self._scheduler.check_lookup_result(request_id, num_computed_tokens)
        if hit_tokens is None and sent_now and self._wait_for_lookup(request_id):
            hit_tokens = self._scheduler.check_lookup_result(request_id, num_computed_tokens)
        return hit_tokens

    def may_load_async(self, request: Request) -> bool:
        """vLLM >= 0.34, with ``--max-num-inflight-kv-loads``: whether this request will load
        from the server (every load of ours is asynchronous), so that vLLM may start its load
        while the running batch is full. vLLM asks as the request enters its waiting queues;
        the lookup the request would send when scheduled goes now, and its answer is waited for
        within the step's lookup budget. An answer still out says no: the request is then
        scheduled as usual and loads when admitted, where a false yes would hold other
        requests' loads back until a running slot frees. vLLM's own prefix-cache hit is not
        known here, so a prefix vLLM holds too may say yes."""
        if self._scheduler is None:
            return False
        tracker = self._tracker(request)
        n_chunks = len(request.all_token_ids) // self._chunk_size
        if not tracker.cacheable or tracker.state != "lookup" or n_chunks == 0:
            return False
        # a yes holds: vLLM takes this request's load only if it is asynchronous
        tracker.async_promised = bool(self._look_up(tracker, n_chunks, 0))
        return tracker.async_promised

    def _wait_for_lookup(self, request_id: str) -> bool:
        """Wait for the lookup just sent, within what is left of this step's budget: answered
        now, the request's load starts this step, not the next (a step of a busy engine is tens
        of ms; a local server answers in well under one). True if it was answered."""
        assert self._scheduler is not None
        if self._lookup_wait_left_s <= 0:
            return False
        start = self._wait_clock()
        answered = self._scheduler.wait_lookup_result(request_id, self._lookup_wait_left_s)
        self._lookup_wait_left_s -= self._wait_clock() - start
        return answered

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        tracker = self._tracker(request)
        # All of the request's blocks, per group, each time (a second call, after an async load,
        # has the first call's blocks and the new tail): replaced, never appended.
        tracker.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if tracker.state != "lookup":
            return  # second call, after the load: only the block lists grew
        if num_external_tokens > 0 and tracker.load is not None:
            size = self._chunk_size
            start = tracker.load[0]
            if (tracker.load_holds_last_token
                    and start * size + num_external_tokens + 1 == tracker.load[1] * size):
                num_external_tokens += 1  # the whole load, as told (less its last token)
            end = min(tracker.load[1], start + num_external_tokens // size)
            tracker.load = (start, end)
            # vLLM counts [start, start + num_external) as loaded; a tail that is not a whole
            # chunk cannot be loaded: report its blocks as load errors so vLLM recomputes them;
            # a hybrid model cannot (block ids are per group): the request is reported failed.
            first_bad = end * size // self._block_size
            last = -(-(start * size + num_external_tokens) // self._block_size)
            if len(self._groups) == 1:
                tracker.load_invalid = tracker.block_ids[0][first_bad:last]
            else:
                tracker.load_fails = first_bad < last
            tracker.state = "load"
        else:
            tracker.state = "ready"
            tracker.load = None
            if tracker.hit_chunks:
                self._scheduler.free_lookup_locks(request.request_id)
        self._scheduler.cleanup_lookup_result(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._lookup_wait_left_s = self._lookup_wait_s  # the step's lookups are all sent
        meta = LMCacheConnectorMetadata()
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        # vLLM's total_num_scheduled_tokens == 0, from the dict every vLLM version has
        meta.idle = not any(scheduler_output.num_scheduled_tokens.values())
        self._engine_busy = not meta.idle
        for tracker in self._trackers.values():
            if tracker.state != "load" or tracker.load is None:
                continue
            start, end = tracker.load
            meta.loads.append(self._spec(tracker, start, end, invalid_block_ids=tracker.load_invalid,
                                         fail=tracker.load_fails, sync=tracker.load_sync))
            tracker.state = "ready"
        for request_id in self._orphan_loads:  # finished before its load went out: release it
            meta.loads.append(TransferSpec(request_id, [], []))
        self._orphan_loads.clear()

        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            found = self._trackers.get(new.req_id)
            if found is None or not found.cacheable:
                continue
            tracker = found
            tracker.ran = True
            tracker.block_ids = [list(ids) for ids in new.block_ids or ()]
            self._maybe_store(tracker, new.num_computed_tokens + num_scheduled.get(new.req_id, 0),
                              meta)
        cached = scheduler_output.scheduled_cached_reqs
        # vLLM <= 0.33 re-sends a request resumed after a preemption here, its blocks given anew
        # (``resumed_req_ids``); 0.34 re-sends it in full in ``scheduled_new_reqs`` (above), and
        # the blocks given here are always appended.
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for i, request_id in enumerate(cached.req_ids):
            found = self._trackers.get(request_id)
            if found is None or not found.cacheable:
                continue
            tracker = found
            tracker.ran = True
            new_ids = cached.new_block_ids[i]
            if new_ids:
                if request_id in resumed or not tracker.block_ids:
                    tracker.block_ids = [list(ids) for ids in new_ids]
                else:
                    for group_ids, added in zip(tracker.block_ids, new_ids, strict=True):
                        group_ids.extend(added)
            self._maybe_store(
                tracker, cached.num_computed_tokens[i] + num_scheduled.get(request_id, 0), meta)
        return meta

    def _maybe_store(self, tracker: RequestTracker, computed: int, meta: LMCacheConnectorMetadata) -> None:
        """Store the chunks this step completes (tokens whose KV is in the blocks after it),
        with the request's retention hints; none for a request with ``lmcache.skip_store``."""
        hints = tracker.hints
        if hints.skip_store:
            return
        size = self._chunk_size
        complete = min(computed, len(tracker.request.all_token_ids)) // size
        for group_ids, bpc in zip(tracker.block_ids, self._group_bpc, strict=True):
            complete = min(complete, len(group_ids) // bpc)
        start = tracker.stored_chunks
        if complete <= start:
            return
        tracker.ensure_hashes(complete, size)
        spec = self._spec(tracker, start, complete, ttl_s=hints.ttl_s, pin=hints.pin,
                          priority=hints.priority,
                          cache_salt=getattr(tracker.request, "cache_salt", None))
        self._prompt_states_only(tracker, start, spec)
        meta.stores.append(spec)
        # Stored in the step that computes them: a sliding window's blocks (and a Mamba group's
        # state blocks, and a chunked-local group's behind its attention chunk) may be freed
        # from the next step on (the worker client skips a group's chunk whose blocks are already
        # null).
        meta.window_stores |= any(g.kind != "full" for g in self._groups)
        tracker.stored_chunks = complete
        self._with_stores.add(tracker.request.request_id)

    def _prompt_states_only(self, tracker: RequestTracker, start: int, spec: TransferSpec) -> None:
        """A Mamba group stores the state of chunks that end within the prompt only (their ids
        past it nulled, so the worker client skips them): the end-of-chunk state of a prefill step in
        vLLM's align mode is tested with a real engine, a decode step's is not."""
        if spec.group_block_ids is None:
            return
        in_prompt = max(0, int(tracker.request.num_prompt_tokens) // self._chunk_size - start)
        for group, ids, bpc in zip(self._groups, spec.group_block_ids, self._group_bpc,
                                   strict=True):
            if group.kind == "mamba":
                ids[in_prompt * bpc:] = [0] * max(0, len(ids) - in_prompt * bpc)

    def _spec(self, tracker: RequestTracker, start: int, end: int, **fields: Any) -> TransferSpec:
        """Chunks [start, end) of the request: their hashes and each group's blocks of them."""
        hashes = tracker.hashes[start:end]
        request_id = tracker.request.request_id
        if len(self._groups) == 1:
            bpc = self._group_bpc[0]
            return TransferSpec(request_id, hashes, tracker.block_ids[0][start * bpc:end * bpc],
                                first_chunk=start, **fields)
        per_group = [ids[start * bpc:end * bpc]
                     for ids, bpc in zip(tracker.block_ids, self._group_bpc, strict=True)]
        return TransferSpec(request_id, hashes, [], group_block_ids=per_group, first_chunk=start,
                            **fields)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call for connectors with ``SupportsHMA`` (every model, one group or many; vLLM
        then never calls ``request_finished``)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks (of every group) while stores sent for this request may still read
        them."""
        request_id = request.request_id
        tracker = self._trackers.pop(request_id, None)
        if tracker is not None and tracker.state == "load":
            self._orphan_loads.append(request_id)
        if tracker is not None and tracker.looked_up and self._scheduler is not None:
            self._scheduler.end_session(request_id)
        delay = request_id in self._with_stores
        self._with_stores.discard(request_id)
        self._uncacheable_logged.discard(request_id)
        return delay, None
