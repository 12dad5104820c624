"""The L1 memory pool: one preallocated byte tensor cut into equal chunk slots.

One allocation up front (bounded, counted, never grown) instead of one tensor per chunk: pinned host
memory is slow to allocate and easy to leak, and a fixed pool makes "full" a plain, cheap state the
engine handles by evicting.

Pages: an unpinned pool is one private anonymous ``mmap`` (so a large pool starts at once). Its
pages are not there yet: the first write of each costs a page fault (a first store into fresh slots
ran ~30x slower than later ones). ``populate`` maps them all ahead of use; the server runs it on a
background thread right after it is ready. It never races a store into wrong data: it asks the
kernel to populate the pages (``MADV_POPULATE_WRITE``, Linux >= 5.14: page tables as if written,
the bytes left as they are), or, where the kernel cannot, zeroes only slots that are free, one at a
time under the pool's lock, so a slot handed out by ``allocate`` is never written by it. Pinned
pools are populated by pinning. After the populate the pool is advised ``MADV_HUGEPAGE`` where the
kernel offers transparent huge pages, so khugepaged merges it into 2 MiB pages in the background
(copies ~10 % faster here). Not before: populating straight into huge pages took 1.3-3 s per GiB on
this VM against 0.37 s with 4 KiB pages.

``CacheEngine`` calls ``allocate``/``free`` under its own lock; the pool's own lock only orders them
with ``populate``. ``view`` only indexes the tensor and may be called from any thread.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from pathlib import Path

import torch

from lmcache_core.errors import ConfigError
from lmcache_core.storage.pinned import pin_exact

logger = logging.getLogger(__name__)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_POPULATE_STEP = 64 << 20  # one madvise call (GIL released): a stop is seen within one step
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class MemoryPool:
    """Equal chunk slots in one uint8 tensor ``[num_slots, slot_bytes]``."""

    def __init__(self, slot_bytes: int, num_slots: int, pin: bool | None = None) -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ConfigError(
                f"memory pool: slot_bytes ({slot_bytes}) and num_slots ({num_slots}) must be "
                "positive")
        self._slot_bytes = slot_bytes
        self._num_slots = num_slots
        want_pin = torch.cuda.is_available() if pin is None else pin
        self._buf, self._pinned, self._mapping = _allocate(num_slots, slot_bytes, want_pin)
        #: pinning was wanted (a CUDA host) but failed: the ready panel says so
        self.pin_failed = want_pin and not self._pinned
        #: transparent huge pages were asked for (after the populate) and the kernel offers them
        self.huge_pages = False
        # A stack, lowest slot on top, so a lightly used pool touches few pages.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        # One byte per slot: catches a double free or a free of a slot never handed out.
        self._in_use = bytearray(num_slots)
        self._lock = threading.Lock()  # allocate/free against populate's zeroing fallback
        #: ``populate``'s progress: "pending" (not run), "running", "done", "stopped", "failed"
        self.populate_state = "done" if self._pinned else "pending"
        self.populated_bytes = self.nbytes if self._pinned else 0
        #: seconds the whole populate took (None until it is done)
        self.populate_s: float | None = 0.0 if self._pinned else None

    def prefault(self) -> None:
        """Populate every page now, so no later store pays the first-touch page faults."""
        self.populate()

    def populate(self, stop: threading.Event | None = None) -> None:
        """Map every page of the pool ahead of use (see the module's note: safe beside stores).

        Stops early when ``stop`` is set. An error of the OS (no memory) is logged, not raised:
        the pool still works, its pages fault in as they are first written."""
        if self.populate_state not in ("pending", "stopped"):
            return
        self.populate_state = "running"
        start = time.perf_counter()
        try:
            done = self._populate_advised(stop)
            if done is None:  # the kernel has no MADV_POPULATE_WRITE: zero the free slots
                done = self._populate_free_slots(stop)
        except OSError as exc:
            self.populate_state = "failed"
            logger.warning("memory pool: populating the pages failed after %.1f GiB (%s); they "
                           "are mapped as stores first write them", self.populated_bytes / 2**30,
                           exc)
            return
        if not done:
            self.populate_state = "stopped"
            return
        self.populate_s = time.perf_counter() - start
        self.populate_state = "done"
        self.huge_pages = self._mapping is not None and _advise_huge_pages(self._mapping)
        logger.info("memory pool: %.1f GiB populated in %.2f s%s; process RSS %.1f GiB",
                    self.nbytes / 2**30, self.populate_s,
                    ", then advised transparent huge pages" if self.huge_pages else "",
                    process_rss_bytes() / 2**30)

    def _populate_advised(self, stop: threading.Event | None) -> bool | None:
        """``MADV_POPULATE_WRITE`` over the mapping, a step at a time; None if not supported."""
        if self._mapping is None:
            return None
        base = self._buf.data_ptr()
        for offset in range(self.populated_bytes, self.nbytes, _POPULATE_STEP):
            if stop is not None and stop.is_set():
                return False
            length = min(_POPULATE_STEP, self.nbytes - offset)
            if _libc_madvise(base + offset, length, _MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                if err == errno.EINVAL and offset == 0:
                    return None
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
            self.populated_bytes = offset + length
        return True

    def _populate_free_slots(self, stop: threading.Event | None) -> bool:
        """Zero each slot that is free, under the lock (allocate waits at most one slot)."""
        self.populated_bytes = 0
        for slot in range(self._num_slots - 1, -1, -1):  # the far end of the free stack first
            if stop is not None and stop.is_set():
                return False
            with self._lock:
                if not self._in_use[slot]:
                    self._buf[slot].zero_()
            self.populated_bytes += self._slot_bytes
        return True

    @classmethod
    def from_bytes(cls, pool_bytes: int, slot_bytes: int, pin: bool | None = None) -> MemoryPool:
        """As many whole slots as fit in ``pool_bytes`` (the remainder is not allocated)."""
        if slot_bytes <= 0:
            raise ConfigError(f"memory pool: slot_bytes must be positive, got {slot_bytes}")
        num_slots = pool_bytes // slot_bytes
        if num_slots <= 0:
            raise ConfigError(
                f"memory pool: pool size {pool_bytes} bytes is smaller than one chunk slot "
                f"({slot_bytes} bytes)")
        return cls(slot_bytes, num_slots, pin)

    # ------------------------------------------------------------------ slots

    def allocate(self) -> int | None:
        """A free slot id, or None when the pool is full (the caller decides what to evict)."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._in_use[slot] = 1
            return slot

    def free(self, slot: int) -> None:
        """Give a slot back. Freeing a slot that is not in use is a bug and raises ValueError."""
        with self._lock:
            if not 0 <= slot < self._num_slots or not self._in_use[slot]:
                raise ValueError(f"memory pool: slot {slot} is not allocated")
            self._in_use[slot] = 0
            self._free.append(slot)

    def view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """The slot's bytes (the first ``nbytes`` of them) as a 1-D view: no copy."""
        if nbytes is None:
            return self._buf[slot]
        return self._buf[slot, :nbytes]

    def is_allocated(self, slot: int) -> bool:
        return bool(self._in_use[slot])

    # ------------------------------------------------------------------ figures

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_slots - len(self._free)

    @property
    def nbytes(self) -> int:
        return self._num_slots * self._slot_bytes

    @property
    def pinned(self) -> bool:
        return self._pinned

    @property
    def pinned_bytes(self) -> int:
        """Bytes of page-locked memory the pool holds (exactly its size when pinned, else 0)."""
        return self.nbytes if self._pinned else 0

    @property
    def tensor(self) -> torch.Tensor:
        """The whole pool (e.g. to register it with a device once)."""
        return self._buf

    def __repr__(self) -> str:
        return (f"MemoryPool(slots={self._num_slots}, slot_bytes={self._slot_bytes}, "
                f"free={len(self._free)}, pinned={self._pinned})")


def _allocate(num_slots: int, slot_bytes: int,
              pin: bool) -> tuple[torch.Tensor, bool, mmap.mmap | None]:
    """The pool tensor, pinned if asked and possible; else pageable memory from a private
    anonymous mapping (page-aligned, so it can be advised), with a warning if pinning failed."""
    shape = (num_slots, slot_bytes)
    if pin:
        try:  # the exact size: torch's pin_memory rounds up to a power of two (storage/pinned.py)
            return pin_exact(shape), True, None
        except RuntimeError as exc:
            logger.error("memory pool: cannot pin %d bytes (%s); using PAGEABLE memory: GPU copies "
                         "will be slower and synchronous", num_slots * slot_bytes,
                         str(exc).splitlines()[0] if str(exc) else exc)
    try:
        mapping = mmap.mmap(-1, num_slots * slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, AttributeError, ValueError) as exc:  # not a POSIX mmap: plain allocation
        logger.debug("memory pool: no anonymous mapping (%s); using torch.empty", exc)
        return torch.empty(shape, dtype=torch.uint8), False, None
    return torch.frombuffer(mapping, dtype=torch.uint8).view(shape), False, mapping


def _advise_huge_pages(mapping: mmap.mmap) -> bool:
    """Ask for transparent huge pages (fewer faults, fewer TLB misses); False where not offered."""
    try:
        if "[never]" in _THP_ENABLED.read_text():
            return False
        mapping.madvise(_MADV_HUGEPAGE)
    except (OSError, AttributeError, ValueError):
        return False
    return True


_LIBC: ctypes.CDLL | None = None


def _libc_madvise(address: int, length: int, advice: int) -> int:
    """``madvise`` through ctypes, which releases the GIL for the call (``mmap.madvise`` does
    not: populating gigabytes would stall every other thread of the server)."""
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _LIBC = libc
    return int(_LIBC.madvise(address, length, advice))


def process_rss_bytes() -> int:
    """This process's resident set size (0 where /proc is not there)."""
    try:
        resident = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident * os.sysconf("SC_PAGE_SIZE")
