"""``Writing``: the pieces being written (a store copying in, a tier load filling), by key, with
their bytes per model and per tenant.

Quotas count these too. Counting only resident pieces let two stores of one tenant, running at
once on two copy threads, both pass its quota. A key is claimed first (``claim``: no room yet, so
a concurrent store of the same key counts it as present) and then either reserved (``reserve``:
pool bytes, a piece in the ``WRITING`` state, counted) or dropped (``unclaim``). Not thread-safe:
the store calls it under its lock.
"""

from __future__ import annotations

from lmcache_core.engine.index import Piece, Tally
from lmcache_core.engine.lifecycle import State
from lmcache_core.keys import ChunkKey


class Writing:
    """Keys being written -> their piece (None: claimed, no room yet); ``models``/``tenants``:
    their pieces and bytes."""

    def __init__(self) -> None:
        self.pieces: dict[ChunkKey, Piece | None] = {}
        self.models = Tally()
        self.tenants = Tally()

    def __contains__(self, key: object) -> bool:
        return key in self.pieces

    def __len__(self) -> int:
        return len(self.pieces)

    def claim(self, key: ChunkKey) -> None:
        self.pieces[key] = None

    def unclaim(self, key: ChunkKey) -> None:
        """Drop a claim that got no pool bytes (a reserved key stays)."""
        if key in self.pieces and self.pieces[key] is None:
            del self.pieces[key]

    def reserve(self, key: ChunkKey, handle: int, nbytes: int, tenant: str = "") -> Piece:
        """The key's piece, being written into pool bytes at ``handle``."""
        piece = Piece(key, handle, nbytes, 0.0, tenant=tenant, state=State.WRITING)
        self.pieces[key] = piece
        self.models.add(key.model_name, nbytes)
        if tenant:
            self.tenants.add(tenant, nbytes)
        return piece

    def release(self, key: ChunkKey) -> Piece:
        """The key is written (or given up): forget it; its piece."""
        piece = self.pieces.pop(key)
        assert piece is not None, "a claim without room has nothing to release"
        self.models.remove(key.model_name, piece.nbytes)
        if piece.tenant:
            self.tenants.remove(piece.tenant, piece.nbytes)
        return piece
