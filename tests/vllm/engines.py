"""A real vLLM engine run in a process of its own (``scripts/bench/engine_runner.py``: vLLM's
engine with this project's connector, driven by a JSON spec of steps), for the engine tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "engine_runner.py"
#: The connector's timeouts in the engine tests (kv_connector_extra_config).
EXTRA = {"connect_timeout_s": 2, "request_timeout_s": 5, "lookup_timeout_s": 1, "heartbeat_s": 2}


def run_engine(tmp: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``scripts/bench/engine_runner.py`` on ``spec`` (its steps) in a process of its own, as
    ``name`` in ``tmp``: its JSON output, with its log under ``"log"``; an AssertionError with the
    log's tail when it fails."""
    spec_path, out_path, log_path = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                          os.environ.get("PYTHONPATH", "")])}
    with log_path.open("w") as log:
        proc = subprocess.run([sys.executable, str(RUNNER), str(spec_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, timeout=600,
                              check=False)
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0 or not out_path.exists():
        raise AssertionError(f"engine {name} exited {proc.returncode}:\n{text[-6000:]}")
    out = json.loads(out_path.read_text())
    out["log"] = text
    return out
