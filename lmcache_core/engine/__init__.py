"""The cache engine: one store of chunk pieces over the memory pool (its index, locks, pins and
the pieces' lifecycle), and the integrity guard, lower tiers and in-process async lookups
composed around it.

Modules, each with one job (imports run down this list): ``lifecycle`` (a piece's states and every
transition, one table), ``index`` (pieces by key, chunk and handle; ``cover``), ``writing``
(pieces being written), ``locks`` (lookup locks with a TTL), ``retention`` (TTLs, pins, priorities
and the order eviction takes pieces in), ``plans`` (store/retrieve plans, counters), ``eviction``
(which pieces go: only the room a store needs), ``store`` (``PieceStore``: the one owner of all
that state, its lock private; lookup, store, retrieve, loads, pins, admin), ``verify`` (checksums
waited for when still being taken, checked, corrupt pieces condemned), ``tiered`` (disk and Redis
around the store), ``async_lookup`` (the in-process lookups' prefetch), ``cache``
(``CacheEngine``: the parts composed; only what composes them, callers use the parts).
"""

from lmcache_core.engine.cache import CacheEngine, EngineSnapshot, Holders
from lmcache_core.engine.index import GroupTarget, Holder
from lmcache_core.engine.plans import Counters, RetrievePlan, StorePlan
from lmcache_core.engine.retention import PLAIN, Retention
from lmcache_core.engine.store import MEMORY_TIER, PieceRow, PieceStore

__all__ = ["MEMORY_TIER", "PLAIN", "CacheEngine", "Counters", "EngineSnapshot", "GroupTarget",
           "Holder", "Holders", "PieceRow", "PieceStore", "Retention", "RetrievePlan", "StorePlan"]
