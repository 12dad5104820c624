"""tests/lmcache: LMCache 0.5.6's own client adapters against ``lmcache serve`` (scripts/test-lmcache).

They need the ``lmcache`` package (the environment scripts/test-lmcache builds); without it the
tests here are not collected, so the main suite skips them.
"""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = []
if importlib.util.find_spec("lmcache") is None:
    collect_ignore += ["test_lmcache_client.py"]
