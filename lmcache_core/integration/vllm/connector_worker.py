"""The worker-side half of ``LMCacheConnector``: KV cache registration, loads, stores, completions.

``register_kv_caches`` shares vLLM's KV caches with the server (in the canonical layout of
:mod:`.kv_views`; a hybrid model's groups each as its own registration); ``start_load_kv`` /
``wait_for_save`` submit the step's retrieves / stores with a CUDA IPC event (none on CPU) and never
wait; ``get_transfer_results`` and ``get_block_ids_with_load_errors`` report them to vLLM (a hybrid
model's failed loads per request, in ``failed_recving``: its block ids are per group).
:class:`.lmcache_connector.LMCacheConnector` joins this half and the scheduler-side one
(:mod:`.connector_scheduler`); its ``__init__`` sets the state both use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
)

from lmcache_core.client.groups import KVCacheGroupSpec
from lmcache_core.client.transfers import LoadStoreOp
from lmcache_core.client.worker import LMCacheMPWorkerAdapter
from lmcache_core.config import LMCacheConfig
from lmcache_core.errors import IncompatibleError, LMCacheError
from lmcache_core.integration.vllm.connector_config import (
    KVGroupInfo,
    backend_name,
    refuse_unexportable,
)
from lmcache_core.integration.vllm.connector_log import logger
from lmcache_core.integration.vllm.connector_metadata import (
    LMCacheConnectorMetadata,
    TransferSpec,
    per_block_hashes,
)
from lmcache_core.integration.vllm.connector_shm import SharedKVAllocation
from lmcache_core.integration.vllm.kv_views import KVViews, canonical_kv_views, expand_block_ids
from lmcache_core.kv.cuda_events import InflightEvents

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext


#: The longest a step that computes nothing waits for a load in flight to land (less when the load
#: deadline is shorter). Waiting, vLLM does not spin through empty steps (on a 2-core host that
#: spin took a core from the server's copy) and schedules the loaded request in the next step.
#: Bounded well below the deadline: a request that arrives meanwhile is scheduled after the wait,
#: and a slow load costs one empty step per wait, not a spin.
IDLE_WAIT_S = 0.02
#: What a synchronous load's wait allows beyond its load deadline for the reply to come back (the
#: server answers once the run of chunks in progress at the deadline is done: a few ms).
SYNC_REPLY_S = 1.0


class ConnectorWorkerSide(KVConnectorBase_V1):
    """``LMCacheConnector``'s methods that vLLM calls in each worker process."""

    _config: LMCacheConfig
    _url: str
    _context: zmq.Context[Any]
    _model_name: str
    _world_size: int
    _kv_rank: int
    _block_size: int
    _use_mla: bool
    _device_type: str
    _worker: LMCacheMPWorkerAdapter | None
    _worker_kwargs: dict[str, Any]
    _chunk_size: int
    _bpc: int  # vLLM blocks per chunk
    _views: KVViews | None
    _group_views: list[KVViews]  # a hybrid model's views, one per KV cache group
    _groups: list[KVGroupInfo]
    _failed_loads: set[str]  # hybrid: requests whose load failed, not yet reported
    _window_stores: list[str]  # requests whose stores read window or Mamba state blocks this step
    _mem_pool: SharedKVAllocation | None
    _kv_device: torch.device | None
    _events: InflightEvents
    _local_load_errors: set[int]
    _stores_failed_to_submit: set[str]
    _loads_failed_to_submit: set[str]
    _engine_finished: set[str]

    def get_mem_pool_context(self) -> Any:
        """On CPU: allocate vLLM's KV backing buffer in shared memory so the server can map it."""
        if self._device_type != "cpu" or self._kv_cache_config is None:
            return None
        sizes = {int(t.size) for t in self._kv_cache_config.kv_cache_tensors}
        if not sizes:
            return None
        self._mem_pool = SharedKVAllocation(sizes)
        return self._mem_pool

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        refuse_unexportable(self._vllm_config, kv_caches)

        backend = backend_name(self._vllm_config, get_layers_from_vllm_config, Attention)
        if len(self._groups) == 1:
            self._views = self._canonical_views(kv_caches, backend, 0)
            self._group_views = [self._views]
        else:
            # One registration per group: layers of different groups may share one tensor (vLLM
            # overlays the groups; a block id belongs to one group at a time).
            self._group_views = [self._group_layer_views(kv_caches, backend, g)
                                 for g in self._groups]
            self._views = next(v for g, v in zip(self._groups, self._group_views, strict=True)
                               if g.kind != "mamba")
        first = next(iter(kv_caches.values()))
        self._kv_device = first.device
        logger.info("lmcache: %d KV layers in %d group(s), %s: %s -> %s layout, %s-token blocks",
                    len(kv_caches), len(self._groups), backend,
                    f"shape {list(first.shape)} stride {list(first.stride())}",
                    self._views.layout, "/".join(str(v.block_size) for v in self._group_views))
        self._register()
        self._log_keys()

    def _log_keys(self) -> None:
        """Say once (rank 0; the others at debug) everything this engine's chunk keys depend on:
        engines, or an engine and ``lmcache lookup``, that differ in any of it never share a
        chunk, and a hit rate of 0 is the only sign ("why are my hits 0?")."""
        worker = self._worker
        assert worker is not None
        layouts = ", ".join(f"{group.kind} {layout}" for group, layout
                            in zip(self._groups, worker.layouts, strict=True))
        logger.log(logging.INFO if self._kv_rank == 0 else logging.DEBUG,
                   "lmcache: chunk keys of this engine: model %r, world size %d, chunk size %d "
                   "tokens, hash mode tokens (blake3 prefix chain of token ids from LMCache's "
                   "seed; a request's cache_salt or LoRA adapter salts it: another tenant), "
                   "layout %s; server %s. Check a prompt: lmcache lookup --explain -t TOKENS.json "
                   "-m %s -w %d --url %s", self._model_name, self._world_size, self._chunk_size,
                   layouts, self._url, self._model_name, self._world_size, self._url)

    def _group_layer_views(self, kv_caches: dict[str, torch.Tensor], backend: str | None,
                           group: KVGroupInfo) -> KVViews:
        """One group's layers: attention as canonical views; a Mamba group's state tensors as
        vLLM gives them (one per layer, a state block per row: the worker client takes them so)."""
        layers = {name: kv_caches[name] for name in group.layer_names}
        if group.kind != "mamba":
            return self._canonical_views(layers, backend, group.index)
        return KVViews("mla", layers, group.block_size, 1,
                       "Mamba state, one tensor per layer (a state block per row)")

    def _canonical_views(self, kv_caches: dict[str, torch.Tensor], backend: str | None,
                         group: int) -> KVViews:
        """``kv_caches`` (one group's layers) as views in a layout the kv layer knows."""
        model = self._vllm_config.model_config
        parallel = self._vllm_config.parallel_config
        spec = None
        if self._kv_cache_config is not None and self._kv_cache_config.kv_cache_groups:
            spec = self._kv_cache_config.kv_cache_groups[group].kv_cache_spec
        heads = int(getattr(spec, "num_kv_heads", 0) or model.get_num_kv_heads(parallel))
        head_size = int(getattr(spec, "head_size", 0) or model.get_head_size())
        return canonical_kv_views(
            kv_caches, backend=backend, num_kv_heads=heads, head_size=head_size,
            vllm_block_size=self._groups[group].block_size, use_mla=self._use_mla,
            head_size_v=getattr(spec, "head_size_v", None))

    def _group_specs(self) -> list[KVCacheGroupSpec] | None:
        """The worker client's description of a hybrid model's groups (None for one group)."""
        if len(self._groups) == 1:
            return None
        return [KVCacheGroupSpec(layer_names=list(views.views), kind=g.kind,
                                 block_size=views.block_size, window_tokens=g.window_tokens)
                for g, views in zip(self._groups, self._group_views, strict=True)]

    def _register(self) -> None:
        assert self._views is not None
        self._worker = LMCacheMPWorkerAdapter(
            self._url, self._context, self._model_name, self._world_size, self._kv_rank,
            self._views.block_size, **self._worker_kwargs)
        self._chunk_size = self._worker.chunk_size
        self._bpc = self._worker.num_blocks_per_chunk()
        try:
            # On CPU the shared-memory name stays linked while this process lives, so the worker client
            # can register it again with a restarted server; it is unlinked at exit, or by the
            # server if this process is killed.
            views = {name: t for v in self._group_views for name, t in v.views.items()}
            self._worker.register_kv_caches(views, groups=self._group_specs())
        except BaseException as exc:
            self._worker.shutdown()
            self._worker = None
            if isinstance(exc, IncompatibleError) and self._device_type == "cpu" and (
                    self._mem_pool is None or self._mem_pool.tensor is None):
                raise IncompatibleError(
                    f"{exc}. (vLLM did not allocate its KV cache through the connector's "
                    "get_mem_pool_context as torch.zeros(nbytes, dtype=torch.int8), so it is not "
                    "in shared memory; this vLLM version is not supported on CPU.)") from exc
            raise

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33 sleep mode: drop the registration (the server unmaps) before the KV
        memory is released; transfers are drained by then. Idempotent."""
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    def restore_kv_caches(self) -> None:
        """After wake-up: register the same views again (new CUDA IPC handles on GPU; on CPU the
        same shared-memory names, which stay linked while this process lives). Idempotent."""
        if self._worker is None and self._views is not None:
            self._register()

    def _event(self) -> Any:
        """An interprocess event recorded after the work queued so far on the KV device's current
        stream: for a store, the step's KV writes; for a retrieve, the last use of the blocks it
        overwrites. None on CPU.

        vLLM's GPU model runner runs the forward pass (eager or CUDA graphs) on the current stream
        of the worker's device, and calls the connector on that thread, so that stream orders
        after its writes; ``record()`` with no stream would use the current device's stream, which
        need not be the KV cache's device. A fresh event per call (or a reused one whose requests
        were all answered): re-recording an event that a queued request still waits on would make
        that request wait for later work instead.
        """
        device = self._kv_device
        if self._device_type != "cuda" or device is None or device.type != "cuda":
            return None
        event = self._events.acquire(lambda: torch.cuda.Event(interprocess=True))
        event.record(torch.cuda.current_stream(device))
        return event

    def _hold_event(self, event: Any, request_ids: list[str], retrieve: bool) -> None:
        """Keep ``event`` until every transfer of ``request_ids`` has been answered."""
        worker = self._worker
        if event is None or worker is None:
            return
        futures_of = worker.retrieve_futures if retrieve else worker.store_futures
        self._events.hold(event, [f for rid in request_ids for f in futures_of(rid)])

    def _ops(self, specs: Iterable[TransferSpec]) -> list[LoadStoreOp]:
        assert self._views is not None
        ratio = self._views.blocks_per_vllm_block
        return [LoadStoreOp(per_block_hashes(spec.chunk_hashes, self._bpc),
                            expand_block_ids(spec.block_ids, ratio), ttl_s=spec.ttl_s,
                            pin=spec.pin, priority=spec.priority, cache_salt=spec.cache_salt,
                            group_block_ids=self._kernel_group_ids(spec.group_block_ids),
                            first_chunk=spec.first_chunk, token_chain=True)
                for spec in specs]

    def _kernel_group_ids(self, group_ids: list[list[int]] | None) -> list[list[int]] | None:
        if group_ids is None:
            return None
        return [expand_block_ids(ids, views.blocks_per_vllm_block)
                for ids, views in zip(group_ids, self._group_views, strict=True)]

    def _submit(self, ids: list[str], specs: list[TransferSpec], retrieve: bool) -> None:
        """Submit this step's retrieves (or stores) ``specs`` in one batch, with an event recorded
        after the step's work. Raises what submitting raised; the event is held for whatever
        went out before a failure."""
        event = None
        try:
            if self._worker is None:
                raise LMCacheError("the KV caches are not registered")
            ops = self._ops(specs)
            event = self._event()
            submit = (self._worker.batched_submit_retrieve_requests if retrieve
                      else self._worker.batched_submit_store_requests)
            submit(ids, ops, event)
        finally:
            self._hold_event(event, ids, retrieve)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheConnectorMetadata)
        if not meta.loads:
            return
        for spec in meta.loads:
            self._local_load_errors.update(spec.invalid_block_ids)
        failing = [spec for spec in meta.loads if spec.fail]  # hybrid loads vLLM trimmed
        self._fail_loads(failing)
        loads = [spec for spec in meta.loads if not spec.fail]
        ids = [spec.request_id for spec in loads]
        if not loads:
            return
        try:
            self._submit(ids, loads, retrieve=True)
        except Exception as exc:  # the blocks stay unfilled: vLLM recomputes them
            logger.warning("lmcache: submitting loads for %s failed, recomputing: %s", ids, exc)
            self._fail_loads(loads)
            return
        self._finish_sync_loads([spec for spec in loads if spec.sync])

    def _finish_sync_loads(self, specs: list[TransferSpec]) -> None:
        """Wait for the loads this step's forward pass reads (vLLM was told they are
        synchronous), within the load deadline and the time its reply takes: they are settled
        here, never reported as received; a chunk that did not land is reported by its blocks
        (``get_block_ids_with_load_errors``), so vLLM recomputes them and drops the token
        sampled over them. A load with no answer in that time is reported unloaded whole."""
        if not specs or self._worker is None:
            return
        deadline_ms = self._worker.load_deadline_ms
        if deadline_ms is None:
            deadline_ms = self._config.timeouts.load_ms
        timeout_s = (deadline_ms / 1000 + SYNC_REPLY_S if deadline_ms
                     else self._config.timeouts.request_s)
        late = self._worker.settle_retrieves([spec.request_id for spec in specs], timeout_s)
        for spec in specs:
            if spec.request_id in late:
                logger.warning("lmcache: load of %s not answered within %.1f s: recomputing",
                               spec.request_id, timeout_s)
                self._local_load_errors.update(spec.block_ids)

    def _fail_loads(self, specs: list[TransferSpec]) -> None:
        """Loads that were not sent: failed (vLLM recomputes them), by their blocks for one group,
        by request for a hybrid model; an asynchronous one also reported finished."""
        for spec in specs:
            self._local_load_errors.update(spec.block_ids)
            if not spec.sync:
                self._loads_failed_to_submit.add(spec.request_id)
            if spec.group_block_ids is not None:
                self._failed_loads.add(spec.request_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are per request (the request waits in WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole chunks of all layers are stored after the step, in wait_for_save

    def wait_for_save(self) -> None:
        """Submit this step's stores and return at once (the server copies while vLLM runs on;
        the blocks are kept until ``get_finished`` reports the stores)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheConnectorMetadata)
        if not meta.stores:
            return
        ids = [spec.request_id for spec in meta.stores]
        try:
            self._submit(ids, meta.stores, retrieve=False)
        except Exception as exc:
            logger.warning("lmcache: submitting stores for %s failed: %s", ids, exc)
            self._stores_failed_to_submit.update(ids)
            return
        if meta.window_stores:
            self._window_stores = ids

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Called before each step's forward pass: first wait for the last step's stores that
        read sliding-window (or chunked-local) blocks. vLLM frees the blocks behind a window (or
        before the attention chunk being computed) when it schedules the next step, and may hand
        them to another request that this step's forward writes; a store still copying them
        would read that request's KV."""
        self._wait_for_window_stores()
        super().bind_connector_metadata(connector_metadata)

    def _wait_for_window_stores(self) -> None:
        pending, self._window_stores = self._window_stores, []
        self._wait_for_stores(pending, "window store")

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM frees a preempted request's blocks without asking: finish its stores first."""
        self._wait_for_stores(getattr(kv_connector_metadata, "preempted", None) or (),
                              "store of preempted")

    def _wait_for_stores(self, request_ids: Iterable[str], what: str) -> None:
        """Wait, within one request timeout for all, for the stores sent for ``request_ids``; a
        store that failed or timed out is logged (its chunk was not made visible)."""
        if self._worker is None:
            return
        deadline = time.monotonic() + self._config.timeouts.request_s
        for request_id in request_ids:
            for future in self._worker.store_futures(request_id):
                try:
                    future.result(max(0.0, deadline - time.monotonic()))
                except Exception as exc:
                    logger.warning("lmcache: %s %s: %s", what, request_id, exc)

    def _wait_if_idle(self) -> None:
        """In a step that computes nothing, wait (at most ``IDLE_WAIT_S``, or the load deadline if
        shorter) until some request's load has been answered, unless there is a load failure to
        report already."""
        meta = self._connector_metadata
        if (self._worker is None or not isinstance(meta, LMCacheConnectorMetadata)
                or not meta.idle or self._loads_failed_to_submit):
            return
        deadline_ms = self._worker.load_deadline_ms
        if deadline_ms is None:
            deadline_ms = self._config.timeouts.load_ms
        wait_s = min(IDLE_WAIT_S, deadline_ms / 1000) if deadline_ms else IDLE_WAIT_S
        self._worker.wait_for_retrieves(wait_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        stores: set[str] = set()
        loads: set[str] = set()
        self._wait_if_idle()
        self._events.release_answered()
        if self._worker is not None:
            s, r = self._worker.get_finished(set(finished_req_ids))
            stores |= s or set()
            loads |= r or set()
        self._engine_finished |= set(finished_req_ids) & self._stores_failed_to_submit
        done = {r for r in self._engine_finished
                if self._worker is None or not self._worker.store_futures(r)}
        self._engine_finished -= done
        self._stores_failed_to_submit -= done
        stores |= done
        loads |= self._loads_failed_to_submit
        self._loads_failed_to_submit.clear()
        return (stores or None), (loads or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s sets, and a hybrid model's failed loads in ``failed_recving`` (also
        in ``finished_recving``, as vLLM requires): vLLM recomputes those requests from the
        start. A single-group model reports failed blocks instead (vLLM keeps the rest)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed: set[str] = set()
        if len(self._groups) > 1:
            failed, self._failed_loads = self._failed_loads, set()
            if self._worker is not None:
                failed |= self._worker.take_failed_retrieves()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()) | failed,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = set(self._local_load_errors)
        self._local_load_errors.clear()
        if self._worker is not None:
            ratio = self._views.blocks_per_vllm_block if self._views is not None else 1
            errors |= {b // ratio for b in self._worker.get_block_ids_with_load_errors()}
        return errors

