"""A real vLLM engine: a chunk corrupted behind the server's back, one payload byte changed in its
disk file and in its Redis value, is dropped when the server loads it (its checksum, carried in the
record as ``payload_xxh3``, no longer matches), never served; the lookup stops before it, vLLM
recomputes it and generates exactly the tokens of an engine without the connector.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from lmcache_core.keys import chain_hashes
from lmcache_core.protocol import messages as m
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.servers import RedisServer, ServerProcess, redis_binary
from tests.vllm.engines import EXTRA, run_engine
from tests.vllm.tiny_model import CHUNK, SERVER, TINY_LLAMA, tiny_llama

pytestmark = pytest.mark.timeout(1200)

_rng = random.Random(33)
PROMPT = [_rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(3 * CHUNK + 100)]
NO_STORE = {"lmcache.skip_store": True}  # the recomputed chunks are not stored back


def _gen(name: str, **extra: Any) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": [PROMPT], "max_tokens": 16, **extra}


def _flip_payload_byte(data: bytes) -> bytes:
    out = bytearray(data)
    out[-9] ^= 0x01  # in the payload: the header (key, sizes, checksums) stays intact
    return bytes(out)


def _stats(client: MessageQueueClient) -> m.ServerStats:
    return client.server_info().stats


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("vllm-integrity")
    model = str(tiny_llama())
    baseline = run_engine(tmp, "baseline", {"model": model, "steps": [_gen("A")]})
    redis_server = RedisServer(redis_binary(), tmp).start()
    disk = tmp / "disk"
    config = {**SERVER, "disk": {"path": str(disk), "max_size": "256MiB", "write_through": True},
              "remote": {"url": redis_server.url, "timeout_ms": 200, "retry_interval_s": 0.2}}
    server = ServerProcess(tmp, config, name="integrity").start()
    try:
        common = {"model": model, "connector": {"url": server.url, "extra": EXTRA},
                  "server_url": server.url}
        stored = run_engine(tmp, "store", {**common, "steps": [_gen("A")]})
        bad = chain_hashes(PROMPT, CHUNK)[1].hex()  # the second chunk (the connector hashes tokens)
        with MessageQueueClient(server.url) as client, redis_server.client() as redis_client:
            wait_until(lambda: (_stats(client).disk.written_chunks >= 3
                                and _stats(client).remote.written_chunks >= 3),
                       30, "the tiers were never written")
            files = [p for p in disk.iterdir() if p.name.startswith(f"{bad}.")]
            rkeys = redis_client.keys(f"*:{bad}")
            assert len(files) == 1 and len(rkeys) == 1, (files, rkeys)
            files[0].write_bytes(_flip_payload_byte(files[0].read_bytes()))
            redis_client.set(rkeys[0], _flip_payload_byte(redis_client.get(rkeys[0])))
            client.request(m.ClearRequest(force=True))
        # A fresh engine (its own prefix cache off): the first lookup loads from disk and meets the
        # corrupt file; the second, with that file gone, asks Redis and meets the corrupt value.
        verify = run_engine(tmp, "verify", {**common, "steps": [
            {"op": "stats", "name": "before"},
            _gen("A_disk", kv_transfer_params=NO_STORE), {"op": "stats", "name": "after_disk"},
            _gen("A_redis", kv_transfer_params=NO_STORE), {"op": "stats", "name": "after_redis"}]})
    finally:
        server.kill()
        redis_server.stop()
    return {"baseline": baseline, "stored": stored, "verify": verify}


def _delta(run: dict[str, Any], before: str, after: str, key: str) -> int:
    return int(run["stats"][after][key] - run["stats"][before][key])


def _tokens(run: dict[str, Any], name: str) -> list[list[int]]:
    return [list(t) for t in run["results"][name]["tokens"]]


def test_a_corrupt_disk_file_is_recomputed_with_identical_tokens(runs: dict[str, Any]) -> None:
    base, verify = runs["baseline"], runs["verify"]
    assert _tokens(runs["stored"], "A") == _tokens(base, "A")
    assert _delta(verify, "before", "after_disk", "disk_corrupt") == 1
    assert _delta(verify, "before", "after_disk", "remote_corrupt") == 0
    assert verify["results"]["A_disk"]["cached"] == [CHUNK]  # chunk 0 loaded; 1 and 2 recomputed
    assert _tokens(verify, "A_disk") == _tokens(base, "A")


def test_a_corrupt_redis_value_is_recomputed_with_identical_tokens(runs: dict[str, Any]) -> None:
    base, verify = runs["baseline"], runs["verify"]
    assert _delta(verify, "after_disk", "after_redis", "remote_corrupt") == 1
    assert verify["results"]["A_redis"]["cached"] == [CHUNK]
    assert _tokens(verify, "A_redis") == _tokens(base, "A")
    assert verify["stats"]["after_redis"]["integrity_failures"] == 0  # memory itself was intact
