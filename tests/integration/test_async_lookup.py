"""The async lookup over real processes: a client here, two spawned workers with engines and servers.

Worker 0 holds the prompt's first 5 chunks, worker 1 its first 3 (each its own rank's shard), so a
lookup reports 3 chunks of tokens: the minimum over the workers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from lmcache_core.lookup_client import LMCacheAsyncLookupClient, LMCacheEngineConfig, LMCacheMetadata
from lmcache_core.lookup_client.messages import LookupCleanupMsg, LookupRequestMsg, encode
from tests.harness import wait_until
from tests.integration.lookup_worker import GATE_PREFIX, MODEL, LookupWorker

CHUNK = 16
TOKENS = list(range(1000, 1000 + 7 * CHUNK + 5))  # 7 complete chunks and a partial one
HELD = (5, 3)  # chunks held by worker 0 and worker 1
EXPECTED = min(HELD) * CHUNK
ENGINE_ID = "t"


class Cluster:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="lkt", dir="/tmp")  # short: ipc paths max 107 bytes
        self.workers: list[LookupWorker | None] = [None, None]
        self.ensure()

    def _spawn(self, rank: int) -> LookupWorker:
        return LookupWorker(self.dir, ENGINE_ID, rank, 2, TOKENS, CHUNK, HELD[rank])

    def ensure(self) -> None:
        """(Re)start whichever worker is not running; both start in parallel."""
        started: list[LookupWorker] = []
        for rank, worker in enumerate(self.workers):
            if worker is None or not worker.alive():
                started.append(self._spawn(rank))
                self.workers[rank] = started[-1]
        for worker in started:
            worker.wait_ready()

    def __getitem__(self, rank: int) -> LookupWorker:
        worker = self.workers[rank]
        assert worker is not None
        return worker

    def metadata(self) -> LMCacheMetadata:
        return LMCacheMetadata(model_name=MODEL, world_size=2, engine_id=ENGINE_ID, runtime_dir=self.dir)

    def close(self) -> None:
        for worker in self.workers:
            if worker is not None:
                worker.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


@pytest.fixture
def make_client(cluster: Cluster) -> Iterator[Callable[..., LMCacheAsyncLookupClient]]:
    cluster.ensure()
    made: list[LMCacheAsyncLookupClient] = []

    def make(timeout_ms: int = 10_000, **kw: Any) -> LMCacheAsyncLookupClient:
        client = LMCacheAsyncLookupClient(
            LMCacheEngineConfig(chunk_size=CHUNK, lookup_timeout_ms=timeout_ms), cluster.metadata(),
            **kw)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()
        assert not os.path.exists(client.socket_path)


def hit_tokens(client: LMCacheAsyncLookupClient, cluster: Cluster, lookup_id: str) -> int | None:
    """The lookup's result; on anything but EXPECTED, an error that shows both sides' counters."""
    result = client.wait_for_result(lookup_id, 10)
    if result != EXPECTED:
        workers = [w("stats") if w is not None and w.alive() else "dead" for w in cluster.workers]
        raise AssertionError(f"{lookup_id}: {result} hit tokens, not {EXPECTED}; client "
                             f"{client.stats()}; workers {workers}")
    return result


def test_reports_the_minimum_over_workers_and_pins_each_workers_hits(cluster, make_client):
    client = make_client()
    assert client.lookup_cache("a") == -1
    assert client.lookup(TOKENS, "a") is None
    hit_tokens(client, cluster, "a")
    assert client.lookup_cache("a") == EXPECTED
    assert [cluster[r]("locks", "a") for r in (0, 1)] == list(HELD)  # held for the retrieve

    # Microseconds, not a 10 ms backoff: the bound (1 ms a call, ~300x what it takes) only
    # catches a poll that waits (100 s here); scripts/bench/bench_async_lookup.py measures the speed.
    start = time.perf_counter()
    for _ in range(10_000):
        client.lookup_cache("a")
    assert time.perf_counter() - start < 10

    client.cancel_lookup("a")  # the request went away after its lookup: release the pins
    assert client.lookup_cache("a") == -1
    wait_until(lambda: [cluster[r]("locks", "a") for r in (0, 1)] == [0, 0])


def test_clear_keeps_the_pins_for_the_retrieve_and_short_prompts_answer_at_once(cluster, make_client):
    client = make_client()
    client.lookup(TOKENS, "b")
    hit_tokens(client, cluster, "b")
    client.clear_lookup_status("b")
    assert client.lookup_cache("b") == -1
    assert [cluster[r]("locks", "b") for r in (0, 1)] == list(HELD)
    assert [cluster[r]("free", "b") for r in (0, 1)] == list(HELD)  # the retrieve's release
    client.lookup(TOKENS[:CHUNK - 1], "short")  # no complete chunk: nothing to ask
    assert client.lookup_cache("short") == 0


def test_cancel_before_the_answer_releases_the_late_pins(cluster, make_client):
    client = make_client()
    before = [cluster[r]("stats") for r in (0, 1)]
    lookup_id = GATE_PREFIX + "c"
    client.lookup(TOKENS, lookup_id)  # the workers hold their answers until released
    client.cancel_lookup(lookup_id)
    assert client.lookup_cache(lookup_id) == -1
    for r in (0, 1):
        cluster[r]("release")

    def released(rank: int) -> bool:
        stats = cluster[rank]("stats")
        return (stats["lookup_hit_chunks"] - before[rank]["lookup_hit_chunks"] == HELD[rank]
                and stats["server_cleanups"] > before[rank]["server_cleanups"]
                and cluster[rank]("locks", lookup_id) == 0)

    wait_until(lambda: released(0) and released(1))
    assert client.stats()["late_answers"] == 2
    assert client.lookup_cache(lookup_id) == -1


def test_a_thousand_lookups_in_flight(cluster, make_client):
    client = make_client(timeout_ms=30_000)
    ids = [f"many-{i}" for i in range(1000)]
    for lookup_id in ids:
        assert client.lookup(TOKENS, lookup_id) is None
    assert client.stats()["running"] > 0  # they really were in flight together
    assert {client.wait_for_result(lookup_id, 30) for lookup_id in ids} == {EXPECTED}
    stats = client.stats()
    assert stats["completed"] == 1000 and stats["timeouts"] == 0
    for lookup_id in ids:
        client.cancel_lookup(lookup_id)
    wait_until(lambda: all(cluster[r]("stats")["locks_held"] == 0 for r in (0, 1)))


def test_garbage_on_both_sockets_is_dropped_and_the_threads_keep_running(cluster, make_client):
    client = make_client()
    meta = cluster.metadata()
    before = cluster[0]("stats")["server_malformed"]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    to_worker = ctx.socket(zmq.PUSH)
    to_client = ctx.socket(zmq.PUSH)
    try:
        to_worker.setsockopt(zmq.LINGER, 1000)
        to_client.setsockopt(zmq.LINGER, 1000)
        to_worker.connect(f"ipc://{meta.worker_socket(0)}")
        to_client.connect(f"ipc://{client.socket_path}")
        junk = [b"", b"\xff\x00garbage", os.urandom(200), msgspec.msgpack.encode({"type": "x"}),
                msgspec.msgpack.encode(["lookup.request", "id", 1, "../x.sock", [], []])]
        for frame in junk:
            to_worker.send(frame)
        to_worker.send_multipart([b"two", b"frames"])
        for frame in [*junk, encode(LookupCleanupMsg(lookup_id="x", seq=1)),
                      encode(LookupRequestMsg(lookup_id="x", seq=1, reply_to=client.reply_to, hashes=[],
                                              offsets=[]))]:
            to_client.send(frame)
        wait_until(lambda: cluster[0]("stats")["server_malformed"] - before == len(junk) + 2)
        wait_until(lambda: client.stats()["malformed"] == len(junk) + 2)
    finally:
        to_worker.close(0)
        to_client.close(0)
    client.lookup(TOKENS, "after-garbage")
    hit_tokens(client, cluster, "after-garbage")
    client.cancel_lookup("after-garbage")


def test_a_dead_worker_times_out_to_zero_and_the_live_worker_releases_its_pins(
        cluster, make_client, fake_clock):
    timeout_ms = 400
    client = make_client(timeout_ms=timeout_ms, clock=fake_clock)
    client.lookup(TOKENS, "warm")  # both connections up before the kill
    hit_tokens(client, cluster, "warm")
    client.cancel_lookup("warm")
    before = cluster[0]("stats")
    cluster[1].kill()

    client.lookup(TOKENS, "dead")
    wait_until(lambda: cluster[0]("locks", "dead") == HELD[0])  # the live worker answered
    assert client.lookup_cache("dead") is None  # (the scheduler polls: it never waits)
    fake_clock.advance(timeout_ms / 1000 - 0.01)
    assert client.lookup_cache("dead") is None  # still within its timeout
    fake_clock.advance(0.02)
    assert client.lookup_cache("dead") == 0  # past it: a miss, and cancelled
    assert client.stats()["timeouts"] == 1

    def released() -> bool:
        stats = cluster[0]("stats")
        return (stats["lookup_hit_chunks"] - before["lookup_hit_chunks"] == HELD[0]  # it pinned 5
                and stats["server_cleanups"] > before["server_cleanups"]
                and cluster[0]("locks", "dead") == 0)

    wait_until(released)

    cluster.ensure()  # a new worker 1 replaces the dead one's stale socket file
    attempts = iter(range(20))  # until the client's PUSH has reconnected (at most 250 ms apart)

    def revived() -> bool:
        lookup_id = f"revived-{next(attempts)}"
        client.lookup(TOKENS, lookup_id)
        result = client.wait_for_result(lookup_id, 10)
        client.cancel_lookup(lookup_id)
        return result == EXPECTED

    wait_until(revived)
    # Requests queued for the dead worker may reach the new one: their answers are late, so cleaned up.
    wait_until(lambda: all(cluster[r]("stats")["locks_held"] == 0 for r in (0, 1)))


def test_close_stops_the_threads_and_removes_the_socket_files(cluster, make_client):
    client = make_client()
    client.lookup(TOKENS, "last")
    hit_tokens(client, cluster, "last")
    path = client.socket_path
    client.close()
    assert not os.path.exists(path)
    assert not any(t.name == "lmcache-lookup-client" for t in threading.enumerate())
    client.lookup(TOKENS, "closed")  # a closed client reports 0: vLLM recomputes
    assert client.lookup_cache("closed") == 0
    for report in [cluster[rank]("close") for rank in (0, 1)]:
        assert not report["socket_left"]
        assert not any(name.startswith("lmcache-lookup-server") for name in report["threads"])
