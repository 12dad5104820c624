"""Which KV layout a request's chunk keys are in, when the request does not say.

A lookup or pin names a model and a world size; the fingerprint comes from the request's own
``layout``, else from the workers registered with that model and world size, else from every layout
the server holds for the model (the CLI's case). With several candidates, the one whose resident
pieces hold most of the prefix wins; that count touches nothing (no LRU move, no counter, no lock),
so only the lookup that follows is seen.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_core.engine import CacheEngine
from lmcache_core.keys import HeadRange, opaque_layout, world_heads
from lmcache_core.server.registry import KVRegistry

#: A layout and the head range of each rank of the request's world size in it.
Target = tuple[str, tuple[HeadRange, ...]]


class LayoutResolver:
    """Resolves requests' layouts against one engine and registry."""

    def __init__(self, engine: CacheEngine, registry: KVRegistry) -> None:
        self.engine = engine
        self.registry = registry

    def candidates(self, model_name: str, world_size: int, layout: str | None) -> list[Target]:
        """Every candidate layout whose heads divide among ``world_size`` ranks (a layout they
        do not divide in never holds a hit for it)."""
        names = ([layout] if layout is not None
                 else self.registry.layouts(model_name, world_size)
                 or self.engine.layouts(model_name) or [opaque_layout(world_size)])
        out: list[Target] = []
        for name in names:
            try:
                out.append((name, world_heads(name, world_size)))
            except ValueError:
                continue
        return out

    def best(self, model_name: str, world_size: int, layout: str | None,
             chunk_hashes: Sequence[bytes]) -> Target | None:
        """The candidate to look up (or pin) in; None when there is none."""
        targets = self.candidates(model_name, world_size, layout)
        if len(targets) > 1:
            return max(targets, key=lambda target: self.engine.held(
                model_name, target[0], target[1], chunk_hashes))
        return targets[0] if targets else None
