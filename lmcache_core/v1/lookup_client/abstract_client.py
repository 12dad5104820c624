"""LMCache's ``lmcache.v1.lookup_client.abstract_client``: re-exports ``LookupClientInterface``."""

from lmcache_core.lookup_client.abstract_client import LookupClientInterface

__all__ = ["LookupClientInterface"]
