"""Chunk checksums: xxh3-64 of a piece's bytes, taken when it is stored and checked whenever its
bytes leave memory for a tier, come back from one, or (``integrity.verify_on_retrieve``) are
copied to a worker.

``checksum`` never copies: it hashes the buffer in place (a torch uint8 view through ``.numpy()``,
a numpy array, a memoryview, bytes). Its value is never 0, so 0 means "no checksum" (a piece stored
before checksums were taken, say), and ``matches`` passes such a piece.
"""

from __future__ import annotations

from typing import Any

import xxhash

_xxh3_64 = xxhash.xxh3_64_intdigest


def checksum(buffer: Any) -> int:
    """xxh3-64 of ``buffer``'s bytes (0 mapped to 1: never 0). A tensor is read through
    ``.numpy()`` (a CPU, contiguous view), anything else through the buffer protocol."""
    if hasattr(buffer, "numpy"):
        buffer = buffer.numpy()
    return _xxh3_64(buffer) or 1


def matches(buffer: Any, expected: int) -> bool:
    """Whether ``buffer`` still has checksum ``expected`` (always true for 0: none recorded)."""
    return not expected or checksum(buffer) == expected
