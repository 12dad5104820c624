"""The pool's pages: the buffer's allocation (pinned or an anonymous mapping) and kernel advice.

An unpinned pool is one private anonymous ``mmap`` (so a large pool starts at once); its pages
fault in on first write unless populated ahead of use with ``MADV_POPULATE_WRITE`` (Linux >= 5.14),
issued here a step at a time (``kv/madvise.py``: through ctypes, the GIL released). After the
populate the mapping may be advised ``MADV_HUGEPAGE``. ``storage/pool.py`` decides when; this module
only does it.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from lmcache_core.errors import ConfigError
from lmcache_core.kv.madvise import populate_step
from lmcache_core.storage.pinned import pin_exact

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
POPULATE_STEP = 64 << 20  # one madvise call (GIL released): a stop is seen within one step
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def allocate_buffer(nbytes: int, pin: bool,
                    logger: logging.Logger) -> tuple[torch.Tensor, bool, mmap.mmap | None]:
    """A 1-D uint8 tensor of ``nbytes``, pinned if asked and possible; else pageable memory from a
    private anonymous mapping (page-aligned, so it can be advised), with an error logged on
    ``logger`` if pinning failed. Returns (tensor, pinned, mapping or None)."""
    if pin:
        try:  # the exact size: torch's pin_memory rounds up to a power of two (storage/pinned.py)
            return pin_exact((1, nbytes)).view(-1), True, None
        except RuntimeError as exc:
            logger.error("memory pool: cannot pin %d bytes (%s); using PAGEABLE memory: GPU copies "
                         "will be slower and synchronous", nbytes,
                         str(exc).splitlines()[0] if str(exc) else exc)
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, AttributeError, ValueError) as exc:  # not a POSIX mmap: plain allocation
        logger.debug("memory pool: no anonymous mapping (%s); using torch.empty", exc)
        return torch.empty(nbytes, dtype=torch.uint8), False, None
    return torch.frombuffer(mapping, dtype=torch.uint8), False, mapping


def allocate_pool(nbytes: int, pin: bool,
                  logger: logging.Logger) -> tuple[torch.Tensor, bool, mmap.mmap | None]:
    """``allocate_buffer`` for the server's pool: one the machine cannot hold (more than its
    memory, or an allocation that fails) is a ConfigError naming ``server.pool_size`` and the
    size (``lmcache serve`` prints it as one line, exit 2), not a traceback."""
    where = f"server.pool_size: {nbytes} bytes ({_gib(nbytes)})"
    total = total_memory_bytes()
    if total is not None and nbytes > total:
        raise ConfigError(f"{where} is more than this machine's memory ({_gib(total)})")
    try:
        return allocate_buffer(nbytes, pin, logger)
    except (RuntimeError, OverflowError, MemoryError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{where} cannot be allocated: {reason}") from None


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def total_memory_bytes() -> int | None:
    """The machine's physical memory (MemTotal), or None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


def populate_write(address: int, start: int, end: int, stop: threading.Event | None,
                   progress: Callable[[int], None]) -> bool | None:
    """``MADV_POPULATE_WRITE`` over ``[address + start, address + end)`` a step at a time, calling
    ``progress(offset_done)`` after each. True when done, False when ``stop`` was set, None when
    the kernel does not know the advice (its first call fails with EINVAL). OSError otherwise."""
    for offset in range(start, end, POPULATE_STEP):
        if stop is not None and stop.is_set():
            return False
        length = min(POPULATE_STEP, end - offset)
        if not populate_step(address + offset, length, offset == 0, ""):
            return None
        progress(offset + length)
    return True


def advise_huge_pages(mapping: mmap.mmap) -> bool:
    """Ask for transparent huge pages (fewer faults, fewer TLB misses); False where not offered."""
    try:
        if "[never]" in _THP_ENABLED.read_text():
            return False
        mapping.madvise(_MADV_HUGEPAGE)
    except (OSError, AttributeError, ValueError):
        return False
    return True




def process_rss_bytes() -> int:
    """This process's resident set size (0 where /proc is not there)."""
    try:
        resident = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident * os.sysconf("SC_PAGE_SIZE")
