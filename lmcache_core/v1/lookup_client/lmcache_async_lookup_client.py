"""The async-lookup seed's import path: re-exports the classes of ``lmcache_core.lookup_client``."""

from lmcache_core.lookup_client import (
    LMCacheAsyncLookupClient,
    LMCacheAsyncLookupServer,
    LMCacheEngineConfig,
    LMCacheMetadata,
    LookupClientInterface,
)

__all__ = ["LMCacheAsyncLookupClient", "LMCacheAsyncLookupServer", "LMCacheEngineConfig",
           "LMCacheMetadata", "LookupClientInterface"]
