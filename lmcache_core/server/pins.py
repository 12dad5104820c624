"""The PIN and UNPIN handlers of ``lmcache serve``: keep a prefix's pieces from eviction by hand.

A pin names a prefix as a lookup does (model, world size, chunk hashes, optional layout) and pins the
leading chunks every rank holds; pins are bounded by ``server.max_pinned`` bytes: past it the engine
raises ``PinLimitError`` (code ``pin_limit``) and pins nothing. With no layout given it is resolved as
for a lookup; with several candidates, PIN takes the one holding most of the prefix and UNPIN all.
A hybrid model's pin covers the pieces of every KV-cache group a hit of the prefix needs.
"""

from __future__ import annotations

from lmcache_core.engine import PieceStore
from lmcache_core.protocol import pin_messages as pm
from lmcache_core.server.layouts import LayoutResolver


class PinHandlers:
    """PIN / UNPIN over one store; ``layouts`` resolves a request's layout as for a lookup."""

    def __init__(self, store: PieceStore, layouts: LayoutResolver) -> None:
        self.store = store
        self.layouts = layouts

    def pin(self, request: pm.PinRequest, _client: bytes) -> pm.PinReply:
        groups = self.layouts.resolve(request.model_name, request.world_size, request.layout,
                                      request.chunk_hashes)  # where most of the prefix is held
        if not groups:
            return pm.PinReply(pinned=0)
        return pm.PinReply(pinned=self.store.pin(request.model_name, groups,
                                                 request.chunk_hashes, ttl_s=request.ttl_s))

    def unpin(self, request: pm.PinRequest, _client: bytes) -> pm.UnpinReply:
        model, hashes = request.model_name, request.chunk_hashes
        groups = (self.layouts.groups(model, request.world_size) if request.layout is None
                  else None)
        if groups is not None:  # a hybrid model's
            return pm.UnpinReply(unpinned=self.store.unpin(model, groups, hashes))
        return pm.UnpinReply(unpinned=sum(
            self.store.unpin(model, [target], hashes)
            for target in self.layouts.candidates(model, request.world_size, request.layout)))
