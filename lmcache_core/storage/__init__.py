"""Storage: the L1 memory pool (``pool``), and the optional lower tiers: ``disk`` (L2, chunk files)
and ``remote`` (L3, Redis/Valkey), which share the self-checking ``record`` format and the
write-behind thread of ``writer``; ``tiered`` is what the engine does with them. The tiers are
imported by name where configured, so a memory-only server never imports redis."""

from lmcache_core.storage.pool import MemoryPool

__all__ = ["MemoryPool"]
