"""Storage: the L1 memory pool (lower tiers such as disk and Redis will live here too)."""

from lmcache_core.storage.pool import MemoryPool

__all__ = ["MemoryPool"]
