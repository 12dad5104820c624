"""CPU hosts: vLLM's KV cache allocated in POSIX shared memory, so the server can map it.

Part of :mod:`.lmcache_connector` (its ``get_mem_pool_context``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lmcache_core.integration.vllm.connector_log import logger


class SharedKVAllocation(TorchFunctionMode):
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
            # vLLM's torch.zeros would have written (so mapped) every page now; without that,
            # each block's first use in this process takes page faults (a first forward over
            # loaded blocks: ~6000 faults per 24 MiB). Mapping them here costs what zeroing would.
            try:
                if segment.populate() is None:
                    logger.debug("no MADV_POPULATE_WRITE: the KV cache's pages map on first use")
            except OSError as exc:  # only slower: the pages map on first use instead
                logger.warning("lmcache: mapping the KV cache's pages ahead failed: %s", exc)
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
