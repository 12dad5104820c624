"""The connector's one logger: ``vllm.lmcache_connector``, a child of vLLM's own.

vLLM configures only its ``vllm`` logger (its handler and format, ``VLLM_LOGGING_LEVEL``) and keeps
the root logger bare, so a plugin's logger outside that namespace is silent below WARNING inside
``vllm serve``: the line that says what this engine's chunk keys depend on, the one a user needs
when its hits are 0, was never shown. As a child of ``vllm`` every connector line goes where
vLLM's go, formatted as they are, at the level vLLM's are set to.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "vllm.lmcache_connector"
logger = logging.getLogger(LOGGER_NAME)
