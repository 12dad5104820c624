"""lmcache_core: a KV-cache server and its client libraries for LLM serving.

Layers, imported one way only: errors/config/keys -> protocol -> transport -> storage/kv/engine
-> server, lookup_client -> integration (adapters). Nothing below ``kv``/``engine`` imports torch.
"""

__version__ = "0.1.0"
