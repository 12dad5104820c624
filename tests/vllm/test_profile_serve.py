"""``scripts/bench/profile_serve.py`` against a real ``vllm serve``: the traced connector
(``connector_trace.py``) must leave vLLM serving as the connector does, and the traces of a real
run must fill the timeline (steps with their forward pass, every request's lookup, the hits'
synchronous loads, the stores, the server's copies, each process's CPU). vLLM's connector API
moves every release; this is where a tracer out of step with it shows (a call's details it can no
longer read are written as ``detail-error``). Small sizes: 3 users x 3 turns one at a time, on a
KV cache of 12 blocks (each user's next turn finds its history evicted from vLLM's cache, not the
server's), then 2 distinct prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "scripts" / "bench" / "profile_serve.py"


def test_a_traced_run_fills_the_timeline(tmp_path: Path) -> None:
    work, out = tmp_path / "traces", tmp_path / "report.json"
    args = ["--users", "3", "--turns", "3", "--message-words", "300", "--output-tokens", "8",
            "--concurrency", "1", "--distinct", "2", "--distinct-words", "600", "--rate", "4",
            "--kv-blocks", "12",
            "--work", str(work), "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=800, env=env, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    traces = "".join(f.read_text() for f in work.glob("connector-*.trace"))
    assert "detail-error" not in traces, [line for line in traces.splitlines()
                                          if "detail-error" in line][:5]
    report = json.loads(out.read_text())
    chat, distinct = report["chat"], report["distinct"]
    assert chat["bench"]["summary"].startswith("9 requests, 0 failed"), chat["bench"]
    assert chat["steps"]["busy"] > 0 and chat["steps"]["forward_ms"]["n"] > 0, chat["steps"]
    assert chat["lookups"]["requests"] == 9, chat["lookups"]
    # turns 2 and 3 reuse their history (300-word messages: a 256-token chunk each turn at least)
    assert chat["lookups"]["with_a_hit_past_vllm"] >= 1, chat["lookups"]
    assert chat["admissions"]["hit"]["queued_ms"]["n"] >= 1, chat["admissions"]
    assert chat["loads"]["sync"] + chat["loads"]["async"] >= 1, chat["loads"]
    assert chat["stores"]["chunks"] >= 3 and chat["server"]["cpu_ms_per_loaded_chunk"], chat
    assert chat["pings"]["quiet_ms"]["n"] > 0, chat["pings"]
    assert "lmcache serve" in chat["cpu"], chat["cpu"]
    assert distinct["lookups"]["requests"] == 2 and distinct["stores"]["chunks"] >= 2, distinct
