"""The messages of EXPLAIN (``lmcache lookup --explain``): where the server holds a prompt's chunk
hashes under names other than the ones a lookup asked for, and what it knows of the asked model,
so the CLI can name why a lookup misses. Beside :mod:`.messages`, on its types.

The CLI hashes each variant of a prompt it wants checked (the asked chunk size and seed; the
prompt unsalted; other chunk sizes) and sends the first chunk hash of each as a probe: one hash
names the whole prefix before it, so it is enough to tell who holds that prefix.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmcache_core.protocol.messages import ChunkHash, LayoutQuery, Name, Reply, WorldSize

#: Probes one EXPLAIN may carry: the CLI sends a few dozen (one per chunk size it tries, and the
#: unsalted twins); each costs one dict look-up per (model, layout) the server holds, and a few
#: Redis keys.
MAX_EXPLAIN_PROBES = 128
ExplainProbes = Annotated[list[ChunkHash], msgspec.Meta(min_length=1, max_length=MAX_EXPLAIN_PROBES)]


class ExplainRequest(LayoutQuery, kw_only=True):
    """Who holds each of ``probes`` (in any model and layout, in memory, on disk and in Redis),
    and what the server knows of ``model_name``. Nothing is loaded, locked, LRU-touched or
    counted (as PEEK). ``layout`` / ``hint_layout``: the asked layout (as ``PeekRequest``'s),
    asked of Redis first."""

    model_name: Name
    world_size: WorldSize
    probes: ExplainProbes

    def num_keys(self) -> int:
        return len(self.probes)


class ProbeHolder(msgspec.Struct, kw_only=True):
    """Probe ``probe`` (its index in the request) is held under ``model_name`` and ``layout`` in
    ``tier``, as pieces of the head ranges ``heads`` (for Redis: the ranges asked that were
    there), stored for the tenant tags ``tenants`` (memory only: lower tiers keep no tenant)."""

    probe: int
    model_name: str
    layout: str
    tier: str
    heads: list[tuple[int, int]]
    tenants: list[str] = msgspec.field(default_factory=list)


class RegisteredShape(msgspec.Struct, kw_only=True):
    """Workers registered for the asked model in one layout and world size."""

    layout: str
    world_size: int
    workers: int


class TenantPieces(msgspec.Struct, kw_only=True):
    """Pieces of the asked model in memory stored for one tenant tag (``keys.tenant_tag``)."""

    tenant: str
    pieces: int


class ExplainReply(Reply):
    """Per probe, where it is held (``holders``); of the asked model: its pieces in memory, the
    layouts it holds in memory or on disk, its registered workers, its stores by hash mode
    (``StoreRequest.hash_mode``: "vllm", "tokens", "" for not said), its pieces per tenant tag.
    ``remote``: Redis's state as ``PeekReply.remote`` ("cut": more keys than one explain asks);
    ``cut``: more (model, layout) pairs, or holders, than one explain looks through."""

    holders: list[ProbeHolder]
    pieces: int = 0
    layouts: list[str] = msgspec.field(default_factory=list)
    registered: list[RegisteredShape] = msgspec.field(default_factory=list)
    hash_modes: dict[str, int] = msgspec.field(default_factory=dict)
    tenants: list[TenantPieces] = msgspec.field(default_factory=list)
    remote: str = ""
    cut: bool = False
