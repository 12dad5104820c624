"""``Writing``: the pieces being written (a store copying in, a tier load filling), by key, with
their bytes per model and per tenant.

Quotas count these too. Counting only resident pieces let two stores of one tenant, running at
once on two copy threads, both pass its quota. A key is claimed first (``claim``: no handle yet, so
a concurrent store of the same key counts it as present) and then either reserved (``reserve``:
pool bytes, counted) or dropped (``unclaim``).
"""

from __future__ import annotations

from lmcache_core.engine.index import Tally
from lmcache_core.keys import ChunkKey

_CLAIMED = -1  # claimed by a store deciding its room; no pool bytes yet


class Writing:
    """Keys being written -> pool handle; ``models``/``tenants``: their pieces and bytes."""

    def __init__(self) -> None:
        self.handles: dict[ChunkKey, int] = {}
        self.models = Tally()
        self.tenants = Tally()
        self._sizes: dict[ChunkKey, tuple[int, str]] = {}  # reserved keys: (bytes, tenant)

    def __contains__(self, key: object) -> bool:
        return key in self.handles

    def __len__(self) -> int:
        return len(self.handles)

    def claim(self, key: ChunkKey) -> None:
        self.handles[key] = _CLAIMED

    def unclaim(self, key: ChunkKey) -> None:
        """Drop a claim that got no pool bytes (a reserved key stays)."""
        if self.handles.get(key) == _CLAIMED:
            del self.handles[key]

    def reserve(self, key: ChunkKey, handle: int, nbytes: int, tenant: str = "") -> None:
        self.handles[key] = handle
        self._sizes[key] = (nbytes, tenant)
        self.models.add(key.model_name, nbytes)
        if tenant:
            self.tenants.add(tenant, nbytes)

    def release(self, key: ChunkKey) -> int:
        """The key is written (or given up): forget it; its pool handle."""
        handle = self.handles.pop(key)
        nbytes, tenant = self._sizes.pop(key)
        self.models.remove(key.model_name, nbytes)
        if tenant:
            self.tenants.remove(tenant, nbytes)
        return handle
