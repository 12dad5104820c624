"""``IntegrityGuard``: checks pool pieces against the checksum their store recorded, and drops the
ones that fail (memory corruption), so they are never served nor written to a tier.

Every piece gets its checksum (``storage.integrity``: xxh3-64 of its bytes) when its store's bytes
are in, or from the record it was loaded from (verified then); it stays on the ``Piece``. The guard
checks it

* before a tier writer takes a piece's bytes (``source``, bound to the disk and remote writers in
  place of the core's ``reading``): a mismatch writes nothing;
* on retrieve, when ``integrity.verify_on_retrieve`` is on (``verify_retrieve``): a chunk with a
  piece that fails is taken out of the plan and answered ``missing``, so the worker reports its
  blocks as load errors and vLLM recomputes them.

A piece that fails is dropped (``condemn``): out of the index at once (no lookup or retrieve sees
it again), its pool bytes freed now, or by its last reader's release when someone still reads it
(``CacheCore.release_reader``); ``integrity_failures`` counts it, ``integrity_verified_chunks`` the
pieces found intact. Hashing runs outside the core's lock; dict work under it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from lmcache_core.engine.core import MEMORY_TIER, CacheCore
from lmcache_core.engine.index import Piece
from lmcache_core.engine.plans import RetrievePlan
from lmcache_core.keys import ChunkKey
from lmcache_core.storage import integrity


class IntegrityGuard:
    """The checks of one core; thread-safe (its state is guarded by the core's lock)."""

    def __init__(self, core: CacheCore) -> None:
        self.core = core

    # ------------------------------------------------------------------ tier writers

    @contextmanager
    def source(self, key: ChunkKey) -> Iterator[tuple[memoryview, int] | None]:
        """The core's ``reading(key)``, verified: the piece's bytes held for the ``with`` block,
        with their checksum, when they match it (the tier record reuses it: one hash per write);
        None when it is gone or corrupt (then dropped, counted)."""
        core = self.core
        piece: Piece | None = None
        good = False
        with core.reading(key) as held:
            if held is not None:
                # The piece being read, not whatever the key names now (it may have been dropped
                # and stored again meanwhile): its bytes are checked against its own checksum.
                piece, payload = held
                good = integrity.matches(payload, piece.checksum)
                if good:
                    with core.mutex:
                        core.counters.integrity_verified_chunks += 1
            yield (payload, piece.checksum) if good and piece is not None else None
        if piece is not None and not good:
            self.condemn([piece])

    # ------------------------------------------------------------------ retrieve

    def verify_retrieve(self, plan: RetrievePlan) -> list[int]:
        """Check every piece ``plan`` found against its checksum; chunks with a corrupt piece
        leave ``plan.found`` for ``plan.missing`` (their pieces unpinned, the corrupt ones
        dropped). Returns the request indexes that moved."""
        bad_at: list[int] = []
        bad_pieces: list[Piece] = []
        for at, ((_, sources), pieces) in enumerate(zip(plan.found, plan.pieces, strict=True)):
            corrupt = [piece for (view, _, _), piece in zip(sources, pieces, strict=True)
                       if not integrity.matches(view, piece.checksum)]
            if corrupt:
                bad_at.append(at)
                bad_pieces += corrupt
        core = self.core
        with core.mutex:
            core.counters.integrity_verified_chunks += (
                sum(len(pieces) for pieces in plan.pieces) - len(bad_pieces))
            if not bad_at:
                return []
            moved = [plan.found[at][0] for at in bad_at]
            n = core.counters
            for at in reversed(bad_at):
                pieces = plan.pieces.pop(at)
                plan.found.pop(at)
                for piece in pieces:
                    core.release_reader(piece)
                n.retrieved_chunks -= 1
                n.retrieved_bytes -= sum(piece.nbytes for piece in pieces)
                n.retrieve_missing += 1
            plan.missing = sorted(plan.missing + moved)
            self._drop_locked(bad_pieces)
        return moved

    # ------------------------------------------------------------------ dropping

    def condemn(self, pieces: Sequence[Piece]) -> int:
        """Drop ``pieces`` found corrupt (those still indexed); how many were."""
        with self.core.mutex:
            return self._drop_locked(pieces)

    def _drop_locked(self, pieces: Sequence[Piece]) -> int:
        core = self.core
        dropped: list[ChunkKey] = []
        for piece in dict.fromkeys(pieces):  # a piece serving two ranges is dropped once
            if core.index.get(piece.key) is not piece:
                continue  # gone already (another check dropped it)
            core.drop(piece)  # one being read is freed by its last reader
            dropped.append(piece.key)
        core.counters.integrity_failures += len(dropped)
        if core.events is not None and dropped:
            core.events.removed(dropped, MEMORY_TIER)
        return len(dropped)
