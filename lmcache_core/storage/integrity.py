"""Chunk checksums: xxh3-64 of a piece's bytes, taken when it is stored and checked whenever its
bytes leave memory for a tier, come back from one, or (``integrity.verify_on_retrieve``) are
copied to a worker.

``checksum`` never copies: it hashes the buffer in place (a torch uint8 view through ``.numpy()``,
a numpy array, a memoryview, bytes). Its value is never 0 nor negative, which leaves room for what
a piece may hold instead of one:

* ``NONE`` (0): none was recorded (a piece loaded from a record without one, say); ``matches``
  passes it.
* ``PENDING``: it is being taken, right after the store's reply (``checksum_lanes``): whoever
  relies on it (a tier write, a verified retrieve) waits for it (``PieceStore.wait_checksums``).
* ``ABANDONED``: it could not be taken (the hash was stuck, or the server stopped first); the piece
  is dropped, and never written to a tier nor served as verified.

``matches`` is for real checksums and ``NONE``: callers wait out ``PENDING`` and refuse
``ABANDONED`` (``known``) first.
"""

from __future__ import annotations

from typing import Any

import xxhash

_xxh3_64 = xxhash.xxh3_64_intdigest

#: What a piece holds in place of a checksum (see the module's note); real ones are >= 1.
NONE = 0
PENDING = -1
ABANDONED = -2


def known(value: int) -> bool:
    """Whether ``value`` is a checksum or ``NONE``: neither being taken nor given up."""
    return value >= NONE


def checksum(buffer: Any) -> int:
    """xxh3-64 of ``buffer``'s bytes (0 mapped to 1: never 0). A tensor is read through
    ``.numpy()`` (a CPU, contiguous view), anything else through the buffer protocol."""
    if hasattr(buffer, "numpy"):
        buffer = buffer.numpy()
    return _xxh3_64(buffer) or 1


def matches(buffer: Any, expected: int) -> bool:
    """Whether ``buffer`` still has checksum ``expected`` (always true for 0: none recorded)."""
    return not expected or checksum(buffer) == expected
