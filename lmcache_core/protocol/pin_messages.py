"""The messages of PIN and UNPIN (``lmcache pin`` / ``lmcache unpin``, the scheduler adapter's
``pin``): keep a prefix's pieces from eviction by hand. Beside :mod:`.messages`, on its types."""

from __future__ import annotations

from lmcache_core.protocol.messages import (
    ChunkHashes,
    LayoutName,
    Message,
    Name,
    Reply,
    TtlSeconds,
    WorldSize,
)


class PinRequest(Message):
    """Pin (PIN) or unpin (UNPIN) the leading chunks of a prefix that ``world_size`` ranks hold, in
    ``layout`` (None: resolved as for a lookup). ``ttl_s``: the pin ends after it (PIN only; None:
    until unpinned). Pins past ``server.max_pinned`` are refused: error ``pin_limit``."""

    model_name: Name
    world_size: WorldSize
    chunk_hashes: ChunkHashes
    layout: LayoutName | None = None
    ttl_s: TtlSeconds | None = None

    def num_keys(self) -> int:
        return len(self.chunk_hashes) * self.world_size


class PinReply(Reply):
    pinned: int  # pieces pinned


class UnpinReply(Reply):
    unpinned: int  # pieces unpinned
