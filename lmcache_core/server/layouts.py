"""Which KV layout a request's chunk keys are in, when the request does not say.

A lookup or pin names a model and a world size; the fingerprint comes from the request's own
``layout``, else from the workers registered with that model and world size, else from every layout
the server holds for the model (the CLI's case). With several candidates, the one whose resident
pieces hold most of the prefix wins; that count touches nothing (no LRU move, no counter, no lock),
so only the lookup that follows is seen.

A hybrid model's workers register each KV-cache group on its own (``RegisterKVCacheRequest.group``):
a lookup that names no layout then counts in every group of theirs together (``groups``).
"""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.keys import HeadRange, group_piece, layout_group, opaque_layout, world_heads
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
                 else _whole(self.registry.layouts(model_name, world_size))
                 or _whole(self.engine.layouts(model_name)) or [opaque_layout(world_size)])
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

    def groups(self, model_name: str, world_size: int) -> list[GroupTarget] | None:
        """The KV-cache groups of the hybrid model registered with this name and world size, as a
        lookup counts them; None when its workers registered no groups, [] when they do not
        (yet) cover every group index or a group's heads do not divide among the ranks (then
        nothing can be restored: a miss)."""
        registered = self.registry.groups(model_name, world_size)
        if not registered:
            return None
        counts = {group.count for _, group in registered}
        if len(counts) != 1 or {group.index for _, group in registered} != set(range(*counts)):
            return []
        out: list[GroupTarget] = []
        for layout, group in sorted(registered, key=lambda item: item[1].index):
            piece = group_piece(self.engine.chunk_size, group.block_size, group.kind,
                                group.window_tokens)
            try:
                out.append(GroupTarget(layout, world_heads(layout, world_size),
                                       piece.window_chunks, piece.local_blocks,
                                       piece.blocks_per_chunk))
            except ValueError:
                return []
        return out


def _whole(layouts: list[str]) -> list[str]:
    """The layouts that hold whole chunks: a hybrid model's group layouts are left out (one
    group's pieces never make a hit alone; ``groups`` counts them together)."""
    return [name for name in layouts if layout_group(name) is None]
