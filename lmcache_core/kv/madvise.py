"""``MADV_POPULATE_WRITE`` through ctypes, for the server's pool (``storage/pages.py``) and the
shared-memory KV caches it maps (``kv/shm.py``): a mapping's page tables filled ahead of use, so a
copy into pages this process has not touched yet takes no page faults.

Through ctypes because that releases the GIL for the call (``mmap.madvise`` does not: populating
gigabytes would stall every other thread of the server). The callers walk their mapping a step at
a time (each their own step size and stop rule) and call ``populate_step`` for each.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_LIBC: ctypes.CDLL | None = None


def madvise(address: int, length: int, advice: int) -> int:
    """libc's ``madvise`` (0 or -1, errno kept for ``ctypes.get_errno``), the GIL released."""
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _LIBC = libc
    return int(_LIBC.madvise(address, length, advice))


def populate_step(address: int, length: int, first: bool, what: str) -> bool:
    """``MADV_POPULATE_WRITE`` over ``[address, address + length)``. False when the kernel does
    not know the advice (Linux < 5.14: the ``first`` step fails with EINVAL); OSError naming
    ``what`` for any other failure (e.g. EFAULT: a shared file truncated under the mapping)."""
    if madvise(address, length, MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL and first:
        return False
    raise OSError(err, f"madvise(MADV_POPULATE_WRITE){what}: {os.strerror(err)}")
