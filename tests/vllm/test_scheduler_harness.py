"""vLLM's real scheduler driving our connector (both roles), for the installed vLLM and the newest one.

The newest PyPI ``vllm`` is a CUDA build that cannot run a model here; scripts/test-vllm installs it
with ``--no-deps`` into a separate folder (``LMCACHE_VLLM_NEWEST``) and this test runs its scheduler
with ``VLLM_TARGET_DEVICE=cpu`` through tests/vllm/scheduler_harness.py (a synthetic model). Each
runs a single-group model and hybrid ones (a full-attention group and a sliding-window or a
chunked-local one), whose load made to fail must be reported per request: the scheduler raises
RuntimeError for block-level errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.servers import ServerProcess
from tests.vllm.tiny_model import SERVER, tiny_llama

pytestmark = pytest.mark.timeout(600)
HARNESS = Path(__file__).with_name("scheduler_harness.py")


def _run(tmp: Path, extra_env: dict[str, str], mode: str = "") -> dict[str, Any]:
    server = ServerProcess(tmp, SERVER, name="harness").start()
    out = tmp / "harness.json"
    try:
        env = {**os.environ, **extra_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "PYTHONPATH": os.pathsep.join(
                   p for p in [extra_env.get("PYTHONPATH", ""), str(Path(__file__).parents[2])]
                   if p)}
        args = [str(HARNESS), server.url, str(out), str(tiny_llama()), *([mode] if mode else [])]
        proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                              timeout=500, check=False)
    finally:
        server.stop()
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-6000:]
    return dict(json.loads(out.read_text()))


def _check(result: dict[str, Any], hybrid: bool = False,
           second: str = "SlidingWindowSpec") -> None:
    requests = result["requests"]
    for name, req in requests.items():
        assert req["tokens"] == req["expected"], name
    assert [requests[n]["cached"] for n in "ABC"] == [0, 768, 0]
    # vLLM's prompt_tokens_cached_by_source: our hits are host memory's (B's 3 chunks, and D's,
    # counted when admitted, before its load failed)
    assert result["hits_by_source"] == {"host": 768 * (2 if hybrid else 1)}
    if hybrid:
        assert result["groups"] == ["FullAttentionSpec", second]
        assert result["failed_recving"] == ["D"]  # per request, and recomputed from the start
        assert requests["D"]["cached"] == 0


def _newest(tmp: Path, mode: str = "") -> dict[str, Any]:
    newest = os.environ.get("LMCACHE_VLLM_NEWEST", "")
    if not newest or not (Path(newest) / "vllm").is_dir():
        pytest.skip("no newest vLLM prepared (scripts/test-vllm sets LMCACHE_VLLM_NEWEST)")
    result = _run(tmp, {"PYTHONPATH": newest, "VLLM_TARGET_DEVICE": "cpu"}, mode)
    expected = (Path(newest) / ".lmcache-version").read_text().strip()
    assert result["vllm"] == expected
    return result


def test_installed_vllm_scheduler(tmp_path: Path) -> None:
    _check(_run(tmp_path, {}))


def test_newest_vllm_scheduler(tmp_path: Path) -> None:
    _check(_newest(tmp_path))


def test_installed_vllm_scheduler_hybrid(tmp_path: Path) -> None:
    _check(_run(tmp_path, {}, "hybrid"), hybrid=True)


def test_newest_vllm_scheduler_hybrid(tmp_path: Path) -> None:
    _check(_newest(tmp_path, "hybrid"), hybrid=True)


def _check_wide(result: dict[str, Any]) -> None:
    """A 300-token window at 128-token blocks and 256-token chunks: resuming at chunk 3 needs
    blocks 3-5, its pieces are whole chunks (chunks 1 and 2's), and vLLM gives its null block
    for block 2 (and 0-1): the load leaves it out, and B's tokens come out right (the harness's
    model reads every windowed position's K from the loaded blocks)."""
    _check(result, hybrid=True)
    sliding = result["loads"]["B"][1]  # chunks 0-2 of the sliding group, as vLLM allocated them
    assert sliding[:3] == [0, 0, 0] and 0 not in sliding[3:], sliding
    assert "B" not in result["failed_recving"]


def test_installed_vllm_scheduler_wide_window(tmp_path: Path) -> None:
    _check_wide(_run(tmp_path, {}, "hybrid-wide"))


def test_newest_vllm_scheduler_wide_window(tmp_path: Path) -> None:
    _check_wide(_newest(tmp_path, "hybrid-wide"))


def _check_local(result: dict[str, Any], nulls: int) -> None:
    """Chunked-local attention (Llama 4's): B's hit of 768 tokens needs the local group's blocks
    from its attention chunk's start only (640: block 5, the last of chunk 2's piece; 384: 768
    starts one, nothing), vLLM's null block before it, left out by the load; B's tokens come
    out right (the harness's model reads layer 1's K of its attention chunk from the blocks)."""
    _check(result, hybrid=True, second="ChunkedLocalAttentionSpec")
    local = result["loads"]["B"][1]  # chunks 0-2 of the local group, as vLLM allocated them
    assert local[:nulls] == [0] * nulls and 0 not in local[nulls:], local
    assert len(local) == 6 and "B" not in result["failed_recving"]


@pytest.mark.parametrize(("mode", "nulls"), [("hybrid-local", 5), ("hybrid-local-even", 6)])
def test_installed_vllm_scheduler_chunked_local(tmp_path: Path, mode: str, nulls: int) -> None:
    _check_local(_run(tmp_path, {}, mode), nulls)


@pytest.mark.parametrize(("mode", "nulls"), [("hybrid-local", 5), ("hybrid-local-even", 6)])
def test_newest_vllm_scheduler_chunked_local(tmp_path: Path, mode: str, nulls: int) -> None:
    _check_local(_newest(tmp_path, mode), nulls)
