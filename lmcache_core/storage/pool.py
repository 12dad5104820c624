"""The L1 memory pool: a slab allocator over one preallocated byte buffer.

One server serves many models and tensor-parallel sizes at once, so the pieces of chunks it holds
come in many sizes. They all draw on ONE byte budget, with eviction across all of them: no
per-model partition sized up front (and wrong as soon as the traffic shifts).

* Buffer: one 1-D uint8 tensor of ``num_slabs * slab_bytes`` bytes, allocated up front (bounded,
  counted, never grown): pinned host memory is slow to allocate and easy to leak, and a fixed pool
  makes "full" a plain, cheap state the engine handles by evicting.
* Classes: an allocation of ``n`` bytes takes a slot of ``size_class(n)`` = ``n`` rounded up to
  ``ALIGN`` (64) bytes, so every allocation starts 64-byte aligned.
* Slabs: the buffer is cut into equal slabs. A slab is free, or assigned to one class and cut into
  ``slab_bytes // class`` slots. A class takes a free slab (lowest index first, so a lightly used
  pool touches few pages) when its own slabs are full; a slab whose last allocation is freed is
  free again, for any class. ``allocate`` returns None when neither exists: the engine evicts
  (``slab_handles`` says what to evict to empty a slab for another class).
* Handles: an allocation is named by its byte offset in the buffer; ``view`` is a zero-copy slice.
  Handle 0 is valid: test ``is None``.
* Waste is bounded: ``slab_bytes % class`` bytes at the end of each assigned slab, plus under
  ``ALIGN`` bytes per allocation.

Pages (``storage/pages.py``): an unpinned pool is one private anonymous ``mmap`` (so a large pool
starts at once). Its pages are not there yet: the first write of each costs a page fault (a first
store into fresh memory ran ~30x slower than later ones). ``populate`` maps them all ahead of use;
the server runs it on a background thread right after it is ready. It never races a store into
wrong data: it asks the kernel to populate the pages (``MADV_POPULATE_WRITE``, Linux >= 5.14: page
tables as if written, the bytes left as they are), or, where the kernel cannot, zeroes only memory
no allocation holds: free slabs, and the never-handed-out tail of assigned slabs, a step at a time
under the pool's lock (the freed slots inside an assigned slab are skipped: they fault in on their
next write). Pinned pools are populated by pinning. After the populate the pool is advised
``MADV_HUGEPAGE`` where the kernel offers transparent huge pages, so khugepaged merges it into
2 MiB pages in the background (copies ~10 % faster here). Not before: populating straight into huge
pages took 1.3-3 s per GiB on this VM against 0.37 s with 4 KiB pages.

Threads: one lock orders allocate/free/introspection with each other and with the populate's
zeroing (``CacheEngine`` calls them under its own lock too). ``view`` takes no lock and may be
called from any thread: it checks the handle with reads that are atomic under the GIL.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time

import torch

from lmcache_core.errors import ConfigError
from lmcache_core.storage import pages
from lmcache_core.storage.pages import process_rss_bytes

__all__ = ["ALIGN", "MemoryPool", "auto_slab_bytes", "process_rss_bytes"]

logger = logging.getLogger(__name__)
ALIGN = 64  # bytes: every size class, so every handle, is a multiple of it
_MIN_AUTO_SLAB = 128 << 20
_ZERO_STEP = 16 << 20  # the zeroing fallback holds the lock for one such memset at most


def _round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def auto_slab_bytes(nbytes: int) -> int:
    """The default slab size of a pool of ``nbytes``: ``min(nbytes, max(128 MiB, nbytes // 16))``
    rounded down to a multiple of ``ALIGN`` (so at most ~16 slabs, each of at least 128 MiB)."""
    return min(nbytes, max(_MIN_AUTO_SLAB, nbytes // 16)) // ALIGN * ALIGN


class MemoryPool:
    """Allocations of any size up to ``slab_bytes`` in one byte buffer (see the module's note)."""

    def __init__(self, nbytes: int, slab_bytes: int | None = None,
                 pin: bool | None = None) -> None:
        if nbytes <= 0:
            raise ConfigError(f"memory pool: size must be positive, got {nbytes} bytes")
        if slab_bytes is None:
            slab_bytes = auto_slab_bytes(nbytes)
            if slab_bytes <= 0:
                raise ConfigError(f"memory pool: size {nbytes} bytes is smaller than one "
                                  f"{ALIGN}-byte unit")
        if slab_bytes <= 0 or slab_bytes % ALIGN:
            raise ConfigError(f"memory pool: slab_bytes ({slab_bytes}) must be a positive "
                              f"multiple of {ALIGN}")
        if nbytes < slab_bytes:
            raise ConfigError(f"memory pool: size {nbytes} bytes is smaller than one slab "
                              f"({slab_bytes} bytes)")
        self._slab_bytes = slab_bytes
        self._num_slabs = nbytes // slab_bytes
        self._nbytes = self._num_slabs * slab_bytes
        want_pin = torch.cuda.is_available() if pin is None else pin
        self._buf, self._pinned, self._mapping = pages.allocate_pool(self._nbytes, want_pin,
                                                                     logger)
        #: pinning was wanted (a CUDA host) but failed: the ready panel says so
        self.pin_failed = want_pin and not self._pinned
        #: transparent huge pages were asked for (after the populate) and the kernel offers them
        self.huge_pages = False
        n = self._num_slabs
        self._class = [0] * n  # per slab: its class, 0 when free
        self._bump = [s * slab_bytes for s in range(n)]  # per slab: the lowest never-used offset
        self._holes: list[list[int]] = [[] for _ in range(n)]  # per slab: heap of freed handles
        self._live: list[set[int]] = [set() for _ in range(n)]  # per slab: allocated handles
        self._free_slabs = list(range(n))  # a heap: the lowest free slab first
        # class -> its slabs with a free slot, in insertion order: allocate takes the newest (a
        # slab that just had a slot freed, or the one just assigned), so holes fill first.
        self._open: dict[int, dict[int, None]] = {}
        self._num_allocated = 0
        self._bytes_allocated = 0
        self._lock = threading.Lock()
        #: ``populate``'s progress: "pending" (not run), "running", "done", "stopped", "failed"
        self.populate_state = "done" if self._pinned else "pending"
        self.populated_bytes = self._nbytes if self._pinned else 0
        #: seconds the whole populate took (None until it is done)
        self.populate_s: float | None = 0.0 if self._pinned else None

    @classmethod
    def slots(cls, slot_bytes: int, num_slots: int, pin: bool | None = None) -> MemoryPool:
        """A pool of ``num_slots`` slabs of exactly ``size_class(slot_bytes)`` bytes: it holds
        ``num_slots`` allocations of ``slot_bytes``, like an equal-slot pool."""
        if slot_bytes <= 0 or num_slots <= 0:
            raise ConfigError(f"memory pool: slot_bytes ({slot_bytes}) and num_slots ({num_slots})"
                              " must be positive")
        slab = _round_up(slot_bytes)
        return cls(slab * num_slots, slab, pin)

    # ------------------------------------------------------------------ populate

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
            if done is None:  # the kernel has no MADV_POPULATE_WRITE: zero what no one holds
                done = self._populate_free_slabs(stop)
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
        self.huge_pages = self._mapping is not None and pages.advise_huge_pages(self._mapping)
        logger.info("memory pool: %.1f GiB populated in %.2f s%s; process RSS %.1f GiB",
                    self._nbytes / 2**30, self.populate_s,
                    ", then advised transparent huge pages" if self.huge_pages else "",
                    process_rss_bytes() / 2**30)

    def _populate_advised(self, stop: threading.Event | None) -> bool | None:
        """``MADV_POPULATE_WRITE`` over the mapping, a step at a time; None if not supported."""
        if self._mapping is None:
            return None

        def progress(done: int) -> None:
            self.populated_bytes = done

        return pages.populate_write(self._buf.data_ptr(), self.populated_bytes, self._nbytes,
                                    stop, progress)

    def _populate_free_slabs(self, stop: threading.Event | None) -> bool:
        """Zero the memory no allocation holds, a step at a time under the lock (allocate waits at
        most one step): a free slab whole, an assigned one from its never-used tail on."""
        self.populated_bytes = 0
        size = self._slab_bytes
        for slab in range(self._num_slabs - 1, -1, -1):  # the far end of the free heap first
            end = (slab + 1) * size
            for offset in range(slab * size, end, _ZERO_STEP):
                if stop is not None and stop.is_set():
                    return False
                step_end = min(offset + _ZERO_STEP, end)
                with self._lock:
                    low = offset if not self._class[slab] else max(offset, self._bump[slab])
                    if low < step_end:
                        self._buf[low:step_end].zero_()
                self.populated_bytes += step_end - offset
        return True

    # ------------------------------------------------------------------ allocations

    def size_class(self, nbytes: int) -> int:
        """The slot size an allocation of ``nbytes`` takes: ``nbytes`` rounded up to ``ALIGN``.
        ValueError when ``nbytes`` is not positive or the class exceeds ``slab_bytes``."""
        if nbytes <= 0:
            raise ValueError(f"memory pool: cannot allocate {nbytes} bytes")
        size = _round_up(nbytes)
        if size > self._slab_bytes:
            raise ValueError(f"memory pool: {nbytes} bytes exceed the largest allocation "
                             f"({self._slab_bytes} bytes, one slab)")
        return size

    def fits(self, nbytes: int) -> bool:
        """Whether an allocation of ``nbytes`` is possible at all (positive, at most a slab)."""
        return nbytes > 0 and _round_up(nbytes) <= self._slab_bytes

    def allocate(self, nbytes: int) -> int | None:
        """A handle (byte offset, a multiple of ``ALIGN``) of ``nbytes`` of memory, or None when
        neither a free slot of its class nor a free slab exists (the caller evicts). ValueError
        when ``nbytes`` never fits (see ``size_class``)."""
        size = self.size_class(nbytes)
        with self._lock:
            open_slabs = self._open.get(size)
            if open_slabs:
                slab = next(reversed(open_slabs))
            elif self._free_slabs:
                slab = heapq.heappop(self._free_slabs)
                self._class[slab] = size
                open_slabs = self._open.setdefault(size, {})
                open_slabs[slab] = None
            else:
                return None
            holes = self._holes[slab]
            if holes:
                handle = heapq.heappop(holes)
            else:
                handle = self._bump[slab]
                self._bump[slab] = handle + size
            if not holes and self._bump[slab] + size > (slab + 1) * self._slab_bytes:
                del open_slabs[slab]  # full
                if not open_slabs:
                    del self._open[size]
            self._live[slab].add(handle)
            self._num_allocated += 1
            self._bytes_allocated += size
            return handle

    def free(self, handle: int) -> None:
        """Give an allocation back; a slab left empty is free for any class again. ValueError
        for a handle that is not allocated (a double free, a foreign or garbage handle)."""
        with self._lock:
            slab = self._slab_of_live(handle)
            size = self._class[slab]
            live = self._live[slab]
            live.remove(handle)
            self._num_allocated -= 1
            self._bytes_allocated -= size
            open_slabs = self._open.setdefault(size, {})
            if not live:
                open_slabs.pop(slab, None)
                self._class[slab] = 0
                self._holes[slab] = []
                self._bump[slab] = slab * self._slab_bytes
                heapq.heappush(self._free_slabs, slab)
            else:
                heapq.heappush(self._holes[slab], handle)
                if slab not in open_slabs:
                    open_slabs[slab] = None  # was full: now the newest slab with a free slot
            if not open_slabs:
                del self._open[size]

    def view(self, handle: int, nbytes: int | None = None) -> torch.Tensor:
        """The first ``nbytes`` (default: the whole slot) of an allocation as a 1-D uint8 view,
        no copy. ValueError if the handle is not allocated or ``nbytes`` exceeds its class."""
        slab = self._slab_of_live(handle)
        size = self._class[slab]
        if nbytes is None:
            nbytes = size
        elif not 0 <= nbytes <= size:
            raise ValueError(f"memory pool: a view of {nbytes} bytes of handle {handle} exceeds "
                             f"its {size}-byte slot")
        return self._buf[handle:handle + nbytes]

    def _slab_of_live(self, handle: int) -> int:
        """The slab of an allocated handle; ValueError for any other value."""
        if not isinstance(handle, int) or not 0 <= handle < self._nbytes or handle % ALIGN:
            raise ValueError(f"memory pool: handle {handle!r} is not allocated")
        slab = handle // self._slab_bytes
        if handle not in self._live[slab]:
            raise ValueError(f"memory pool: handle {handle} is not allocated")
        return slab

    # ------------------------------------------------------------------ introspection

    def is_allocated(self, handle: int) -> bool:
        try:
            self._slab_of_live(handle)
        except ValueError:
            return False
        return True

    def class_of(self, handle: int) -> int:
        """The slot size of an allocated handle (ValueError if not allocated)."""
        with self._lock:
            return self._class[self._slab_of_live(handle)]

    def slab_of(self, handle: int) -> int:
        """The slab index of a handle (any offset in the buffer; ValueError outside it)."""
        if not 0 <= handle < self._nbytes:
            raise ValueError(f"memory pool: handle {handle} is outside the pool")
        return handle // self._slab_bytes

    def slab_class(self, slab: int) -> int:
        """The class a slab is assigned to, 0 when it is free."""
        self._check_slab(slab)
        return self._class[slab]

    def slab_handles(self, slab: int) -> list[int]:
        """The allocated handles in a slab, ascending (free them all and the slab is free)."""
        self._check_slab(slab)
        with self._lock:
            return sorted(self._live[slab])

    def can_allocate(self, nbytes: int) -> bool:
        """Whether ``allocate(nbytes)`` would succeed now (False also when it never fits)."""
        if not self.fits(nbytes):
            return False
        with self._lock:
            return bool(self._open.get(_round_up(nbytes))) or bool(self._free_slabs)

    def class_stats(self) -> dict[int, tuple[int, int]]:
        """Per class with slabs: (slabs assigned, allocations)."""
        stats: dict[int, tuple[int, int]] = {}
        with self._lock:
            for size, live in zip(self._class, self._live, strict=True):
                if size:
                    slabs, allocations = stats.get(size, (0, 0))
                    stats[size] = (slabs + 1, allocations + len(live))
        return dict(sorted(stats.items()))

    def _check_slab(self, slab: int) -> None:
        if not 0 <= slab < self._num_slabs:
            raise ValueError(f"memory pool: no slab {slab} (the pool has {self._num_slabs})")

    # ------------------------------------------------------------------ figures

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer (``num_slabs * slab_bytes``)."""
        return self._nbytes

    @property
    def slab_bytes(self) -> int:
        return self._slab_bytes

    @property
    def max_alloc_bytes(self) -> int:
        """The largest allocation: one slab."""
        return self._slab_bytes

    @property
    def num_slabs(self) -> int:
        return self._num_slabs

    @property
    def free_slabs(self) -> int:
        """Slabs assigned to no class (each can take any class)."""
        return len(self._free_slabs)

    @property
    def num_allocated(self) -> int:
        return self._num_allocated

    @property
    def bytes_allocated(self) -> int:
        """The sum of the classes (slot sizes) of the live allocations."""
        return self._bytes_allocated

    @property
    def bytes_free(self) -> int:
        """``nbytes - bytes_allocated``: free slabs, free slots of assigned slabs, and the slabs'
        unusable tails. Not all of it fits any one class: ``can_allocate`` says that."""
        return self._nbytes - self._bytes_allocated

    @property
    def pinned(self) -> bool:
        return self._pinned

    @property
    def pinned_bytes(self) -> int:
        """Bytes of page-locked memory the pool holds (exactly its size when pinned, else 0)."""
        return self._nbytes if self._pinned else 0

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer, 1-D (e.g. to register it with a device once)."""
        return self._buf

    def __repr__(self) -> str:
        return (f"MemoryPool(nbytes={self._nbytes}, slabs={self._num_slabs}x{self._slab_bytes}, "
                f"free_slabs={len(self._free_slabs)}, allocations={self._num_allocated}, "
                f"pinned={self._pinned})")
