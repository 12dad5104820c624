"""Right under load: a real ``vllm serve`` with the connector, many users at once, against the same
``vllm serve`` alone.

Runs ``scripts/bench/bench_serve.py`` as the tool it is (small sizes; the speed targets are the
benchmark's, docs/benchmarks.md) with ``--check``: 4 users x 4 turns of chat, 4 in flight, on a KV
cache of 11 usable blocks (vLLM preempts), a quarter of the requests closed by the client after
their first token, and ``lmcache serve`` killed (SIGKILL) after the first turn's lookups and
started again. Every answer that came whole must be the one vLLM alone gave (greedy decoding, the
same seed), no request may fail (the engine recomputes what the dead server cannot give), the
restarted server must serve hits again (the worker registers by itself), and afterwards vLLM must
be idle and the server hold no locks, pins, pending checksums or requests in flight.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(1200)
ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "scripts" / "bench" / "bench_serve.py"


def test_answers_under_load_with_disconnects_preemptions_and_a_server_restart(
        tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    args = ["--configs", "alone,ours", "--users", "4", "--turns", "4", "--message-words", "150",
            "--output-tokens", "96", "--kv-blocks", "12", "--concurrency", "4", "--distinct", "0",
            "--disconnect", "0.25", "--restart-lmcache-after", "4", "--heartbeat-s", "0.5",
            "--check", "--json", str(out), "--work", str(tmp_path / "logs")]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=1100, env=env, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    summary = json.loads(out.read_text())["summary"]
    alone, ours = summary["alone"], summary["ours"]
    for config in (alone, ours):
        assert config["failed"] == 0 and not config["left_behind"], config
        assert config["preemptions"] >= 1, "the KV cache was not small enough to preempt"
    # most of the 16 turns came whole in both runs (a quarter are cut by the client)
    assert ours["answers_compared"] >= 8 and ours["answers_differing"] == 0, ours
    assert ours["restart_hits"] and all(hits > 0 for hits in ours["restart_hits"]), ours


def test_two_engines_sharing_one_server_answer_as_vllm_alone(tmp_path: Path) -> None:
    """Two replicas behind one ``lmcache serve``, a user's next turn on the other replica: the
    second loads what the first stored and must answer exactly as the same two replicas without
    lmcache (every engine once drew the same registration id from vLLM's seeded ``random``,
    and the second engine's loads then read zeros)."""
    out = tmp_path / "replicas.json"
    args = ["--configs", "alone-x2,ours-x2", "--users", "2", "--turns", "3",
            "--message-words", "300", "--output-tokens", "16", "--concurrency", "1",
            "--distinct", "0", "--check", "--json", str(out), "--work", str(tmp_path / "logs")]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=1100, env=env, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    ours = json.loads(out.read_text())["summary"]["ours-x2"]
    assert ours["answers_compared"] == 6 and ours["answers_differing"] == 0, ours
    assert ours["hit_ratio"] and ours["hit_ratio"] > 0, ours  # the other replica's chunks
