"""The L1 memory pool: one preallocated byte buffer cut into small allocation units.

One server serves many models, layouts and tensor-parallel sizes at once (and, with hybrid models,
one piece size per KV-cache group), so the pieces of chunks it holds come in many sizes. They all
draw on ONE byte budget, with eviction across all of them: no per-model partition sized up front.

* Buffer: one 1-D uint8 tensor of ``num_slabs * slab_bytes`` bytes, allocated up front (bounded,
  counted, never grown): pinned host memory is slow to allocate and easy to leak, and a fixed pool
  makes "full" a plain, cheap state the engine handles by evicting.
* Units ("slabs", ``server.slab_size``): the buffer is cut into equal units, 2 MiB by default (a
  huge page). A unit is free, a slab of one size class, or part of an extent.
* Classes: an allocation of ``n`` bytes is ``size_class(n)`` = ``n`` rounded up to ``ALIGN`` (64)
  bytes, so every allocation starts 64-byte aligned.
* Small allocations (a class up to one unit) take a slot of a slab of their class: a unit cut into
  ``slab_bytes // class`` slots. A class takes a free unit when its own slabs are full; a slab
  whose last slot is freed is a free unit again, for anything.
* Large allocations (a class over one unit) are extents: ``ceil(class / slab_bytes)`` consecutive
  units, so every allocation is ONE contiguous view (every consumer, the copies, checksums and
  tiers, reads a piece as one view). Free units are kept as runs; an extent takes the shortest run
  that holds it (the lowest one among equals), and a freed one merges back with its neighbours.
* ``allocate`` returns None when no room exists: the engine evicts (``engine/eviction.py``, which
  reads the layout through ``slab_handles``/``units_of``: emptying the right units is its job, so
  a locked piece holds only the units it sits in).
* Handles: an allocation is named by its byte offset in the buffer; ``view`` is a zero-copy slice.
  Handle 0 is valid: test ``is None``.
* Waste is bounded: ``slab_bytes % class`` bytes at the end of each slab, the rest of an extent's
  last unit, and under ``ALIGN`` bytes per allocation.

Pages (``storage/pages.py``): an unpinned pool is one private anonymous ``mmap`` (so a large pool
starts at once). Its pages are not there yet: the first write of each costs a page fault (a first
store into fresh memory ran ~30x slower than later ones). ``populate`` maps them all ahead of use;
the server runs it on a background thread right after it is ready. It never races a store into
wrong data: it asks the kernel to populate the pages (``MADV_POPULATE_WRITE``, Linux >= 5.14: page
tables as if written, the bytes left as they are), or, where the kernel cannot, zeroes only memory
no allocation holds: free units, and the never-handed-out tail of slabs, a step at a time under
the pool's lock (freed slots inside a slab are skipped: they fault in on their next write).
Pinned pools are populated by pinning. After the populate the pool is advised ``MADV_HUGEPAGE``
where the kernel offers transparent huge pages, so khugepaged merges it into 2 MiB pages in the
background (copies ~10 % faster here). Not before: populating straight into huge pages took
1.3-3 s per GiB on this VM against 0.37 s with 4 KiB pages.

Threads: one lock orders allocate/free/introspection with each other and with the populate's
zeroing (the engine calls them under its own lock too). ``view`` takes no lock and may be called
from any thread: it checks the handle with reads that are atomic under the GIL.
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

__all__ = ["ALIGN", "DEFAULT_UNIT", "MemoryPool", "auto_slab_bytes", "process_rss_bytes"]

logger = logging.getLogger(__name__)
ALIGN = 64  # bytes: every size class, so every handle, is a multiple of it
DEFAULT_UNIT = 2 << 20  # one huge page: what a store of a new size may cost others, at most
_ZERO_STEP = 16 << 20  # the zeroing fallback holds the lock for one such memset at most


def _round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def auto_slab_bytes(nbytes: int) -> int:
    """The default unit of a pool of ``nbytes``: ``DEFAULT_UNIT`` (2 MiB), or the whole pool
    (rounded down to a multiple of ``ALIGN``) when it is smaller than that."""
    return min(nbytes, DEFAULT_UNIT) // ALIGN * ALIGN


class _FreeRuns:
    """The free units as runs of consecutive units: by start, by end and by length."""

    def __init__(self, units: int) -> None:
        self._length: dict[int, int] = {}  # start -> length
        self._start_at_end: dict[int, int] = {}  # end (exclusive) -> start
        self._by_length: dict[int, set[int]] = {}  # length -> starts
        self.free = 0  # free units in all
        if units:
            self._add(0, units)

    def _add(self, start: int, length: int) -> None:
        self._length[start] = length
        self._start_at_end[start + length] = start
        self._by_length.setdefault(length, set()).add(start)
        self.free += length

    def _remove(self, start: int) -> int:
        length = self._length.pop(start)
        del self._start_at_end[start + length]
        starts = self._by_length[length]
        starts.discard(start)
        if not starts:
            del self._by_length[length]
        self.free -= length
        return length

    def longest(self) -> int:
        return max(self._by_length, default=0)

    def take(self, units: int) -> int | None:
        """The first unit of ``units`` consecutive free ones, now taken: from the shortest run
        that holds them (the lowest among equals), so long runs stay whole for long extents."""
        fitting = [length for length in self._by_length if length >= units]
        if not fitting:
            return None
        length = min(fitting)
        start = min(self._by_length[length])
        self._remove(start)
        if length > units:
            self._add(start + units, length - units)
        return start

    def take_at(self, first: int, units: int) -> bool:
        """Take units ``[first, first + units)`` if they are all free (in one run)."""
        start = first  # the run holding ``first`` starts at it or before it
        while start >= 0 and start not in self._length:
            start -= 1
        length = self._length.get(start, 0)
        if start < 0 or first + units > start + length:
            return False
        self._remove(start)
        if start < first:
            self._add(start, first - start)
        if first + units < start + length:
            self._add(first + units, start + length - first - units)
        return True

    def give(self, start: int, units: int) -> None:
        """Units ``[start, start + units)`` are free again (merged with free neighbours)."""
        left = self._start_at_end.get(start)
        if left is not None:
            units += self._remove(left)
            start = left
        if start + units in self._length:
            units += self._remove(start + units)
        self._add(start, units)


class MemoryPool:
    """Allocations of any size up to the whole pool in one byte buffer (see the module's note)."""

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
        self._class = [0] * n  # per unit: its class when it is a slab, else 0
        self._extent = [-1] * n  # per unit: the handle of the extent it is part of, else -1
        self._bump = [u * slab_bytes for u in range(n)]  # per slab: the lowest never-used offset
        self._holes: list[list[int]] = [[] for _ in range(n)]  # per slab: heap of freed handles
        self._live: list[set[int]] = [set() for _ in range(n)]  # per slab: allocated handles
        self._extents: dict[int, tuple[int, int, int]] = {}  # handle -> (first unit, units, class)
        self._runs = _FreeRuns(n)
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
        """A pool of ``num_slots`` units of exactly ``size_class(slot_bytes)`` bytes: it holds
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
        most one step): a free unit whole, a slab from its never-used tail on, an extent not."""
        self.populated_bytes = 0
        size = self._slab_bytes
        for unit in range(self._num_slabs - 1, -1, -1):  # the far end first
            end = (unit + 1) * size
            for offset in range(unit * size, end, _ZERO_STEP):
                if stop is not None and stop.is_set():
                    return False
                step_end = min(offset + _ZERO_STEP, end)
                with self._lock:
                    if self._extent[unit] < 0:
                        low = offset if not self._class[unit] else max(offset, self._bump[unit])
                        if low < step_end:
                            self._buf[low:step_end].zero_()
                self.populated_bytes += step_end - offset
        return True

    # ------------------------------------------------------------------ allocations

    def size_class(self, nbytes: int) -> int:
        """The bytes an allocation of ``nbytes`` takes: ``nbytes`` rounded up to ``ALIGN``.
        ValueError when ``nbytes`` is not positive or the class exceeds the whole pool."""
        if nbytes <= 0:
            raise ValueError(f"memory pool: cannot allocate {nbytes} bytes")
        size = _round_up(nbytes)
        if size > self._nbytes:
            raise ValueError(f"memory pool: {nbytes} bytes exceed the largest allocation "
                             f"({self._nbytes} bytes, the whole pool)")
        return size

    def units_for(self, nbytes: int) -> int:
        """How many units an allocation of ``nbytes`` sits in (1 for a slot of a slab)."""
        return -(-self.size_class(nbytes) // self._slab_bytes)

    def fits(self, nbytes: int) -> bool:
        """Whether an allocation of ``nbytes`` is possible at all (positive, at most the pool)."""
        return nbytes > 0 and _round_up(nbytes) <= self._nbytes

    def allocate(self, nbytes: int) -> int | None:
        """A handle (byte offset, a multiple of ``ALIGN``) of ``nbytes`` of contiguous memory, or
        None when no room exists (the caller evicts). ValueError when ``nbytes`` never fits."""
        size = self.size_class(nbytes)
        with self._lock:
            handle = (self._allocate_slot(size) if size <= self._slab_bytes
                      else self._allocate_extent(size))
            if handle is not None:
                self._num_allocated += 1
                self._bytes_allocated += size
            return handle

    def _allocate_slot(self, size: int) -> int | None:
        open_slabs = self._open.get(size)
        if open_slabs:
            slab = next(reversed(open_slabs))
        else:
            taken = self._runs.take(1)
            if taken is None:
                return None
            slab = taken
            self._class[slab] = size
            open_slabs = self._open.setdefault(size, {})
            open_slabs[slab] = None
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
        return handle

    def allocate_at(self, nbytes: int, first: int) -> int | None:
        """``allocate`` of an allocation over one unit placed at unit ``first`` (the window the
        engine's eviction emptied for it); None when those units are not all free."""
        size = self.size_class(nbytes)
        if size <= self._slab_bytes:
            raise ValueError(f"memory pool: {nbytes} bytes take a slot of a slab, not units")
        with self._lock:
            units = -(-size // self._slab_bytes)
            if not self._runs.take_at(first, units):
                return None
            handle = self._place_extent(first, units, size)
            self._num_allocated += 1
            self._bytes_allocated += size
            return handle

    def _allocate_extent(self, size: int) -> int | None:
        units = -(-size // self._slab_bytes)
        first = self._runs.take(units)
        if first is None:
            return None
        return self._place_extent(first, units, size)

    def _place_extent(self, first: int, units: int, size: int) -> int:
        handle = first * self._slab_bytes
        for unit in range(first, first + units):
            self._extent[unit] = handle
        self._extents[handle] = (first, units, size)
        return handle

    def free(self, handle: int) -> None:
        """Give an allocation back; a slab left empty, or an extent, is free units again.
        ValueError for a handle that is not allocated (a double free, a foreign or garbage one)."""
        with self._lock:
            size = self._size_of_live(handle)
            self._num_allocated -= 1
            self._bytes_allocated -= size
            extent = self._extents.pop(handle, None)
            if extent is not None:
                first, units, _ = extent
                for unit in range(first, first + units):
                    self._extent[unit] = -1
                self._runs.give(first, units)
                return
            self._free_slot(handle, size)

    def _free_slot(self, handle: int, size: int) -> None:
        slab = handle // self._slab_bytes
        live = self._live[slab]
        live.remove(handle)
        open_slabs = self._open.setdefault(size, {})
        if not live:
            open_slabs.pop(slab, None)
            self._class[slab] = 0
            self._holes[slab] = []
            self._bump[slab] = slab * self._slab_bytes
            self._runs.give(slab, 1)
        else:
            heapq.heappush(self._holes[slab], handle)
            if slab not in open_slabs:
                open_slabs[slab] = None  # was full: now the newest slab with a free slot
        if not open_slabs:
            del self._open[size]

    def view(self, handle: int, nbytes: int | None = None) -> torch.Tensor:
        """The first ``nbytes`` (default: the whole allocation) of an allocation as a 1-D uint8
        view, no copy. ValueError if the handle is not allocated or ``nbytes`` exceeds it."""
        size = self._size_of_live(handle)
        if nbytes is None:
            nbytes = size
        elif not 0 <= nbytes <= size:
            raise ValueError(f"memory pool: a view of {nbytes} bytes of handle {handle} exceeds "
                             f"its {size}-byte slot")
        return self._buf[handle:handle + nbytes]

    def _size_of_live(self, handle: int) -> int:
        """The class of an allocated handle; ValueError for any other value."""
        if not isinstance(handle, int) or not 0 <= handle < self._nbytes or handle % ALIGN:
            raise ValueError(f"memory pool: handle {handle!r} is not allocated")
        extent = self._extents.get(handle)
        if extent is not None:
            return extent[2]
        slab = handle // self._slab_bytes
        size = self._class[slab]
        if not size or handle not in self._live[slab]:
            raise ValueError(f"memory pool: handle {handle} is not allocated")
        return size

    # ------------------------------------------------------------------ introspection

    def is_allocated(self, handle: int) -> bool:
        try:
            self._size_of_live(handle)
        except ValueError:
            return False
        return True

    def class_of(self, handle: int) -> int:
        """The bytes an allocated handle takes (its class; ValueError if not allocated)."""
        with self._lock:
            return self._size_of_live(handle)

    def units_of(self, handle: int) -> range:
        """The units an allocated handle sits in (ValueError if not allocated)."""
        with self._lock:
            extent = self._extents.get(handle)
            if extent is not None:
                return range(extent[0], extent[0] + extent[1])
            self._size_of_live(handle)
            slab = handle // self._slab_bytes
            return range(slab, slab + 1)

    def placement(self, handle: int) -> tuple[range, int]:
        """``(units_of(handle), class_of(handle))`` at once (ValueError if not allocated)."""
        with self._lock:
            size = self._size_of_live(handle)
            extent = self._extents.get(handle)
            if extent is not None:
                return range(extent[0], extent[0] + extent[1]), size
            slab = handle // self._slab_bytes
            return range(slab, slab + 1), size

    def occupants(self, units: range) -> list[list[int]]:
        """``slab_handles`` of each unit of ``units`` (clipped to the pool), under one lock."""
        with self._lock:
            extent_of, live = self._extent, self._live
            return [[extent_of[unit]] if extent_of[unit] >= 0 else sorted(live[unit])
                    for unit in range(max(units.start, 0), min(units.stop, self._num_slabs))]

    def slab_of(self, handle: int) -> int:
        """The unit of a byte offset (any offset in the buffer; ValueError outside it)."""
        if not 0 <= handle < self._nbytes:
            raise ValueError(f"memory pool: handle {handle} is outside the pool")
        return handle // self._slab_bytes

    def slab_class(self, slab: int) -> int:
        """The class of a unit: a slab's slot size, an extent's class, 0 when it is free."""
        self._check_slab(slab)
        with self._lock:
            handle = self._extent[slab]
            return self._extents[handle][2] if handle >= 0 else self._class[slab]

    def slab_handles(self, slab: int) -> list[int]:
        """The allocations in a unit, ascending (the extent covering it, or the slab's slots;
        free them all and the unit is free)."""
        self._check_slab(slab)
        with self._lock:
            handle = self._extent[slab]
            return [handle] if handle >= 0 else sorted(self._live[slab])

    def can_allocate(self, nbytes: int) -> bool:
        """Whether ``allocate(nbytes)`` would succeed now (False also when it never fits)."""
        if not self.fits(nbytes):
            return False
        size = _round_up(nbytes)
        with self._lock:
            if size <= self._slab_bytes:
                return bool(self._open.get(size)) or self._runs.free > 0
            return self._runs.longest() >= -(-size // self._slab_bytes)

    def class_stats(self) -> dict[int, tuple[int, int]]:
        """Per class in use: (units it takes, allocations)."""
        stats: dict[int, tuple[int, int]] = {}
        with self._lock:
            for size, live in zip(self._class, self._live, strict=True):
                if size:
                    units, allocations = stats.get(size, (0, 0))
                    stats[size] = (units + 1, allocations + len(live))
            for _, units_taken, size in self._extents.values():
                units, allocations = stats.get(size, (0, 0))
                stats[size] = (units + units_taken, allocations + 1)
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
    def address(self) -> int:
        """The buffer's first byte in this process (a transfer engine registers the pool by it, to
        read and write pieces in place)."""
        return int(self._buf.data_ptr())

    @property
    def slab_bytes(self) -> int:
        """Bytes of one unit (``server.slab_size``)."""
        return self._slab_bytes

    @property
    def max_alloc_bytes(self) -> int:
        """The largest allocation: the whole pool (an extent of every unit)."""
        return self._nbytes

    @property
    def num_slabs(self) -> int:
        return self._num_slabs

    @property
    def free_slabs(self) -> int:
        """Free units (neither a slab of some class nor part of an extent)."""
        return self._runs.free

    @property
    def bytes_taken(self) -> int:
        """Bytes of the units in use (slabs and extents): what the live allocations keep from
        others, so ``bytes_taken / bytes held`` is the pool's fragmentation."""
        return (self._num_slabs - self._runs.free) * self._slab_bytes

    @property
    def num_allocated(self) -> int:
        return self._num_allocated

    @property
    def bytes_allocated(self) -> int:
        """The sum of the classes (slot sizes) of the live allocations."""
        return self._bytes_allocated

    @property
    def bytes_free(self) -> int:
        """``nbytes - bytes_allocated``: free units, free slots of slabs, the slabs' unusable
        tails and the rest of extents' last units. Not all of it fits any one class:
        ``can_allocate`` says that."""
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
                f"free_slabs={self._runs.free}, allocations={self._num_allocated}, "
                f"pinned={self._pinned})")
