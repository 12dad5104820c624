"""In-process async lookup: the scheduler's client and each worker's server, over PUSH/PULL ipc://.

The client (scheduler) hashes a prompt into chunk hashes and asks every lookup-server worker; each
server asks its worker's ``CacheEngine`` for its own rank's cached prefix, pins it and answers; the
client reports the minimum. Nothing here imports torch.
"""

from lmcache_core.lookup_client.abstract_client import LookupClientInterface
from lmcache_core.lookup_client.client import LMCacheAsyncLookupClient
from lmcache_core.lookup_client.config import LMCacheEngineConfig, LMCacheMetadata
from lmcache_core.lookup_client.messages import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
)
from lmcache_core.lookup_client.server import LMCacheAsyncLookupServer, LookupEngine

__all__ = [
    "LMCacheAsyncLookupClient",
    "LMCacheAsyncLookupServer",
    "LMCacheEngineConfig",
    "LMCacheMetadata",
    "LookupCleanupMsg",
    "LookupClientInterface",
    "LookupEngine",
    "LookupRequestMsg",
    "LookupResponseMsg",
]
