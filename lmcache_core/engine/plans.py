"""What a store or retrieve reserved in the engine (plans), and the engine's counters.

Callers copy bytes between ``begin_*`` and ``finish_*``; a plan says where: a store's pool views to
fill, a retrieve's pieces to copy out of per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmcache_core.engine.retention import PLAIN, Retention
from lmcache_core.keys import ChunkKey, HeadRange
from lmcache_core.stats import EngineStats

if TYPE_CHECKING:
    import torch

    from lmcache_core.engine.index import ChunkId, Piece

#: A piece to copy out of: ``(pool view, head_lo, head_hi)``.
Source = tuple["torch.Tensor", int, int]


#: The engine's figures (``stats.EngineStats``): its counters, added to in place under the engine's
#: lock, and the gauges ``CacheEngine.snapshot`` fills in when they are read.
Counters = EngineStats


@dataclass(slots=True, eq=False)
class StorePlan:
    """What ``begin_store`` reserved: write into ``writes`` (index, key, pool view), then finish.

    ``stored``/``already_present``/``skipped_full``/``skipped_quota`` fill a ``StoreReply``.
    """

    nbytes: int
    writes: list[tuple[int, ChunkKey, torch.Tensor]]
    already_present: int = 0
    skipped_full: int = 0
    skipped_quota: int = 0
    pin_refused: int = 0  # pieces kept unpinned: pins would pass max_pinned
    retention: Retention = PLAIN
    tenant: str = ""  # the cache_salt tenant its pieces are stored for (``keys.tenant_tag``)
    keys: list[ChunkKey] = field(default_factory=list, repr=False)
    handles: list[int] = field(default_factory=list, repr=False)
    # Per piece of ``writes``, its checksum (``storage.integrity``), filled once its bytes are in
    # (outside the lock) and kept on the piece at commit; empty: none recorded (or, committed with
    # ``checksums_pending``, taken after: ``PieceStore.record_checksums``).
    checksums: list[int] = field(default_factory=list, repr=False)
    # The committed pieces whose checksums are still being taken (each held by its hash).
    hashing: list[Piece] = field(default_factory=list, repr=False)
    done: bool = False

    @property
    def stored(self) -> int:
        return len(self.writes)


@dataclass(slots=True, eq=False)
class RetrievePlan:
    """What ``begin_retrieve`` found for head range ``heads``: per request index, the pieces to
    copy out of. A chunk whose one piece is exactly ``heads`` is ``exact`` (a plain scatter);
    others need head-range copies. ``missing``: request indexes not covered (not loaded)."""

    lookup_id: str
    heads: HeadRange
    found: list[tuple[int, list[Source]]]
    missing: list[int]
    pieces: list[list[Piece]] = field(default_factory=list, repr=False)
    chunks: list[ChunkId] = field(default_factory=list, repr=False)
    done: bool = False

    @property
    def retrieved(self) -> int:
        return len(self.found)

    def is_exact(self, position: int) -> bool:
        """Whether ``found[position]`` is one piece of exactly ``heads``."""
        sources = self.found[position][1]
        return len(sources) == 1 and (sources[0][1], sources[0][2]) == self.heads
