"""``KVEventSink``: how the cache reports which chunks it stored and removed, tier by tier.

The engine and the tiers call a sink when a chunk becomes present in a tier (``stored``) or leaves it
(``removed``); ``lmcache_core.server.events.KVEventPublisher`` is the one that publishes them for
cache-aware routers. Callers may hold their own locks (the engine calls it under its mutex), so an
implementation must only record the call: no I/O, no waiting, no calling back. Without a sink (None,
the default everywhere) nothing is reported and nothing is paid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from lmcache_core.keys import ChunkKey

#: The ``medium`` of an event: which tier gained or lost the chunks.
MEMORY = "memory"
DISK = "disk"
REMOTE = "remote"


class KVEventSink(Protocol):
    """Takes note of chunks stored into or removed from one tier (``medium``).

    ``keys`` are kept as given (the caller must not change the sequence afterwards); a store's keys
    come in prefix order. Both methods are cheap and never block.
    """

    def stored(self, keys: Sequence[ChunkKey], medium: str) -> None: ...

    def removed(self, keys: Sequence[ChunkKey], medium: str) -> None: ...
