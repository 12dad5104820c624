"""Pinned host memory of exactly the size asked: an anonymous mapping registered with CUDA.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's CachingHostAllocator, which rounds
each request up to the next power of two (a 65-127 GiB pool pins 128 GiB, all of it resident) and
holds its allocator lock while ``cudaHostAlloc`` runs. Here the pool is one private anonymous
``mmap`` of the exact size, pinned with ``cudaHostRegister`` (which also maps its pages), and
unregistered when the last view of it is gone. Failures raise: the caller decides how loud.
"""

from __future__ import annotations

import logging
import mmap
import weakref
from typing import Any

import torch

logger = logging.getLogger(__name__)
_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault: portable=no, mapped=no


def pin_exact(shape: tuple[int, int]) -> torch.Tensor:
    """A ``uint8`` tensor of ``shape`` in page-locked host memory of exactly its size.

    RuntimeError when CUDA is missing or refuses to pin (e.g. RLIMIT_MEMLOCK, no memory)."""
    nbytes = shape[0] * shape[1]
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available")
    torch.cuda.init()  # torch's CUDA state first: the runtime call below would make a context
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    address = tensor.data_ptr()
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_DEFAULT)
    if int(error) != 0:
        del tensor
        mapping.close()
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {_error_name(error)}")
    # The mapping lives as long as any view of the tensor (frombuffer holds it): unpin with it.
    weakref.finalize(mapping, _unregister, cudart, address)
    return tensor.view(shape)


def _unregister(cudart: Any, address: int) -> None:
    try:
        cudart.cudaHostUnregister(address)
    except Exception:  # at interpreter exit CUDA may be gone already; the process frees it all
        logger.debug("cudaHostUnregister failed", exc_info=True)


def _error_name(error: Any) -> str:
    name = getattr(error, "name", None)
    return f"{name} ({int(error)})" if name else str(int(error))
