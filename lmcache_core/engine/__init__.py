"""The cache engine: an index of chunk pieces over the memory pool, its locks and eviction, and
the lower tiers and in-process async lookups composed around it.

Modules, each with one job (imports run down this list): ``index`` (pieces by key, chunk and
handle; ``cover``), ``locks`` (lookup locks with a TTL), ``plans`` (store/retrieve plans,
counters), ``eviction`` (which pieces go), ``core`` (``CacheCore``: lookup, store, retrieve, and
what the tiers may call), ``tiered`` (disk and Redis around the core), ``async_lookup`` (the
in-process lookups' prefetch), ``cache`` (``CacheEngine``: all of it composed, plus admin views).
"""

from lmcache_core.engine.cache import SORTS, CacheEngine
from lmcache_core.engine.core import MEMORY_TIER, CacheCore
from lmcache_core.engine.plans import Counters, RetrievePlan, StorePlan

__all__ = ["MEMORY_TIER", "SORTS", "CacheCore", "CacheEngine", "Counters", "RetrievePlan",
           "StorePlan"]
