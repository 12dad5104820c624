"""The CLI sees every tier: ``lmcache lookup`` and ``lmcache inspect-chunks`` against real
``lmcache serve`` processes with a disk tier (across a restart of the server) and a Redis tier
shared by a second server (a real ``redis-server``), then the peek itself on in-process engines.

What an operator is told must be what a worker would get: after a restart the disk's chunks are
hits (on disk), on a second server Redis's are (in Redis), and looking at them loads, locks and
touches nothing.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from typer.testing import CliRunner

from lmcache_cli.main import app
from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.errors import ProtocolError
from lmcache_core.keys import ChunkKey, chain_hashes, layout_key, rank_heads, world_heads
from lmcache_core.protocol import RequestType, decode_reply
from lmcache_core.protocol import messages as m
from lmcache_core.storage.disk import DiskTier
from lmcache_core.storage.pool import MemoryPool
from lmcache_core.storage.remote import RedisTier
from lmcache_core.storage.remote_tier import glob_escape
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.cli import Result, cli
from tests.integration.servers import TINY, RedisServer, ServerProcess, WorkerProcess, freeze

CHUNK = 64  # tokens: the servers' chunk size
assert TINY["chunk_size"] == CHUNK
TINY_LAYOUT = "float16:2x4x32"  # the servers' model (2 layers, 4 KV heads, head dim 32) at TP=1
PIECE_BYTES = 2 * 2 * CHUNK * 4 * 32 * 2  # K and V, 2 layers, 64 tokens, 4 heads x 32, fp16
runner = CliRunner()


def store_prompt(worker: WorkerProcess, tokens: Path) -> list[int]:
    """The worker stores one prompt of 4 chunks, written to ``tokens`` as ``lookup --tokens``
    reads it. (A worker process, not ``store-bench``: that one spawns an interpreter importing
    torch, 15-60 s on a busy machine; test_cli.py runs it and reads its --tokens-out.)"""
    prompt = [(7919 * 3 + i * 37) % 32000 for i in range(4 * CHUNK)]
    stored = list(range(4 * CHUNK // 16))  # the worker's 16-token blocks
    worker("fill", blocks=stored, seed=3)
    result = worker("store", req="prompt", keys=prompt, blocks=stored)
    assert result["finished"] and not result["failed"], result
    tokens.write_text(json.dumps({"prompts": [prompt]}))
    return prompt


def run_json(*args: str) -> dict[str, Any]:
    """``lmcache ARGS --json`` in this process (quicker than a subprocess on a busy machine; the
    tables, exit codes and error lines are checked in subprocesses, as a user runs them)."""
    env = {name: None for name in os.environ if name.startswith("LMCACHE_")}
    result = runner.invoke(app, [*args, "--json"], env=env)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def lookup(cfg: Path, tokens: Path, *args: str) -> dict[str, Any]:
    return run_json("lookup", "-c", str(cfg), "--tokens", str(tokens), *args)


def tier_counts(row: dict[str, Any]) -> tuple[int, int, int, int]:
    return row["hit_chunks"], row["memory_chunks"], row["disk_chunks"], row["remote_chunks"]


def inspect(cfg: Path, *args: str) -> dict[str, Any]:
    return run_json("inspect-chunks", "-c", str(cfg), *args)


def totals(listing: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["tier"]: t for t in listing["summary"]["tiers"]}


# ---------------------------------------------------------------- disk, across a restart


def test_after_a_restart_lookup_and_inspect_chunks_report_the_disk(
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess],
        tmp_path: Path) -> None:
    server = make_server({"disk": {"path": str(tmp_path / "disk"), "max_size": "64MiB",
                                   "write_through": True}}, name="d")
    tokens = tmp_path / "tok.json"
    cfg = server.config_path
    store_prompt(make_worker(server.url), tokens)
    [row] = lookup(cfg, tokens)["prompts"]
    assert tier_counts(row) == (4, 4, 0, 0)  # all in memory, and written behind to disk
    wait_until(lambda: totals(inspect(cfg, "--tier", "disk"))["disk"]["pieces"] == 4)

    assert server.stop() == 0
    server.start()
    data = lookup(cfg, tokens)
    [row] = data["prompts"]
    assert tier_counts(row) == (4, 0, 4, 0), row  # was 0 % before the CLI saw the disk
    assert (row["hit_tokens"], row["layout"], data["tiers"]) == (4 * CHUNK, TINY_LAYOUT, ["disk"])
    table = cli("lookup", "-c", str(cfg), "--tokens", str(tokens))
    assert table.code == 0, table.err
    for text in ("in memory", "on disk", "100%", TINY_LAYOUT):
        assert text in table.out, table.out
    assert "in Redis" not in table.out  # this server has no Redis tier

    listing = inspect(cfg)
    chunks = listing["chunks"]
    assert len(chunks) == 4 and {c["tier"] for c in chunks} == {"disk"}
    assert {(c["layout"], c["head_lo"], c["head_hi"], c["nbytes"]) for c in chunks} == {
        (TINY_LAYOUT, 0, 4, PIECE_BYTES)}
    hashes = chain_hashes(json.loads(tokens.read_text())["prompts"][0], CHUNK)
    assert {bytes.fromhex(c["chunk_hash"]) for c in chunks} == set(hashes)
    assert listing["summary"]["total"] == 4
    by_tier = totals(listing)
    assert (by_tier["memory"]["pieces"], by_tier["memory"]["nbytes"]) == (0, 0)
    assert (by_tier["disk"]["pieces"], by_tier["disk"]["nbytes"]) == (4, 4 * PIECE_BYTES)
    assert "remote" not in by_tier
    shown = cli("inspect-chunks", "-c", str(cfg), "--sort", "key")
    assert shown.code == 0, shown.err
    assert "no chunks" not in shown.out and shown.out.count(" disk ") >= 4, shown.out
    assert "tiers: memory 0 piece(s), 0 B · disk 4 piece(s), 256.0 KiB" in shown.out, shown.out
    assert inspect(cfg, "--tier", "memory")["chunks"] == []
    assert inspect(cfg, "--model", "other")["summary"]["total"] == 0

    # Looking loaded nothing: memory is still empty and the prefix still on disk only.
    assert tier_counts(lookup(cfg, tokens)["prompts"][0]) == (4, 0, 4, 0)
    assert totals(inspect(cfg))["memory"]["pieces"] == 0
    # Another layout holds nothing; a string that is no layout is refused before any request.
    other = lookup(cfg, tokens, "--layout", "float16:2x8x32")
    assert (other["layout"], tier_counts(other["prompts"][0])) == ("float16:2x8x32", (0, 0, 0, 0))
    bad = cli("lookup", "-c", str(cfg), "--tokens", str(tokens), "--layout", "float16:2x4")
    assert bad.code == 2 and "not a KV layout fingerprint" in bad.one_error_line()

    # An engine's lookup (in its layout) loads them, as before: the CLI then sees them in memory.
    with MessageQueueClient(server.url) as client:
        reply = client.request(m.LookupRequest(model_name="tiny", world_size=1, lookup_id="w",
                                               chunk_hashes=hashes, lock=False,
                                               layout=TINY_LAYOUT))
        assert reply.hit_chunks == 4
    assert tier_counts(lookup(cfg, tokens)["prompts"][0]) == (4, 4, 0, 0)
    by_tier = totals(inspect(cfg))
    assert (by_tier["memory"]["pieces"], by_tier["disk"]["pieces"]) == (4, 4)
    # One listing over both tiers, in the asked order: by key, a chunk's two copies side by side.
    paired = inspect(cfg, "--sort", "key", "--limit", "4")
    first_two = sorted(h.hex() for h in hashes)[:2]
    assert [(c["chunk_hash"], c["tier"]) for c in paired["chunks"]] == [
        (h, tier) for h in first_two for tier in ("disk", "memory")]
    assert paired["summary"]["total"] == 8


# ---------------------------------------------------------------- Redis, shared by two servers


@pytest.mark.redis
def test_a_second_server_on_the_same_redis_reports_its_chunks(
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess],
        redis_up: RedisServer, tmp_path: Path) -> None:
    redis_srv = redis_up
    remote = {"url": redis_srv.url, "timeout_ms": 200, "retry_interval_s": 0.2}
    srv_a = make_server({"remote": remote}, name="a")
    srv_b = make_server({"remote": remote}, name="b")
    tokens = tmp_path / "tok.json"
    store_prompt(make_worker(srv_a.url), tokens)
    a_cfg, b_cfg = srv_a.config_path, srv_b.config_path
    wait_until(lambda: totals(inspect(a_cfg, "--tier", "remote"))["remote"]["pieces"] == 4)

    data = lookup(b_cfg, tokens)
    [row] = data["prompts"]
    assert tier_counts(row) == (4, 0, 0, 4), row  # B never stored them: they are in Redis
    assert (row["remote"], row["layout"], data["tiers"]) == ("asked", TINY_LAYOUT, ["remote"])
    table = cli("lookup", "-c", str(b_cfg), "--tokens", str(tokens))
    assert table.code == 0 and "in Redis" in table.out and "100%" in table.out, table.out

    listing = inspect(b_cfg)
    assert listing["chunks"] == [] and listing["summary"]["total"] == 0  # none in B's memory
    counted = totals(listing)["remote"]
    assert (counted["pieces"], counted["complete"], counted["pattern"]) == (4, True, "lmcache:v2:*")
    assert counted["error"] == "" and counted["nbytes"] is None
    tiny = totals(inspect(b_cfg, "--model", "tiny"))["remote"]
    assert (tiny["pieces"], tiny["pattern"]) == (4, "lmcache:v2:tiny:*")
    assert totals(inspect(b_cfg, "--model", "other"))["remote"]["pieces"] == 0
    exact = totals(inspect(b_cfg, "--redis-match", f"tiny:{TINY_LAYOUT}:0-4:*"))["remote"]
    assert exact["pieces"] == 4
    shown = cli("inspect-chunks", "-c", str(b_cfg))
    assert shown.code == 0 and "Redis 4 key(s) (lmcache:v2:*)" in shown.out, shown.out
    # Nothing was loaded into B by looking.
    assert totals(inspect(b_cfg, "--tier", "memory"))["memory"]["pieces"] == 0
    assert tier_counts(lookup(b_cfg, tokens)["prompts"][0]) == (4, 0, 0, 4)

    # A hung Redis: the count and the lookup say so, within their budgets, and exit 0.
    assert redis_srv.proc is not None
    freeze(redis_srv.proc.pid)
    try:
        start = time.monotonic()
        hung = cli("inspect-chunks", "-c", str(b_cfg), "--redis-budget-ms", "100")
        assert hung.code == 0, hung.err
        assert "Redis at least 0 key(s)" in hung.out and "not counted to the end" in hung.out
        [row] = lookup(b_cfg, tokens)["prompts"]
        assert tier_counts(row) == (0, 0, 0, 0) and row["remote"] in {"timeout", "down"}
        assert time.monotonic() - start < 30  # a hang would hit the CLI's 60 s timeout
    finally:
        os.kill(redis_srv.proc.pid, signal.SIGCONT)


# ---------------------------------------------------------------- bad input, at once


def _raw(url: str, op: RequestType, payload: dict[str, Any]) -> Callable[[], m.Reply]:
    """Send ``payload`` as ``op``'s request as any client could (no struct checks on this side)."""
    def send() -> m.Reply:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(url)
            sock.send_multipart([msgspec.msgpack.encode(1), msgspec.msgpack.encode(op.value),
                                 msgspec.msgpack.encode(payload)])
            assert sock.poll(10_000), "no reply"
            return decode_reply(op, sock.recv_multipart()[2:])
        finally:
            sock.close()
    return send


def test_bad_layouts_and_patterns_get_typed_errors_at_once(
        make_server: Callable[..., ServerProcess]) -> None:
    server = make_server(name="bad")
    peek = {"model_name": "tiny", "world_size": 1, "chunk_hashes": [b"a" * 32]}
    for layout in ("float16:2x4", "x" * 64, "ranks0"):
        with pytest.raises(ProtocolError, match="not a KV layout fingerprint"):
            _raw(server.url, RequestType.PEEK, {**peek, "hint_layout": layout})()
    with pytest.raises(ProtocolError, match="layout"):
        _raw(server.url, RequestType.PEEK, {**peek, "layout": "y" * 65})()
    with pytest.raises(ProtocolError, match="remote_match"):
        _raw(server.url, RequestType.LIST_CHUNKS, {"remote_match": "*" * 5})()
    with pytest.raises(ProtocolError, match="remote_match"):
        _raw(server.url, RequestType.LIST_CHUNKS, {"remote_match": "a" * 100_000})()
    with pytest.raises(ProtocolError, match="remote_budget_ms"):
        _raw(server.url, RequestType.LIST_CHUNKS, {"remote_budget_ms": 10**9})()
    with pytest.raises(ProtocolError, match="tiers"):
        _raw(server.url, RequestType.LIST_CHUNKS, {"tiers": ["tape"]})()
    # Old clients' requests (no new fields) are served as before; the server keeps serving.
    reply = _raw(server.url, RequestType.LIST_CHUNKS, {"limit": 5})()
    assert isinstance(reply, m.ChunkListReply) and [t.tier for t in reply.tiers] == ["memory"]
    reply = _raw(server.url, RequestType.PEEK, peek)()
    assert isinstance(reply, m.PeekReply) and reply.hit_chunks == 0 and reply.tiers == []

    cfg = str(server.config_path)
    for args, expected in (
            (["--redis-match", "*a*b*c*d*e"], "at most 4 '*'"),
            (["--redis-match", "k" * 201], "1 to 200 characters"),
            (["--redis-budget-ms", "0"], "--redis-budget-ms"),
            (["--tier", "tape"], "--tier")):
        result: Result = cli("inspect-chunks", "-c", cfg, *args)
        assert result.code == 2 and expected in result.err, (args, result.err)


# ---------------------------------------------------------------- the peek, in-process

SLOT, NBYTES = 4096, 4000
LAYOUT = layout_key("float16", 2, 8, 16, False)  # 8 KV heads


def _key(i: int, world: int = 1, rank: int = 0) -> ChunkKey:
    return ChunkKey("m", LAYOUT, *rank_heads(LAYOUT, world, rank), bytes([i, 0x5A]) * 16)


def _store(e: CacheEngine, keys: list[ChunkKey]) -> None:
    plan = e.store.begin_store(keys, NBYTES)
    for _, k, view in plan.writes:
        view.copy_(torch.full((NBYTES,), k.chunk_hash[0], dtype=torch.uint8))
    e.store.finish_store(plan)


def _payload(k: ChunkKey) -> memoryview:
    return memoryview(bytes([k.chunk_hash[0]]) * NBYTES)


@pytest.mark.redis
def test_peek_counts_each_chunk_in_the_slowest_tier_it_needs_and_touches_nothing(
        make_redis: Callable[..., RedisServer], tmp_path: Path) -> None:
    """Chunk 0 in memory, 1 on disk, 2 half on disk (TP=2's rank 0) and half in Redis, 3 in Redis
    as TP=2 pieces, 4 nowhere, 5 in memory: the prefix is 4 chunks, 1 + 1 + 2 by tier."""
    redis_srv = make_redis()
    remote = RedisTier(redis_srv.url, timeout_ms=200, retry_interval_s=0.1)
    disk = DiskTier(tmp_path / "disk", 1 << 20)
    e = CacheEngine(MemoryPool.slots(SLOT, 16, pin=False), chunk_size=16, disk=disk, remote=remote)
    try:
        _store(e, [_key(0), _key(5)])
        assert disk.write(_key(1), _payload(_key(1)))
        assert disk.write(_key(2, 2, 0), _payload(_key(2, 2, 0)))
        for k in (_key(2, 2, 1), _key(3, 2, 0), _key(3, 2, 1)):
            assert remote.put(k, _payload(k))
        hashes = [_key(i).chunk_hash for i in range(6)]
        before = e.snapshot()
        assert e.tiers is not None
        for world in (1, 2):  # TP=2 reads the TP=1 pieces' halves, and the TP=2 pieces
            counts = e.tiers.peek("m", [GroupTarget(LAYOUT, world_heads(LAYOUT, world))], hashes,
                                  timeout_s=5)
            assert (counts.memory, counts.disk, counts.remote_chunks, counts.remote) == (
                1, 1, 2, "asked"), world
            assert counts.hits == 4
        after = e.snapshot()
        assert len(e.store) == 2  # nothing loaded (a load makes a piece resident); a peek has no locks
        assert (after.engine.lookups, after.engine.lookup_hit_chunks,
                after.engine.lookup_miss_chunks) == (before.engine.lookups,
                                                     before.engine.lookup_hit_chunks,
                                                     before.engine.lookup_miss_chunks)
        assert after.disk.loaded_chunks == before.disk.loaded_chunks
        assert (after.remote.loaded_chunks, after.remote.lookup_timeouts) == (
            before.remote.loaded_chunks, before.remote.lookup_timeouts)
        # Without Redis the prefix stops at the first chunk that needs it.
        remote.stop()
        redis_srv.stop()
        counts = e.tiers.peek("m", [GroupTarget(LAYOUT, world_heads(LAYOUT, 1))], hashes,
                              timeout_s=2)
        assert (counts.hits, counts.memory, counts.disk) == (2, 1, 1)
        assert counts.remote in {"down", "timeout"}
    finally:
        remote.stop()


@pytest.mark.redis
def test_redis_count_is_by_pattern_and_cut_short_at_its_deadline(
        make_redis: Callable[..., RedisServer]) -> None:
    redis_srv = make_redis()
    tier = RedisTier(redis_srv.url, timeout_ms=500, key_prefix="lm*c")
    with redis_srv.client() as client:
        pipe = client.pipeline(transaction=False)
        for i in range(2500):
            pipe.set(f"lm*c:v2:a*b:{LAYOUT}:0-8:{i:064x}", b"x")
        for i in range(300):
            pipe.set(f"lm*c:v2:aXb:{LAYOUT}:0-8:{i:064x}", b"x")
            pipe.set(f"lmXc:v2:a*b:{LAYOUT}:0-8:{i:064x}", b"x")  # another prefix: never counted
        pipe.execute()
    try:
        everything = tier.count_keys("*", time.monotonic() + 10)
        assert everything.complete and everything.pattern == "lm\\*c:v2:*"
        assert 2800 <= everything.keys < 2800 + 100  # SCAN may repeat a key while Redis rehashes
        model = tier.count_keys(glob_escape("a*b") + ":*", time.monotonic() + 10)
        assert model.complete and 2500 <= model.keys < 2600
        # A clock that moves a second per look: the count stops at its deadline, a lower bound.
        now = [0.0]

        def clock() -> float:
            now[0] += 1.0
            return now[0]

        cut = tier.count_keys("*", 2.5, clock=clock)
        assert not cut.complete and cut.error == "" and 0 < cut.keys < 2800
        redis_srv.stop()
        down = tier.count_keys("*", time.monotonic() + 10)
        assert not down.complete and down.keys == 0 and down.error
    finally:
        tier.stop()


@pytest.mark.redis
def test_redis_count_on_a_cluster_scans_its_primaries(make_redis: Callable[..., RedisServer]) -> None:
    cluster = make_redis(cluster=True)
    tier = RedisTier(cluster.url, timeout_ms=500)
    try:
        client = tier.client()
        for i in range(50):
            client.set(f"lmcache:v2:m:{LAYOUT}:0-8:{i:064x}", b"x")
        client.set(f"other:v2:m:{LAYOUT}:0-8:{0:064x}", b"x")
        counted = tier.count_keys("*", time.monotonic() + 10)
        assert (counted.keys, counted.complete, counted.pattern) == (50, True, "lmcache:v2:*")
    finally:
        tier.stop()
