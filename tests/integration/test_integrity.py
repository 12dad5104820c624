"""Integrity end to end, with real processes: checksums taken at store (right after its reply, for
the stores big enough to hand their hash to a lane; given up when stuck at the server's stop), a
corrupt pool piece never served (``integrity.verify_on_retrieve``), corrupt disk files and Redis
values never loaded, and a store that fails part-way leaving nothing visible.

Servers run in-process (``CacheServer``) where a test reaches into the pool or injects a fault, as
``lmcache serve`` processes otherwise; the workers are ``kv_worker.py`` processes (the vLLM worker
adapter over real shared-memory KV caches).
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from lmcache_core.engine.store import PieceView
from lmcache_core.keys import ChunkKey, chain_hashes, layout_key
from lmcache_core.kv.mapped import MappedKVCache
from lmcache_core.protocol import messages as m
from lmcache_core.server.app import CacheServer
from lmcache_core.storage import checksum_lanes, integrity, record
from lmcache_core.storage.disk import file_name
from lmcache_core.storage.remote_keys import redis_key
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.chunks import CHUNK, blocks, lookup, stats, tokens
from tests.integration.servers import RedisServer, WorkerProcess, tiny_config

TINY_LAYOUT = layout_key("float16", 2, 4, 32, False)  # the tiny model at TP=1


def piece_key(toks: list[int], chunk: int) -> ChunkKey:
    return ChunkKey("tiny", TINY_LAYOUT, 0, 4, chain_hashes(toks, CHUNK)[chunk])


def in_process(tmp: Path, **extra: Any) -> CacheServer:
    """A started in-process server: ``tiny_config`` with ``extra``."""
    server = CacheServer(tiny_config(tmp, **extra))
    server.start()
    return server


def test_a_corrupt_pool_piece_is_reported_missing_and_never_served(short_tmp: Path) -> None:
    server = in_process(short_tmp, **{"integrity.verify_on_retrieve": True,
                                      "server.http_url": "http://127.0.0.1:0"})
    worker = WorkerProcess(server.url)
    try:
        toks = tokens(3, seed=1)
        worker("fill", blocks=blocks(0, 3), seed=5)
        want = [worker("digest", blocks=blocks(i, 1))["digest"] for i in range(3)]
        assert worker("store", req="s", keys=toks, blocks=blocks(0, 3))["finished"]
        engine = server.engine
        resident = engine.store.inspect().pieces
        pieces: list[PieceView] = [resident[piece_key(toks, i)] for i in range(3)]
        # Checksums were recorded at store: xxh3-64 of exactly the bytes in the pool.
        for p in pieces:
            assert p.checksum == integrity.checksum(engine.store.memory(p.handle, p.nbytes))
        # One byte of chunk 1 changes in the pool behind the server's back.
        view = engine.store.memory(pieces[1].handle, pieces[1].nbytes)
        view[100] = view[100] ^ 0x10
        with MessageQueueClient(server.url) as client:
            assert lookup(client, toks, "r", lock=True) == 3  # a lookup does not hash
            worker("zero", blocks=blocks(0, 3))
            result = worker("retrieve", req="r", keys=toks, blocks=blocks(0, 3))
            assert result["finished"]
            assert result["load_errors"] == blocks(1, 1)  # vLLM recomputes those blocks
            assert worker("digest", blocks=blocks(0, 1))["digest"] == want[0]
            assert worker("digest", blocks=blocks(2, 1))["digest"] == want[2]
            assert worker("digest", blocks=blocks(1, 1))["digest"] != want[1]  # not written
            s = stats(client)
            assert s.engine.integrity_failures == 1 and s.engine.integrity_verified_chunks == 2
            assert s.engine.chunks == 2 and s.engine.retrieve_missing == 1
            assert lookup(client, toks, "again", lock=False) == 1  # the chunk is gone
        assert server.http_url is not None
        with urllib.request.urlopen(server.http_url + "/metrics", timeout=5) as response:
            text = response.read().decode()
        assert "lmcache_integrity_failures_total 1.0" in text
        assert "lmcache_integrity_verified_chunks_total 2.0" in text
    finally:
        worker.close()
        server.request_stop()
        server.stop()


def test_a_store_failing_between_two_chunk_copies_leaves_nothing_visible(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_gather = MappedKVCache.gather

    def gather_one_then_fail(self: MappedKVCache, block_ids: Sequence[int],
                             slots: Sequence[Any]) -> None:
        real_gather(self, block_ids[:self.blocks_per_chunk], slots[:1])  # chunk 0 copied
        raise RuntimeError("injected: the copy failed after the first chunk")

    server = in_process(short_tmp)
    worker = WorkerProcess(server.url)
    try:
        toks = tokens(3, seed=2)
        worker("fill", blocks=blocks(0, 3), seed=6)
        with MessageQueueClient(server.url) as client:
            monkeypatch.setattr(MappedKVCache, "gather", gather_one_then_fail)
            result = worker("store", req="s", keys=toks, blocks=blocks(0, 3))
            assert result["failed"].get("s")  # reported to vLLM as a failed store
            monkeypatch.setattr(MappedKVCache, "gather", real_gather)
            assert lookup(client, toks, "r", lock=False) == 0  # not even chunk 0
            s = stats(client)
            assert s.engine.chunks == 0 and s.engine.stored_chunks == 0 and s.engine.pool_bytes_allocated == 0
            # The same store again succeeds in full.
            assert worker("store", req="s2", keys=toks, blocks=blocks(0, 3))["finished"]
            assert lookup(client, toks, "r2", lock=False) == 3
    finally:
        worker.close()
        server.request_stop()
        server.stop()


REAL_CHECKSUM = checksum_lanes.checksum


def gated_checksum(buffer: object) -> int:
    """The lanes' checksum, held back until ``GATE`` opens (at most 10 s): a hash held back."""
    GATE[0].wait(10)
    return REAL_CHECKSUM(buffer)


GATE = [threading.Event()]


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every store's pieces hashed on a lane (none inline), each held until the gate opens."""
    GATE[0] = threading.Event()
    monkeypatch.setattr(checksum_lanes, "MAX_INLINE_BYTES", 0)
    monkeypatch.setattr(checksum_lanes, "checksum", gated_checksum)
    yield GATE[0]
    GATE[0].set()


def stored(tmp: Path, n_chunks: int, seed: int) -> tuple[CacheServer, WorkerProcess, list[int]]:
    """An in-process server and a worker that stored ``n_chunks`` chunks through it (answered)."""
    server = in_process(tmp)
    worker = WorkerProcess(server.url)
    toks = tokens(n_chunks, seed)
    try:
        worker("fill", blocks=blocks(0, n_chunks), seed=seed + 3)
        assert worker("store", req="s", keys=toks, blocks=blocks(0, n_chunks))["finished"]
    except BaseException:
        worker.close()
        server.request_stop()
        server.stop()
        raise
    return server, worker, toks


def test_a_store_replies_before_its_checksums_which_are_recorded_right_after(
        short_tmp: Path, gated: threading.Event) -> None:
    server, worker, toks = stored(short_tmp, 3, seed=4)
    try:
        with MessageQueueClient(server.url) as client:
            assert lookup(client, toks, "r", lock=False) == 3  # visible, its hash held back
            assert stats(client).engine.checksums_pending == 3
            gated.set()
            wait_until(lambda: stats(client).engine.checksums_pending == 0)
        engine = server.engine
        resident = engine.store.inspect().pieces
        for i in range(3):
            p = resident[piece_key(toks, i)]
            assert p.readers == 0
            assert p.checksum == integrity.checksum(engine.store.memory(p.handle, p.nbytes))
    finally:
        worker.close()
        server.request_stop()
        server.stop()


def test_stopping_the_server_gives_up_a_stuck_hash_within_its_drain(
        short_tmp: Path, gated: threading.Event) -> None:
    server, worker, _ = stored(short_tmp, 2, seed=5)
    try:
        assert server.engine.snapshot().engine.checksums_pending == 2
    finally:
        worker.close()
        server.request_stop()
        server.stop(drain_timeout_s=0.5)  # the gate stays shut: the hash is stuck
    figures = server.engine.snapshot().engine
    assert figures.checksums_abandoned == 2 and figures.checksums_pending == 0
    assert figures.chunks == 0  # dropped: no piece is left without a checksum


@pytest.mark.redis
def test_corrupt_disk_files_and_redis_values_are_dropped_not_loaded(
        redis_up: RedisServer, tmp_path: Path, make_server, make_worker) -> None:
    disk_dir = tmp_path / "disk"
    srv = make_server({
        "remote": {"url": redis_up.url, "timeout_ms": 200, "retry_interval_s": 0.2},
        "disk": {"path": str(disk_dir), "max_size": "64MiB", "write_through": True}})
    worker = make_worker(srv.url)
    toks = tokens(4, seed=3)
    worker("fill", blocks=blocks(0, 4), seed=9)
    want = worker("digest", blocks=blocks(0, 2))["digest"]
    assert worker("store", req="s", keys=toks, blocks=blocks(0, 4))["finished"]
    with MessageQueueClient(srv.url) as client, redis_up.client() as redis_client:
        wait_until(lambda: stats(client).remote.written_chunks == 4
                   and stats(client).disk.chunks == 4)
        bad = piece_key(toks, 2)
        # Chunk 2's payload changes by one byte on disk and in Redis, behind the server's back
        # (headers intact: only the store-time checksum, payload_xxh3, can tell).
        path = disk_dir / file_name(bad)
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x01
        path.write_bytes(bytes(data))
        rkey = redis_key(f"lmcache:v{record.FORMAT_VERSION}:", bad)
        value = bytearray(redis_client.get(rkey) or b"")
        assert value
        value[-7] ^= 0x01
        redis_client.set(rkey, bytes(value))
        client.request(m.ClearRequest(force=True))
        # Disk first: chunk 2's file fails its check; the lookup stops before it.
        assert lookup(client, toks, "a", lock=False) == 2
        s = stats(client)
        assert s.disk.corrupt == 1 and not path.exists()
        # Then Redis: its value fails too, and is deleted there.
        assert lookup(client, toks, "b", lock=True) == 2
        s = stats(client)
        assert s.remote.corrupt == 1 and not redis_client.exists(rkey)
        # What is served is exactly what was stored.
        worker("zero", blocks=blocks(0, 4))
        result = worker("retrieve", req="b", keys=toks[:2 * CHUNK], blocks=blocks(0, 2))
        assert result["finished"] and not result["load_errors"]
        assert worker("digest", blocks=blocks(0, 2))["digest"] == want
