"""``scripts/bench/profile_serve.py --analyse``: a loaded run's traces summed up as documented. The
traces here are written by hand in the tools' format (``EVENT START END THREAD CPU QUEUED DETAIL``;
the connector's by ``connector_trace.py``, the server's by ``server_trace.py``), so each figure has
one right value; the tool runs as a process, as a user runs it on the traces of a real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCHEDULER = """\
lookup 1.000000 1.001000 11 0.900 0.000 req=a computed=0 hit=None async=0
meta 1.002000 1.002100 11 0.100 0.000 idle=0 tokens=100 loads=- stores=-
meta 1.020000 1.020100 11 0.100 0.000 idle=0 tokens=100 loads=- stores=-
meta 1.040000 1.040100 11 0.100 0.000 idle=0 tokens=100 loads=- stores=-
lookup 1.040500 1.041500 11 0.100 0.000 req=b computed=0 hit=256 async=1
lookup 1.041600 1.041700 11 0.100 0.000 req=a computed=0 hit=512 async=0
alloc 1.041800 1.041900 11 0.100 0.000 req=a external=512
lookup 1.042000 1.042100 11 0.100 0.000 req=c computed=0 hit=0 async=0
alloc 1.042200 1.042300 11 0.100 0.000 req=c external=0
meta 1.060000 1.060200 11 0.200 0.000 idle=0 tokens=600 loads=a:2:s,b:1 stores=c:3
meta 1.080000 1.080100 11 0.100 0.000 idle=1 tokens=0 loads=- stores=-
meta 1.100000 1.100100 11 0.100 0.000 idle=0 tokens=4 loads=- stores=-
"""

WORKER = """\
bind 1.060500 1.060600 22 0.100 0.000 idle=0
start_load 1.060600 1.063600 22 0.300 0.000 loads=a:2:s,b:1
save 1.073600 1.073700 22 0.100 0.000 stores=c:3
results 1.073700 1.073800 22 0.100 0.000 sent=- recv=-
bind 1.080500 1.080600 22 0.100 0.000 idle=1
start_load 1.080600 1.080700 22 0.100 0.000 loads=-
save 1.080700 1.080800 22 0.100 0.000 stores=-
results 1.080800 1.085100 22 0.100 0.000 sent=- recv=b
"""

SERVER = """\
dispatch 1.060700 1.060900 1 0.200 0.500 4096
retrieve 1.061000 1.063000 2 1.000 0.000 2
retrieve 1.063500 1.064500 3 1.000 0.250 1
dispatch 1.073900 1.074000 1 0.100 2.500 4096
store 1.075000 1.077000 2 1.500 1.000 3
"""

PINGS = """\
1.075500 1.076000
1.100000 1.100500
1.200000 1.201500
"""

PHASES = {"chat": {"window": [0.5, 2.0], "cpu_s": {"lmcache serve": [1.0, 1.5]},
                   "bench": {"summary": "a test"}}}


@pytest.fixture
def report(tmp_path: Path) -> dict:
    (tmp_path / "connector-1.trace").write_text(SCHEDULER)
    (tmp_path / "connector-2.trace").write_text(WORKER + "results 1.09 1.0")  # cut short: skipped
    (tmp_path / "server.trace").write_text(SERVER)
    (tmp_path / "pings.trace").write_text(PINGS)
    (tmp_path / "phases.json").write_text(json.dumps(PHASES))
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "profile_serve.py"),
                           "--analyse", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "== chat: a test" in proc.stdout
    return dict(json.loads(out.read_text())["chat"])


def test_steps_and_their_forward_pass(report: dict) -> None:
    steps = report["steps"]
    assert (steps["busy"], steps["idle"]) == (5, 1)
    # the step of 1.060: the worker's span 1.0605-1.0738 (13.3 ms) less its connector calls
    # (0.1 + 3.0 + 0.1 + 0.1 ms): a 10 ms forward pass
    assert steps["forward_ms"]["n"] == 1
    assert steps["forward_ms"]["p50"] == pytest.approx(10.0, abs=1e-6)
    assert steps["worker_connector_ms"]["p50"] == pytest.approx(3.3, abs=1e-6)
    assert steps["busy_step_ms"]["max"] == pytest.approx(20.0, abs=1e-6)
    # the calls that scheduled that step: lookups 1.0 + 0.1 + 0.1 ms (b's, a's, c's), allocs
    # 0.1 + 0.1 ms, and meta's own 0.2 ms
    assert steps["scheduler_connector_ms"]["max"] == pytest.approx(1.6, abs=1e-6)


def test_admissions_hits_apart_from_misses(report: dict) -> None:
    hits, misses = report["admissions"]["hit"], report["admissions"]["miss"]
    # a: first looked at 1.000, admitted 1.0418, by the step of 1.060 (20 ms to the next)
    assert hits["queued_ms"]["n"] == 1
    assert hits["queued_ms"]["p50"] == pytest.approx(41.8, abs=1e-6)
    assert hits["admitting_step_ms"]["p50"] == pytest.approx(20.0, abs=1e-6)
    assert misses["queued_ms"]["p50"] == pytest.approx(0.2, abs=1e-6)  # c


def test_lookups_answered_in_their_call_or_steps_later(report: dict) -> None:
    lookups = report["lookups"]
    assert lookups["requests"] == 3
    assert lookups["answered_in_the_call"] == 2  # b and c
    assert lookups["answered_later"] == 1  # a: sent before the first step, answered in the fourth
    assert lookups["steps_later"]["max"] == 3
    assert lookups["with_a_hit_past_vllm"] == 2  # a and b; c's hit is 0


def test_loads_sync_wait_and_async_steps(report: dict) -> None:
    loads = report["loads"]
    assert (loads["sync"], loads["sync_chunks"], loads["async"]) == (1, 2, 1)
    assert loads["sync_wait_ms"]["p50"] == pytest.approx(3.0, abs=1e-6)
    assert loads["async_steps"]["p50"] == 2  # sent with the step of 1.060, reported in 1.080's
    assert loads["async_ms"]["p50"] == pytest.approx(25.1, abs=1e-6)


def test_stores_server_pings_and_cpu(report: dict) -> None:
    stores = report["stores"]
    assert (stores["chunks"], stores["steps_with_stores"]) == (3, 1)
    assert stores["server_cpu_ms_per_chunk"] == pytest.approx(0.5)
    server = report["server"]
    assert server["requests"] == 2
    assert server["cpu_ms_per_loaded_chunk"] == pytest.approx(2.0 / 3)
    assert server["copy_threads_queued_ms_total"] == pytest.approx(1.25)
    assert server["loop_queued_ms"]["max"] == pytest.approx(2.5)
    pings = report["pings"]
    assert pings["while_copying_ms"]["n"] == 1  # sent during the store
    assert pings["quiet_ms"]["n"] == 2
    assert pings["quiet_ms"]["max"] == pytest.approx(1.5, abs=1e-6)
    cpu = report["cpu"]
    assert cpu["lmcache serve"]["cpu_s"] == pytest.approx(0.5)
    assert cpu["lmcache serve"]["cores_busy"] == pytest.approx(0.5 / 1.5)
