"""``IntegrityGuard``: checks pool pieces against the checksum their store recorded, and has the
store drop the ones that fail (memory corruption), so they are never served nor written to a tier.

Every piece gets its checksum (``storage.integrity``: xxh3-64 of its bytes) right after its store's
bytes are in (taken off the store's reply path: ``storage.checksum_lanes``; ``PENDING`` meanwhile),
or from the record it was loaded from (verified then); it stays on the ``Piece``. The guard waits
for a pending one (``PieceStore.wait_checksums``, bounded) and checks it

* before a tier writer takes a piece's bytes (``source``, bound to the disk and remote writers in
  place of the store's ``reading``): a mismatch writes nothing, and neither does a checksum not
  taken in time (no tier record is ever written without one);
* on retrieve, when ``integrity.verify_on_retrieve`` is on (``verify_retrieve``): a chunk with a
  piece that fails, or whose checksum was not taken in time, is taken out of the plan and answered
  ``missing``, so the worker reports its blocks as load errors and vLLM recomputes them.

A piece that fails is condemned (``PieceStore.condemn``): out of the index at once (no lookup or
retrieve sees it again), its pool bytes freed now, or by its last reader's release when someone
still reads it; ``integrity_failures`` counts it, ``integrity_verified_chunks`` the pieces found
intact. Hashing runs outside the store's lock; the store does the rest, under it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from lmcache_core.engine.index import Piece
from lmcache_core.engine.plans import RetrievePlan
from lmcache_core.engine.store import PieceStore
from lmcache_core.keys import ChunkKey
from lmcache_core.storage import integrity
from lmcache_core.storage.checksum_lanes import LANE_TIMEOUT_S


class IntegrityGuard:
    """The checks of one store; thread-safe (it holds no state of its own)."""

    def __init__(self, store: PieceStore) -> None:
        self._store = store

    # ------------------------------------------------------------------ tier writers

    @contextmanager
    def source(self, key: ChunkKey) -> Iterator[tuple[memoryview, int] | None]:
        """The store's ``reading(key)``, verified: the piece's bytes held for the ``with`` block,
        with their checksum, when they match it (the tier record reuses it: one hash per write);
        None when it is gone or corrupt (then condemned, counted)."""
        store = self._store
        piece: Piece | None = None
        good = bad = False
        with store.reading(key) as held:
            if held is not None:
                # The piece being read, not whatever the key names now (it may have been dropped
                # and stored again meanwhile): its bytes are checked against its own checksum,
                # once it is taken (not in time, or given up: nothing is written).
                piece, payload = held
                store.wait_checksums([piece], LANE_TIMEOUT_S)
                if integrity.known(piece.checksum):
                    good = integrity.matches(payload, piece.checksum)
                    bad = not good
                if good:
                    store.count_verified(1)
            yield (payload, piece.checksum) if good and piece is not None else None
        if piece is not None and bad:
            store.condemn([piece])

    # ------------------------------------------------------------------ retrieve

    def verify_retrieve(self, plan: RetrievePlan, timeout_s: float = LANE_TIMEOUT_S) -> list[int]:
        """Check every piece ``plan`` found against its checksum, waiting at most ``timeout_s``
        for those still being taken; chunks with a corrupt piece, or one whose checksum is not
        there by then, leave ``plan.found`` for ``plan.missing`` (their pieces released, the
        corrupt ones condemned). Returns the request indexes that moved."""
        self._store.wait_checksums([p for pieces in plan.pieces for p in pieces], timeout_s)
        bad_at: list[int] = []
        bad_pieces: list[Piece] = []
        unchecked = 0
        for at, ((_, sources), pieces) in enumerate(zip(plan.found, plan.pieces, strict=True)):
            held = list(zip(sources, pieces, strict=True))
            untaken = sum(1 for _, piece in held if not integrity.known(piece.checksum))
            corrupt = [piece for (view, _, _), piece in held if integrity.known(piece.checksum)
                       and not integrity.matches(view, piece.checksum)]
            if corrupt or untaken:
                bad_at.append(at)
                bad_pieces += corrupt
                unchecked += untaken
        return self._store.retire_corrupt(plan, bad_at, bad_pieces, unchecked)

    def condemn(self, pieces: Sequence[Piece]) -> int:
        """Drop ``pieces`` found corrupt (those still indexed); how many were."""
        return self._store.condemn(pieces)
