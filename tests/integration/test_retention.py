"""Retention driven by the request, on a real server: pinned prefixes (by a store's hint or by
``lmcache pin``) survive floods that evict everything else, pins are bounded by server.max_pinned
(typed error, counted refusals), lower priorities and expired TTLs are evicted first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcache_core.keys import chain_hashes
from lmcache_core.protocol import messages as m
from lmcache_core.transport.client import MessageQueueClient
from tests.integration.chunks import CHUNK, blocks, stats, tokens
from tests.integration.servers import ServerProcess, WorkerProcess

# A tiny model's chunk is 64 KiB: the 2 MiB pool holds 32 chunks, and pins at most 8 (a quarter).
POOL_CHUNKS, MAX_PINNED_CHUNKS = 32, 8
FLOOD_CHUNKS = 16  # one store of the whole worker cache (64 blocks)

pytestmark = pytest.mark.server_config({"server": {"pool_size": "2MiB", "prefault": False}})


@pytest.fixture(scope="module")
def worker(server: ServerProcess):
    w = WorkerProcess(server.url)
    yield w
    w.close()


@pytest.fixture
def client(server: ServerProcess, worker: WorkerProcess):
    with MessageQueueClient(server.url, connect_timeout_s=5) as c:
        c.request(m.ClearRequest(force=True))
        yield c


def held(client: MessageQueueClient, toks: list[int]) -> int:
    """Leading chunks of ``toks`` the server holds (nothing locked)."""
    request = m.LookupRequest(model_name="tiny", world_size=1, lookup_id="retention-test",
                              chunk_hashes=chain_hashes(toks, CHUNK), lock=False)
    return client.request(request).hit_chunks


_stores = iter(range(10**9))


def store(worker: WorkerProcess, toks: list[int], **hints: object) -> dict:
    n = len(toks) // CHUNK
    result = worker("store", req=f"s{next(_stores)}", keys=toks, blocks=blocks(0, n), **hints)
    assert result["finished"] and not result["failed"], result
    return result


def flood(worker: WorkerProcess, seed: int, rounds: int = 4) -> list[list[int]]:
    """Store ``rounds`` x 16 fresh chunks (two pools' worth at the default 4 rounds)."""
    prompts = [tokens(FLOOD_CHUNKS, seed * 100 + r) for r in range(rounds)]
    for prompt in prompts:
        store(worker, prompt)
    return prompts


def flood_until_evicting(client: MessageQueueClient, worker: WorkerProcess, seed: int,
                         **hints: object) -> list[list[int]]:
    """Store 4 fresh chunks at a time until the server has evicted something."""
    before = stats(client).engine.evictions
    prompts = []
    for step in range(2 * POOL_CHUNKS // 4):
        prompts.append(tokens(4, seed * 100 + step))
        store(worker, prompts[-1], **hints)
        if stats(client).engine.evictions > before:
            return prompts
    raise AssertionError("the flood never evicted")


def cli(server: ServerProcess, *args: str, tokens_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmcache_cli", *args, "--tokens", str(tokens_file), "-c",
         str(server.config_path), "--json"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})


def test_a_store_pinned_by_its_hint_survives_a_flood(client, worker) -> None:
    pinned = tokens(4, 1)
    worker("fill", blocks=blocks(0, 4), seed=11)
    digest = worker("digest", blocks=blocks(0, 4))["digest"]
    assert store(worker, pinned, pin=True)["pin_refused"] == 0
    s = stats(client)
    assert (s.engine.pinned_pieces, s.engine.pinned_bytes) == (4, 4 * 64 * 1024)
    others = flood(worker, 1)
    assert held(client, pinned) == 4
    assert held(client, others[0]) == 0  # the flood evicted everything that was not pinned
    assert stats(client).engine.evictions >= 2 * FLOOD_CHUNKS
    # the pinned chunks hold what was stored
    worker("zero", blocks=blocks(8, 4))
    result = worker("retrieve", req="r-pinned", keys=pinned, blocks=blocks(8, 4))
    assert result["finished"] and not result["failed"], result
    assert worker("digest", blocks=blocks(8, 4))["digest"] == digest


def test_cli_pin_then_unpin(server, client, worker, tmp_path: Path) -> None:
    prompt = tokens(3, 2)
    store(worker, prompt)
    tokens_file = tmp_path / "prompt.json"
    tokens_file.write_text(json.dumps({"prompts": [prompt], "model": "tiny", "world_size": 1}))
    done = cli(server, "pin", "--ttl", "3600", tokens_file=tokens_file)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["prompts"][0]["pinned_pieces"] == 3 and out["ttl_s"] == 3600
    rows = json.loads(subprocess.run(
        [sys.executable, "-m", "lmcache_cli", "inspect-chunks", "-c", str(server.config_path),
         "--json"], capture_output=True, text=True, timeout=60, check=True).stdout)["chunks"]
    pinned = [r for r in rows if r["pinned"]]
    assert len(pinned) == 3 and all(3500 < r["expires_in_s"] <= 3600 for r in pinned)
    assert all(r["priority"] == 0 for r in rows)
    flood(worker, 2)
    assert held(client, prompt) == 3

    done = cli(server, "unpin", tokens_file=tokens_file)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prompts"][0]["unpinned_pieces"] == 3
    assert stats(client).engine.pinned_pieces == 0
    flood(worker, 3)
    assert held(client, prompt) == 0


def test_pins_are_bounded_by_max_pinned(server, client, worker, tmp_path: Path) -> None:
    first = tokens(MAX_PINNED_CHUNKS, 4)
    assert store(worker, first, pin=True)["pin_refused"] == 0
    over = tokens(2, 5)
    assert store(worker, over, pin=True)["pin_refused"] == 2  # stored, unpinned
    s = stats(client)
    assert (s.engine.store_pin_refused, s.engine.pinned_pieces) == (2, MAX_PINNED_CHUNKS)
    assert held(client, over) == 2
    tokens_file = tmp_path / "over.json"
    tokens_file.write_text(json.dumps([over]))
    done = cli(server, "pin", tokens_file=tokens_file)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "pin_limit" in done.stderr and "max_pinned" in done.stderr
    assert stats(client).engine.pinned_pieces == MAX_PINNED_CHUNKS  # nothing more was pinned
    flood(worker, 4)
    assert held(client, first) == MAX_PINNED_CHUNKS and held(client, over) == 0


def test_lower_priority_is_evicted_first(client, worker) -> None:
    high = tokens(4, 6)
    low = tokens(4, 7)
    store(worker, high, priority=10)  # the least recently used of all
    store(worker, low, priority=-10)
    others = flood_until_evicting(client, worker, 6)
    assert held(client, low) < 4  # taken first, though more recent than high and the flood
    assert held(client, high) == 4 and held(client, others[0]) == 4
    rows = client.request(m.ListChunksRequest(limit=1000)).chunks
    assert {r.priority for r in rows} >= {10, 0}


def test_expired_pieces_are_evicted_first(client, worker) -> None:
    old = tokens(4, 8)
    expiring = tokens(4, 9)
    store(worker, old)  # the least recently used
    store(worker, expiring, ttl_s=0.3)
    # Kept sleep: the TTL runs on the server's own clock, in its process; sleeping past it makes
    # it expire however busy the machine (a sleep is never shorter than asked).
    time.sleep(0.5)
    others = flood_until_evicting(client, worker, 8)
    assert held(client, expiring) < 4
    assert held(client, old) == 4 and held(client, others[0]) == 4


def test_a_pin_with_a_ttl_ends(client, worker) -> None:
    prompt = tokens(2, 10)
    store(worker, prompt, pin=True, ttl_s=0.3)
    time.sleep(0.5)  # past the TTL on the server's clock (kept, as above)
    flood(worker, 10)
    assert held(client, prompt) == 0


def test_cli_usage_errors_and_no_torch(server, tmp_path: Path) -> None:
    missing = cli(server, "pin", tokens_file=tmp_path / "missing.json")
    assert missing.returncode == 2 and "no such file" in missing.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2, 3]")
    ttl = subprocess.run([sys.executable, "-m", "lmcache_cli", "pin", "--tokens", str(bad),
                          "--ttl", "0", "-c", str(server.config_path)],
                         capture_output=True, text=True, timeout=60)
    assert ttl.returncode == 2
    for command in ("pin", "unpin"):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "lmcache_cli", command,
                               "--tokens", str(bad), "-c", str(server.config_path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        modules = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                   if line.startswith("import time:")}
        assert modules and not {"torch", "numpy"} & modules
