"""A real vLLM engine: a request with ``kv_transfer_params={"lmcache.pin": True}`` stores a pinned
prefix; a flood of other prompts evicts everything else from a small pool; the pinned prefix still
hits, and the engine generates exactly the tokens of an engine without the connector. A request
with ``lmcache.skip_store`` stores nothing.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from lmcache_core.keys import chain_hashes
from lmcache_core.protocol import messages as m
from lmcache_core.transport.client import MessageQueueClient
from tests.integration.servers import ServerProcess
from tests.vllm.engines import EXTRA, run_engine
from tests.vllm.tiny_model import CHUNK, SERVER, TINY_LLAMA, tiny_llama

pytestmark = pytest.mark.timeout(1200)

# The tiny Llama's chunk is 1 MiB: the pool holds 24 chunks (6 pinned at most); the flood stores 32.
POOL = "24MiB"
FLOOD_PROMPTS, FLOOD_CHUNKS = 8, 4


def _prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(21)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(n)]

    p = fresh(3 * CHUNK + 50)  # 3 whole chunks and a tail
    return {
        "P": [p],
        "F": [fresh(FLOOD_CHUNKS * CHUNK + 60) for _ in range(FLOOD_PROMPTS)],
        "P2": [p[:3 * CHUNK] + fresh(200)],  # shares P's 3 chunks
        "K": [fresh(2 * CHUNK + 30)],
    }


PROMPTS = _prompts()


def _gen(name: str, **extra: Any) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": PROMPTS[name], "max_tokens": 16, **extra}


STEPS = [
    _gen("P", kv_transfer_params={"lmcache.pin": True, "other.connector": 1}),
    {"op": "stats", "name": "after_P"},
    _gen("F"), {"op": "stats", "name": "after_F"},
    _gen("P2"), {"op": "stats", "name": "after_P2"},
    _gen("K", kv_transfer_params={"lmcache.skip_store": True}), {"op": "stats", "name": "after_K"},
]


def _held(client: MessageQueueClient, prompt: list[int]) -> int:
    request = m.LookupRequest(model_name=str(tiny_llama()), world_size=1, lookup_id="t",
                              chunk_hashes=chain_hashes(prompt, CHUNK), lock=False)
    return client.request(request).hit_chunks


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("vllm-retention")
    model = str(tiny_llama())
    baseline = run_engine(tmp, "baseline", {"model": model, "steps": [
        _gen("P"), _gen("P2"), _gen("K")]})
    small = {**SERVER, "server": {**SERVER["server"], "pool_size": POOL, "prefault": False}}
    server = ServerProcess(tmp, small, name="retention").start()
    try:
        conn = run_engine(tmp, "connector", {
            "model": model, "connector": {"url": server.url, "extra": EXTRA},
            "server_url": server.url, "steps": STEPS})
        with MessageQueueClient(server.url, connect_timeout_s=5) as client:
            held = {"P": _held(client, PROMPTS["P"][0]),
                    "F": [_held(client, p) for p in PROMPTS["F"]]}
    finally:
        server.kill()
    return {"baseline": baseline, "connector": conn, "held": held}


def test_the_pinned_prefix_survives_a_flood_and_generates_the_same_tokens(runs) -> None:
    base, conn = runs["baseline"], runs["connector"]
    stats = conn["stats"]
    assert stats["after_P"]["pinned_pieces"] == 3 and stats["after_P"]["store_pin_refused"] == 0
    # the flood stored more than the pool holds: everything not pinned was evicted at least once
    flooded = stats["after_F"]["stored_chunks"] - stats["after_P"]["stored_chunks"]
    assert 24 <= flooded <= FLOOD_PROMPTS * FLOOD_CHUNKS
    assert stats["after_F"]["evictions"] >= flooded + 3 - 24
    # what the flood left fits beside the pinned prefix; some flood prompt lost chunks (which
    # one depends on the order vLLM finished them in)
    assert sum(runs["held"]["F"]) <= 24 - 3
    assert min(runs["held"]["F"]) < FLOOD_CHUNKS
    # the pinned prefix still hits: P2 loads P's 3 chunks from the server
    assert conn["results"]["P2"]["cached"] == [3 * CHUNK]
    assert stats["after_P2"]["retrieved_chunks"] - stats["after_F"]["retrieved_chunks"] == 3
    assert runs["held"]["P"] == 3
    for name in ("P", "P2"):
        assert conn["results"][name]["tokens"] == base["results"][name]["tokens"], name


def test_skip_store_stores_nothing(runs) -> None:
    base, conn = runs["baseline"], runs["connector"]
    stats = conn["stats"]
    assert stats["after_K"]["stored_chunks"] == stats["after_P2"]["stored_chunks"]
    assert conn["results"]["K"]["tokens"] == base["results"]["K"]["tokens"]
