"""The PIN and UNPIN handlers of ``lmcache serve``: keep a prefix's pieces from eviction by hand.

A pin names a prefix as a lookup does (model, world size, chunk hashes, optional layout) and pins the
leading chunks every rank holds; pins are bounded by ``server.max_pinned`` bytes: past it the engine
raises ``PinLimitError`` (code ``pin_limit``) and pins nothing. With no layout given it is resolved as
for a lookup; with several candidates, PIN takes the one holding most of the prefix and UNPIN all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lmcache_core.engine import CacheEngine
from lmcache_core.keys import HeadRange, world_heads
from lmcache_core.protocol import pin_messages as pm


class PinHandlers:
    """PIN / UNPIN over one engine; ``layouts`` resolves a request's candidate layouts."""

    def __init__(self, engine: CacheEngine,
                 layouts: Callable[[pm.PinRequest], list[str]]) -> None:
        self.engine = engine
        self.layouts = layouts

    def pin(self, request: pm.PinRequest, _client: bytes) -> pm.PinReply:
        targets = self._targets(request)
        if len(targets) > 1:  # pin where most of the prefix is held
            targets = [max(targets, key=lambda t: self._held(request, *t))]
        pinned = 0
        for layout, ranges in targets:
            pinned += self.engine.pin(request.model_name, layout, ranges, request.chunk_hashes,
                                      ttl_s=request.ttl_s)
        return pm.PinReply(pinned=pinned)

    def unpin(self, request: pm.PinRequest, _client: bytes) -> pm.UnpinReply:
        unpinned = 0
        for layout, ranges in self._targets(request):
            unpinned += self.engine.unpin(request.model_name, layout, ranges,
                                          request.chunk_hashes)
        return pm.UnpinReply(unpinned=unpinned)

    def _targets(self, request: pm.PinRequest) -> list[tuple[str, Sequence[HeadRange]]]:
        """The candidate layouts whose heads divide among the request's world size."""
        out: list[tuple[str, Sequence[HeadRange]]] = []
        for layout in self.layouts(request):
            try:
                out.append((layout, world_heads(layout, request.world_size)))
            except ValueError:
                continue  # heads that do not divide by this world size: nothing to pin there
        return out

    def _held(self, request: pm.PinRequest, layout: str, ranges: Sequence[HeadRange]) -> int:
        """Leading chunks of the prefix held in memory in ``layout`` (nothing locked or counted
        as a lookup)."""
        with self.engine.mutex:
            return self.engine.lookup_locked(request.model_name, layout, ranges,
                                             request.chunk_hashes, "lmc.pin", False)
