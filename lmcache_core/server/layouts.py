"""Which KV layout a request's chunk keys are in, when the request does not say.

A lookup or pin names a model and a world size; the fingerprint comes from the request's own
``layout``, else from the workers registered with that model and world size, else from every layout
the server holds for the model (the CLI's case). With several candidates, the one whose resident
pieces hold most of the prefix wins; that count touches nothing (no LRU move, no counter, no lock),
so only the lookup that follows is seen.

A hybrid model's workers register each KV-cache group on its own (``RegisterKVCacheRequest.group``):
a lookup that names no layout then counts in every group of theirs together (``groups``). Either
way a request's target is a list of groups (``engine.GroupTarget``; a model of one layout is one
full-attention group), which the store's one lookup, pin and peek take (``resolve``).
"""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_core.engine import GroupTarget, PieceStore
from lmcache_core.keys import group_piece, layout_group, opaque_layout, world_heads
from lmcache_core.server.registry import KVRegistry


class LayoutResolver:
    """Resolves requests' layouts against one store and registry."""

    def __init__(self, store: PieceStore, registry: KVRegistry) -> None:
        self.store = store
        self.registry = registry

    def resolve(self, model_name: str, world_size: int, layout: str | None,
                chunk_hashes: Sequence[bytes]) -> list[GroupTarget]:
        """The groups a lookup (or pin) of the request counts in: a hybrid model's registered
        groups when it names no layout (``groups``), else the best candidate layout (``best``);
        [] when there is nothing to count in (a miss)."""
        if layout is None:
            groups = self.groups(model_name, world_size)
            if groups is not None:
                return groups
        best = self.best(model_name, world_size, layout, chunk_hashes)
        return [best] if best is not None else []

    def candidates(self, model_name: str, world_size: int,
                   layout: str | None) -> list[GroupTarget]:
        """Every candidate layout whose heads divide among ``world_size`` ranks (a layout they
        do not divide in never holds a hit for it), each as one full group of every rank's
        head range."""
        names = ([layout] if layout is not None
                 else _whole(self.registry.layouts(model_name, world_size))
                 or _whole(self.store.layouts(model_name)) or [opaque_layout(world_size)])
        out: list[GroupTarget] = []
        for name in names:
            try:
                out.append(GroupTarget(name, world_heads(name, world_size)))
            except ValueError:
                continue
        return out

    def best(self, model_name: str, world_size: int, layout: str | None,
             chunk_hashes: Sequence[bytes]) -> GroupTarget | None:
        """The candidate to look up (or pin) in: the one whose resident pieces hold most of the
        prefix; None when there is none."""
        targets = self.candidates(model_name, world_size, layout)
        if len(targets) > 1:
            return max(targets, key=lambda target: self.store.held(
                model_name, [target], chunk_hashes))
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
            piece = group_piece(self.store.chunk_size, group.block_size, group.kind,
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
