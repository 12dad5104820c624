"""LMCache's import path of the vLLM multi-process adapters: the names of :mod:`lmcache_core.client`.

The seed document of LMCache's ``vllm_multi_process_adapter`` (``LMCacheMPSchedulerAdapter``,
``LMCacheMPWorkerAdapter``, ``LoadStoreOp``, ``wrap_kv_caches``, ...) is this API's contract: code
written for LMCache ports by changing ``lmcache`` to ``lmcache_core`` in the import. The clients
themselves are :mod:`lmcache_core.client` (which imports no vLLM); this module only re-exports them.
"""

from lmcache_core.client.connection import (
    DEFAULT_LOOKUP_TIMEOUT_S,
    get_lmcache_chunk_size,
    send_lmcache_request,
)
from lmcache_core.client.groups import KVCacheGroupSpec
from lmcache_core.client.scheduler import LOOKUP_POLL_INTERVAL_S, LMCacheMPSchedulerAdapter
from lmcache_core.client.transfers import LoadStoreOp
from lmcache_core.client.worker import KVCache, LMCacheMPWorkerAdapter, wrap_kv_caches
from lmcache_core.keys import striding_block_hashes
from lmcache_core.protocol.ops import RequestType
from lmcache_core.transport.client import MessageQueueClient
from lmcache_core.transport.future import MessagingFuture

__all__ = [
    "DEFAULT_LOOKUP_TIMEOUT_S",
    "LOOKUP_POLL_INTERVAL_S",
    "KVCache",
    "KVCacheGroupSpec",
    "LMCacheMPSchedulerAdapter",
    "LMCacheMPWorkerAdapter",
    "LoadStoreOp",
    "MessageQueueClient",
    "MessagingFuture",
    "RequestType",
    "get_lmcache_chunk_size",
    "send_lmcache_request",
    "striding_block_hashes",
    "wrap_kv_caches",
]
