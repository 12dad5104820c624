"""LMCache 0.5.6's dialect as a front end of the server's request pipeline: its routes
(``front``), its registrations (``registrations``), its lookups' results (``prefetch_status``) and
its requests in our terms (``translate``); the wire itself is ``protocol/lmcache_wire.py``."""
