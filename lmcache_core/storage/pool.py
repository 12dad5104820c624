"""The L1 memory pool: one preallocated byte tensor cut into equal chunk slots.

One allocation up front (bounded, counted, never grown) instead of one tensor per chunk: pinned host
memory is slow to allocate and easy to leak, and a fixed pool makes "full" a plain, cheap state the
engine handles by evicting. ``torch.empty`` leaves the pages untouched, so a large unpinned pool
starts at once; the OS maps pages as chunks are first written.

The pool itself is not thread-safe: ``CacheEngine`` calls ``allocate``/``free`` under its own lock.
``view`` only indexes the tensor and may be called from any thread.
"""

from __future__ import annotations

import logging

import torch

from lmcache_core.errors import ConfigError
from lmcache_core.storage.pinned import pin_exact

logger = logging.getLogger(__name__)


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
        self._buf, self._pinned = _allocate(num_slots, slot_bytes, want_pin)
        # A stack, lowest slot on top, so a lightly used pool touches few pages.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        # One byte per slot: catches a double free or a free of a slot never handed out.
        self._in_use = bytearray(num_slots)

    def prefault(self) -> None:
        """Write every page now, so no later store pays the first-touch page faults."""
        self._buf.zero_()

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
        if not self._free:
            return None
        slot = self._free.pop()
        self._in_use[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back. Freeing a slot that is not in use is a bug and raises ValueError."""
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


def _allocate(num_slots: int, slot_bytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
    """The pool tensor, pinned if asked and possible; an unpinned one (with a warning) if not."""
    shape = (num_slots, slot_bytes)
    if pin:
        try:  # the exact size: torch's pin_memory rounds up to a power of two (storage/pinned.py)
            return pin_exact(shape), True
        except RuntimeError as exc:
            logger.error("memory pool: cannot pin %d bytes (%s); using PAGEABLE memory: GPU copies "
                         "will be slower and synchronous", num_slots * slot_bytes,
                         str(exc).splitlines()[0] if str(exc) else exc)
    return torch.empty(shape, dtype=torch.uint8), False
