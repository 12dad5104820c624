"""A real vLLM engine against a server made slow on purpose (``server.test_copy_delay_ms``, test-only
fault injection): loads past the deadline (``timeouts.load_ms``) are reported as load errors, vLLM
recomputes those blocks and generates exactly the tokens of an engine without the connector; and
requests with different ``cache_salt``s never hit each other's chunks.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.integration.servers import ServerProcess
from tests.vllm.engines import EXTRA, run_engine
from tests.vllm.tiny_model import CHUNK, SERVER, TINY_LLAMA, tiny_llama

pytestmark = pytest.mark.timeout(1200)

DELAY_MS, DEADLINE_MS = 300, 500  # chunks start at 0, 300, 600 ms: the third is past the deadline


def _prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(14)
    a = [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(1000)]  # 3 chunks and a tail
    b = a[:3 * CHUNK] + [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(250)]
    return {"A": [a], "B": [b]}


PROMPTS = _prompts()


def _gen(name: str, prompt: str, salt: str | None = None) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": PROMPTS[prompt], "max_tokens": 16,
            **({"salt": salt} if salt else {})}


STEPS = [
    _gen("A", "A"), {"op": "stats", "name": "after_A"},
    _gen("B", "B"), {"op": "stats", "name": "after_B"},  # 3 hits; the third chunk is late
    _gen("S1", "B", "tenant-1"), {"op": "stats", "name": "after_S1"},  # salted: no hits
    _gen("S2", "B", "tenant-2"), {"op": "stats", "name": "after_S2"},  # another salt: no hits
    _gen("S1b", "B", "tenant-1"), {"op": "stats", "name": "after_S1b"},  # its own salt: hits
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("vllm-deadline")
    model = str(tiny_llama())
    baseline = run_engine(tmp, "baseline", {"model": model, "steps": [
        _gen("A", "A"), _gen("B", "B")]})
    slow = {**SERVER, "server": {**SERVER["server"], "test_copy_delay_ms": DELAY_MS},
            "timeouts": {**SERVER["timeouts"], "load_ms": DEADLINE_MS}}
    server = ServerProcess(tmp, slow, name="slow").start()
    try:
        conn = run_engine(tmp, "connector", {
            "model": model, "connector": {"url": server.url, "extra": EXTRA},
            "server_url": server.url, "steps": STEPS})
    finally:
        server.kill()
    return {"baseline": baseline, "connector": conn, "server_log": server.log()}


def _delta(run: dict[str, Any], before: str, after: str, key: str) -> int:
    return int(run["stats"][after][key] - run["stats"][before][key])


def _tokens(run: dict[str, Any], name: str) -> list[list[int]]:
    return [list(t) for t in run["results"][name]["tokens"]]


def test_loads_past_the_deadline_are_recomputed_with_identical_tokens(runs: dict[str, Any]) -> None:
    base, conn = runs["baseline"], runs["connector"]
    assert _tokens(conn, "A") == _tokens(base, "A")
    assert _delta(conn, "after_A", "after_B", "lookup_hit_chunks") == 3
    late = _delta(conn, "after_A", "after_B", "retrieve_late_chunks")
    loaded = _delta(conn, "after_A", "after_B", "retrieved_chunks")
    assert late >= 1 and loaded + late == 3, (loaded, late)
    assert "past the load deadline" in conn["log"]
    assert _tokens(conn, "B") == _tokens(base, "B")
    # (num_cached_tokens keeps the external hit vLLM was first told, 3 chunks, even after it
    # recomputed from the first late block: the tokens above are what proves the recompute)
    assert conn["results"]["B"]["cached"] == [3 * CHUNK]
    # the request waited at most the deadline plus the copy in progress, then recomputed
    extra_s = conn["results"]["B"]["elapsed_s"] - base["results"]["B"]["elapsed_s"]
    print(f"B with a late load: {extra_s * 1000:.0f} ms more than without the connector "
          f"(deadline {DEADLINE_MS} ms, copies {DELAY_MS} ms per chunk)")
    assert extra_s < 10 * (DEADLINE_MS + DELAY_MS) / 1000  # ~0.8 s expected: 10x, for a busy machine


def test_different_cache_salts_never_share_chunks(runs: dict[str, Any]) -> None:
    base, conn = runs["baseline"], runs["connector"]
    assert _delta(conn, "after_B", "after_S1", "lookup_hit_chunks") == 0  # unsalted chunks: not its
    assert _delta(conn, "after_S1", "after_S2", "lookup_hit_chunks") == 0  # tenant-1's: not its
    assert _delta(conn, "after_S2", "after_S1b", "lookup_hit_chunks") == 3  # its own salt hits
    for name in ("S1", "S2", "S1b"):
        assert _tokens(conn, name) == _tokens(base, "B")
    assert conn["results"]["S1"]["cached"] == [0] and conn["results"]["S2"]["cached"] == [0]
