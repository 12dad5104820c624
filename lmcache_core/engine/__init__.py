"""The cache engine: an index of chunk pieces over the memory pool, its locks and eviction, and
the lower tiers and in-process async lookups composed around it.

Modules, each with one job (imports run down this list): ``index`` (pieces by key, chunk and
handle; ``cover``), ``locks`` (lookup locks with a TTL), ``retention`` (TTLs, pins, priorities and
the order eviction takes pieces in), ``plans`` (store/retrieve plans, counters), ``eviction``
(which pieces go), ``core`` (``CacheCore``: lookup, store, retrieve), ``loading`` (what the tiers
ask of the core), ``verify`` (checksums checked, corrupt pieces dropped), ``tiered`` (disk and
Redis around the core), ``async_lookup`` (the in-process lookups' prefetch), ``cache``
(``CacheEngine``: all of it composed, pins, admin views).
"""

from lmcache_core.engine.cache import SORTS, CacheEngine
from lmcache_core.engine.core import MEMORY_TIER, CacheCore
from lmcache_core.engine.plans import Counters, RetrievePlan, StorePlan
from lmcache_core.engine.retention import PLAIN, Retention

__all__ = ["MEMORY_TIER", "PLAIN", "SORTS", "CacheCore", "CacheEngine", "Counters", "Retention",
           "RetrievePlan", "StorePlan"]
