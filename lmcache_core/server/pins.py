"""The PIN and UNPIN handlers of ``lmcache serve``: keep a prefix's pieces from eviction by hand.

A pin names a prefix as a lookup does (model, world size, chunk hashes, optional layout) and pins the
leading chunks every rank holds; pins are bounded by ``server.max_pinned`` bytes: past it the engine
raises ``PinLimitError`` (code ``pin_limit``) and pins nothing. With no layout given it is resolved as
for a lookup; with several candidates, PIN takes the one holding most of the prefix and UNPIN all.
A hybrid model's pin covers the pieces of every KV-cache group a hit of the prefix needs.
"""

from __future__ import annotations

from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.protocol import pin_messages as pm
from lmcache_core.server.layouts import LayoutResolver


class PinHandlers:
    """PIN / UNPIN over one engine; ``layouts`` resolves a request's layout as for a lookup."""

    def __init__(self, engine: CacheEngine, layouts: LayoutResolver) -> None:
        self.engine = engine
        self.layouts = layouts

    def pin(self, request: pm.PinRequest, _client: bytes) -> pm.PinReply:
        groups = self._groups(request)
        if groups is not None:
            return pm.PinReply(pinned=self.engine.pin_groups(
                request.model_name, groups, request.chunk_hashes, ttl_s=request.ttl_s))
        target = self.layouts.best(request.model_name, request.world_size, request.layout,
                                   request.chunk_hashes)  # where most of the prefix is held
        if target is None:
            return pm.PinReply(pinned=0)
        layout, ranges = target
        return pm.PinReply(pinned=self.engine.pin(request.model_name, layout, ranges,
                                                  request.chunk_hashes, ttl_s=request.ttl_s))

    def unpin(self, request: pm.PinRequest, _client: bytes) -> pm.UnpinReply:
        groups = self._groups(request)
        if groups is not None:
            return pm.UnpinReply(unpinned=self.engine.unpin_groups(
                request.model_name, groups, request.chunk_hashes))
        unpinned = 0
        for layout, ranges in self.layouts.candidates(request.model_name, request.world_size,
                                                      request.layout):
            unpinned += self.engine.unpin(request.model_name, layout, ranges,
                                          request.chunk_hashes)
        return pm.UnpinReply(unpinned=unpinned)

    def _groups(self, request: pm.PinRequest) -> list[GroupTarget] | None:
        """A hybrid model's KV-cache groups (when the request names no layout), else None."""
        if request.layout is not None:
            return None
        return self.layouts.groups(request.model_name, request.world_size)
