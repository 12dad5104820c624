"""Storage: the L1 memory pool (``pool``), and the optional lower tiers: ``disk`` (L2, chunk files)
and ``remote`` (L3, Redis/Valkey), which share the self-checking ``record`` format and the
write-behind thread of ``writer``; ``tiered`` is what the engine does with them.

This package imports nothing itself: import the module you need (``lmcache_core.storage.pool``
imports torch, ``lmcache_core.storage.remote`` imports redis), so that loading a config with
``disk:`` or ``remote:`` sections (``config_parse.parse_remote_url`` checks the url) costs
neither."""
