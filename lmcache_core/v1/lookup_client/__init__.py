"""LMCache's ``lmcache.v1.lookup_client``: re-exports ``lmcache_core.lookup_client``'s client classes."""

from lmcache_core.lookup_client import (
    LMCacheAsyncLookupClient,
    LMCacheAsyncLookupServer,
    LookupClientInterface,
)

__all__ = ["LMCacheAsyncLookupClient", "LMCacheAsyncLookupServer", "LookupClientInterface"]
