"""``lmcache lookup --explain`` against real ``lmcache serve`` processes: chunks stored one way by a
stand-in worker (``kv_worker.py``, through the real adapters) and looked up another, one test per
cause a lookup misses for; the ``--json`` cause and the line under the table both name it. Then
the EXPLAIN op's bounds on a real server (refused with a typed error, the server serving on) and
the usage errors of ``--salt`` / ``--lora``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from lmcache_cli.main import app
from lmcache_core.errors import ProtocolError
from lmcache_core.keys import tenant_tag
from lmcache_core.protocol import explain_messages as em
from lmcache_core.protocol import messages as m
from lmcache_core.protocol import ops
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.cli import cli
from tests.integration.servers import TINY, RedisServer, ServerProcess, WorkerProcess, frozen

CHUNK = TINY["chunk_size"]
LAYOUT = "float16:2x4x32"  # the servers' model at TP=1 (2 layers, 4 KV heads of 32, fp16)
runner = CliRunner()


def prompt(seed: int, chunks: int = 4) -> list[int]:
    return [(7919 * seed + i * 37) % 32000 for i in range(chunks * CHUNK)]


def store(worker: WorkerProcess, keys: list[Any], salt: str | None = None, req: str = "r",
          blocks: list[int] | None = None) -> None:
    """The worker stores ``keys`` (token ids, or hex vLLM block hashes: one per block) from its
    first blocks, for ``salt``'s tenant."""
    if blocks is None:  # the worker's blocks are of 16 tokens
        blocks = list(range(len(keys) // 16 if isinstance(keys[0], int) else len(keys)))
    worker("fill", blocks=blocks, seed=3)
    result = worker("store", req=req, keys=keys, blocks=blocks, salt=salt)
    assert result["finished"] and not result["failed"], result


def tokens_file(path: Path, *prompts: list[int]) -> Path:
    path.write_text(json.dumps({"prompts": list(prompts)}))
    return path


def explained(server: ServerProcess, tokens: Path, *args: str) -> list[dict[str, Any]]:
    """Each prompt's ``explain`` object of ``lookup --explain --json`` (in this process)."""
    env = {name: None for name in os.environ if name.startswith("LMCACHE_")}
    result = runner.invoke(app, ["lookup", "-c", str(server.config_path), "--tokens", str(tokens),
                                 "--explain", "--json", *args], env=env)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["prompts"]
    for row in rows:
        assert set(row["explain"]) == {"verdict", "cause", "detail", "candidates"}, row
    return [row["explain"] for row in rows]


def shown(server: ServerProcess, tokens: Path, *args: str) -> str:
    """What ``lookup --explain`` prints, as a user runs it."""
    result = cli("lookup", "-c", str(server.config_path), "--tokens", str(tokens), "--explain",
                 *args)
    assert result.code == 0, result.err
    return result.out


def test_a_prompt_stored_under_another_model_name(
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess],
        tmp_path: Path) -> None:
    server = make_server()
    asked = prompt(1)
    store(make_worker(server.url, model="/models/tiny"), asked)
    tokens = tokens_file(tmp_path / "t.json", asked)
    [found] = explained(server, tokens)
    assert (found["verdict"], found["cause"]) == ("miss", "model_name"), found
    assert "'/models/tiny'" in found["detail"] and "--model /models/tiny" in found["detail"]
    assert {(c["model"], c["layout"], c["tier"], c["chunk_size"]) for c in found["candidates"]} \
        == {("/models/tiny", LAYOUT, "memory", CHUNK)}
    out = shown(server, tokens)
    assert "prompt 0: miss · other model name" in out and "/models/tiny" in out, out
    [hit] = explained(server, tokens, "--model", "/models/tiny")
    assert (hit["verdict"], hit["cause"]) == ("hit", None), hit


def test_a_prompt_stored_in_another_layout(
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess],
        tmp_path: Path) -> None:
    server = make_server()
    asked = prompt(2)
    store(make_worker(server.url, dtype="bfloat16"), asked)
    tokens = tokens_file(tmp_path / "t.json", asked)
    [found] = explained(server, tokens, "--layout", LAYOUT)  # the engine that looks is fp16
    assert (found["verdict"], found["cause"]) == ("miss", "layout"), found
    assert "held under bfloat16:2x4x32" in found["detail"], found
    assert "dtype bfloat16 vs float16" in found["detail"], found
    out = shown(server, tokens, "--layout", LAYOUT)
    assert "other layout" in out and "dtype bfloat16 vs float16" in out, out


def test_a_prompt_stored_for_another_world_size(
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess],
        tmp_path: Path) -> None:
    """Rank 0 of a TP=2 engine stored its heads (0-2); its rank 1 never did: a lookup at world
    size 1 needs heads 2-4 too, and 4 KV heads do not divide among 3 ranks."""
    server = make_server()
    asked = prompt(3)
    store(make_worker(server.url, rank=0, world_size=2, heads=2), asked)
    tokens = tokens_file(tmp_path / "t.json", asked)
    [found] = explained(server, tokens, "--world-size", "1")
    assert (found["verdict"], found["cause"]) == ("miss", "world_size"), found
    assert "held as heads 0-2 of 4" in found["detail"], found
    assert "world size 1 needs heads 2-4 too" in found["detail"], found
    assert "fit no world size" in found["detail"], found
    assert [c["heads"] for c in found["candidates"]] == [[[0, 2]]]
    [odd] = explained(server, tokens, "--world-size", "3")
    assert odd["cause"] == "world_size" and "do not divide among world size 3" in odd["detail"]
    out = shown(server, tokens, "--world-size", "1")
    assert "other world size" in out and "heads 2-4" in out, out


def test_a_disk_written_at_another_chunk_size(
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess],
        tmp_path: Path) -> None:
    """A server with chunk_size 32 wrote the disk tier; the one serving it now hashes at 64."""
    disk = {"path": str(tmp_path / "disk"), "max_size": "64MiB", "write_through": True}
    old = make_server({"chunk_size": 32, "disk": disk}, name="old")
    asked = prompt(4)
    worker = make_worker(old.url)
    store(worker, asked)
    with MessageQueueClient(old.url) as client:
        wait_until(lambda: _disk_pieces(client) == 8, 30,
                   "the old server did not write its 8 chunks to disk")
    worker.close()
    assert old.stop() == 0
    new = make_server({"disk": disk}, name="new")
    tokens = tokens_file(tmp_path / "t.json", asked)
    [found] = explained(new, tokens)
    assert (found["verdict"], found["cause"]) == ("miss", "chunk_size"), found
    assert "held at chunk size 32" in found["detail"] and "disk" in found["detail"], found
    assert {(c["chunk_size"], c["tier"]) for c in found["candidates"]} == {(32, "disk")}
    out = shown(new, tokens)
    assert "other chunk size" in out and "chunk_size: 32" in out, out


@pytest.mark.redis
def test_redis_written_at_another_chunk_size_and_a_hung_redis(
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess],
        redis_up: RedisServer, tmp_path: Path) -> None:
    """A server with chunk_size 32 wrote Redis; another one on it hashes at 64. Redis is asked
    for exact keys of the asked model and layout, never scanned; hung, it costs the budget."""
    remote = {"url": redis_up.url, "timeout_ms": 200, "retry_interval_s": 0.2}
    old = make_server({"chunk_size": 32, "remote": remote}, name="old")
    asked = prompt(11)
    store(make_worker(old.url), asked)
    with redis_up.client() as client:
        wait_until(lambda: len(client.keys("lmcache:v2:tiny:*")) == 8, 30,
                   "the old server did not write its 8 chunks to Redis")
    new = make_server({"remote": remote}, name="new")
    tokens = tokens_file(tmp_path / "t.json", asked)
    [found] = explained(new, tokens)
    assert (found["verdict"], found["cause"]) == ("miss", "chunk_size"), found
    assert "held at chunk size 32" in found["detail"] and "remote" in found["detail"], found
    assert {(c["chunk_size"], c["tier"], c["layout"]) for c in found["candidates"]} == {
        (32, "remote", LAYOUT)}

    assert redis_up.proc is not None
    with frozen(redis_up.proc.pid):
        start = time.monotonic()
        [hung] = explained(new, tokens)
        assert hung["cause"] == "not_stored", hung
        assert "Redis did not answer in time" in hung["detail"] or \
            "Redis is down" in hung["detail"], hung
        assert time.monotonic() - start < 10  # two lookup budgets of 0.8 s, and the CLI's start


def _disk_pieces(client: MessageQueueClient) -> int:
    listing = client.request(m.ListChunksRequest(tiers=["disk"]))
    return sum(total.pieces for total in listing.tiers if total.tier == "disk")


def test_a_model_stored_from_vllm_block_hashes(
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess],
        tmp_path: Path) -> None:
    """The worker stores in vLLM's hash mode (block hashes, as vLLM's LMCacheMPConnector hands
    them): the adapter says so in the store, and a tokens file never names those chunks."""
    server = make_server()
    block_hashes = [os.urandom(32).hex() for _ in range(16)]  # 4 chunks of 4 blocks
    store(make_worker(server.url), block_hashes)
    tokens = tokens_file(tmp_path / "t.json", prompt(5))
    [found] = explained(server, tokens)
    assert (found["verdict"], found["cause"]) == ("miss", "hash_mode"), found
    assert "vLLM's hash mode" in found["detail"] and "1 store(s)" in found["detail"], found
    out = shown(server, tokens)
    assert "other hash mode" in out and "vLLM's block hashes" in out, out


def test_a_prompt_of_another_tenant_and_full_hits(
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess],
        tmp_path: Path) -> None:
    """alice's prompt is stored salted, then another unsalted: each misses as the other tenant,
    and hits as its own (--salt), green."""
    server = make_server()
    worker = make_worker(server.url)
    salted, plain = prompt(6, 2), prompt(7, 2)
    store(worker, salted, salt="alice", req="a", blocks=list(range(8)))
    tokens = tokens_file(tmp_path / "t.json", salted, plain)
    [unsalted, _] = explained(server, tokens)  # every piece of the model is a tenant's
    assert (unsalted["verdict"], unsalted["cause"]) == ("miss", "tenant"), unsalted
    assert "1 tenant(s) hold all 2 piece(s) of model 'tiny'" in unsalted["detail"], unsalted
    assert "--salt SALT" in unsalted["detail"]
    out = shown(server, tokens)
    assert "prompt 0: miss · other tenant" in out, out

    store(worker, plain, req="b", blocks=list(range(8, 16)))
    unsalted_salted, unsalted_plain = explained(server, tokens)
    assert unsalted_salted["cause"] == "not_stored", unsalted_salted  # unsalted pieces too now
    assert "1 tenant(s) hold 2 of its pieces (--salt SALT" in unsalted_salted["detail"]
    assert unsalted_plain == {"verdict": "hit", "cause": None, "candidates": [],
                              "detail": "all 2 chunk(s) held (memory 2)"}

    as_alice = explained(server, tokens, "--salt", "alice")
    assert [e["verdict"] for e in as_alice] == ["hit", "miss"]
    assert as_alice[1]["cause"] == "tenant" and "held without the salt (" in as_alice[1]["detail"]
    assert {c["seed"] for c in as_alice[1]["candidates"]} == {"unsalted"}

    [as_bob, _] = explained(server, tokens, "--salt", "bob")
    assert as_bob["cause"] == "tenant", as_bob
    assert f"none to this salt's (tag {tenant_tag('bob')})" in as_bob["detail"], as_bob

    out = shown(server, tokens, "--salt", "alice")
    assert "prompt 0: hit:" in out and "prompt 1: miss · other tenant" in out, out


def test_a_prompt_never_stored_and_a_partial_hit(
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess],
        tmp_path: Path) -> None:
    server = make_server()
    stored = prompt(8, 2)
    store(make_worker(server.url), stored, blocks=list(range(8)))
    longer = stored + prompt(9, 1)  # held for its first 2 chunks only
    tokens = tokens_file(tmp_path / "t.json", prompt(10, 2), longer, [1, 2, 3])
    never, partial, short = explained(server, tokens)
    assert (never["verdict"], never["cause"]) == ("miss", "not_stored"), never
    assert (partial["verdict"], partial["cause"]) == ("partial", "not_stored"), partial
    assert partial["detail"].startswith("the first 2 of 3 chunk(s) are held (memory 2)")
    assert (short["verdict"], short["cause"]) == ("miss", "not_stored"), short
    assert "shorter than one chunk of 64 tokens" in short["detail"]


def test_explain_bounds_are_typed_errors_and_the_server_serves_on(
        make_server: Callable[..., ServerProcess]) -> None:
    server = make_server()
    with MessageQueueClient(server.url) as client:
        too_many = em.ExplainRequest(model_name="tiny", world_size=1,
                                     probes=[b"h" * 32] * (em.MAX_EXPLAIN_PROBES + 1))
        with pytest.raises(ProtocolError, match=r"lmc\.explain"):
            client.call(ops.EXPLAIN, too_many)
        with pytest.raises(ProtocolError, match=r"lmc\.explain"):
            client.call(ops.EXPLAIN, em.ExplainRequest(model_name="tiny", world_size=1, probes=[]))
        reply = client.call(ops.EXPLAIN, em.ExplainRequest(
            model_name="tiny", world_size=1, probes=[b"h" * 32] * em.MAX_EXPLAIN_PROBES))
        assert (reply.holders, reply.pieces, reply.remote, reply.cut) == ([], 0, "", False)
        assert client.ping().version


@pytest.mark.parametrize(("args", "expected"), [
    (["--salt", ""], "--salt is empty"),
    (["--lora", "adapter"], "--lora 'adapter' is not NAME#ID"),
    (["--lora", "adapter#one"], "is not NAME#ID"),
])
def test_bad_salt_or_lora_is_one_line_and_exit_2(args: list[str], expected: str,
                                                 tmp_path: Path) -> None:
    tokens = tokens_file(tmp_path / "t.json", prompt(1))
    result = runner.invoke(app, ["lookup", "--tokens", str(tokens), "--url", "ipc:///nonexistent",
                                 "--explain", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
