"""A stand-in for ``kv.mapped.MappedKVCache`` in registry tests: what ``KVRegistry`` and the
handlers read of a worker's mapping (its device, its chunk's bytes and blocks) and whether it was
closed."""

from __future__ import annotations


class FakeMapping:
    device = None
    chunk_bytes = 1
    blocks_per_chunk = 1

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True
