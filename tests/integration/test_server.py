"""A real ``lmcache serve`` process with real worker processes over shared memory."""

from __future__ import annotations

import signal
import threading
import time

import msgspec
import pytest
import zmq

from lmcache_core.errors import RequestTooLargeError
from lmcache_core.keys import chain_hashes
from lmcache_core.protocol import messages as m
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.chunks import CHUNK, CHUNK_BYTES, blocks, lookup, tokens
from tests.integration.servers import ServerProcess, WorkerProcess


@pytest.fixture
def client(server):
    with MessageQueueClient(server.url) as c:
        yield c


def info(client) -> m.ServerInfoReply:
    return client.server_info()


def test_store_lookup_retrieve_byte_exact(make_server, make_worker):
    """On a server of its own: its figures are this test's alone."""
    server = make_server()
    worker = make_worker(server.url)
    with MessageQueueClient(server.url) as client:
        toks = tokens(4)
        worker("fill", blocks=blocks(0, 4), seed=1)
        stored = worker("digest", blocks=blocks(0, 4))["digest"]
        assert worker("store", req="a", keys=toks, blocks=blocks(0, 4))["finished"]
        assert lookup(client, toks) == 4
        assert lookup(client, toks[:3 * CHUNK] + [1] * CHUNK) == 3
        assert lookup(client, [9, *toks[1:]]) == 0
        worker("zero", blocks=blocks(8, 4))
        assert lookup(client, toks, lookup_id="a", lock=True) == 4
        result = worker("retrieve", req="a", keys=toks, blocks=blocks(8, 4))
        assert result["finished"] and not result["failed"]
        assert worker("digest", blocks=blocks(8, 4))["digest"] == stored
        stats = info(client).stats
        engine = stats.engine
        assert engine.chunks == 4 and engine.stored_chunks == 4 and engine.retrieved_chunks == 4
        assert stats.engine.locks_held == 0  # the retrieve consumed the lookup's locks
        assert stats.workers.registered_instances == 1
        worker.close()
        # shutdown unregistered (and unmapped)
        wait_until(lambda: info(client).stats.workers.registered_instances == 0)


def test_two_ranks_count_a_chunk_only_when_both_stored(server, client, make_worker):
    ranks = [make_worker(server.url, rank=r, world_size=2) for r in range(2)]
    toks = tokens(4, seed=3)
    for r, worker in enumerate(ranks):
        worker("fill", blocks=blocks(0, 4), seed=10 + r)
    assert ranks[0]("store", req="a", keys=toks, blocks=blocks(0, 4))["finished"]
    assert lookup(client, toks, world_size=2) == 0
    assert ranks[1]("store", req="a", keys=toks[:2 * CHUNK], blocks=blocks(0, 2))["finished"]
    assert lookup(client, toks, world_size=2) == 2
    assert ranks[1]("store", req="a", keys=toks, blocks=blocks(0, 4))["finished"]
    assert lookup(client, toks, world_size=2) == 4
    # both ranks' pieces together hold every head: a TP=1 engine reads them too; 3 ranks
    # cannot split the 8 heads
    assert lookup(client, toks, world_size=1) == 4
    assert lookup(client, toks, world_size=3) == 0
    # each rank gets its own shard back
    assert lookup(client, toks, world_size=2, lookup_id="r", lock=True) == 4
    for worker in ranks:
        want = worker("digest", blocks=blocks(0, 4))["digest"]
        worker("zero", blocks=blocks(4, 4))
        assert worker("retrieve", req="r", keys=toks, blocks=blocks(4, 4))["finished"]
        assert worker("digest", blocks=blocks(4, 4))["digest"] == want


def test_a_store_taken_up_past_its_copy_by_copies_nothing(make_server, make_worker):
    """A store the server takes up past its ``copy_by_ns`` (stalled that long: its worker may have
    given up on it, and vLLM handed a preempted or finished request's blocks to another) copies
    nothing: ``late``, counted, its chunks never visible; one still in time is stored."""
    srv = make_server()
    worker = make_worker(srv.url)
    worker("fill", blocks=blocks(0, 8), seed=4)
    late, on_time = tokens(4, seed=21), tokens(4, seed=22)

    def store(toks: list[int], block_ids: list[int], copy_by_ns: int) -> m.StoreReply:
        return client.request(m.StoreRequest(
            instance_id=worker.hello["instance_id"], chunk_hashes=chain_hashes(toks, CHUNK),
            block_ids=block_ids, copy_by_ns=copy_by_ns))

    with MessageQueueClient(srv.url) as client:
        assert store(late, blocks(0, 4), time.monotonic_ns() - 1) == m.StoreReply(stored=0,
                                                                                 late=4)
        assert lookup(client, late) == 0
        assert info(client).stats.engine.store_late == 4
        assert store(on_time, blocks(4, 4), time.monotonic_ns() + 60 * 10**9).stored == 4
        assert lookup(client, on_time) == 4
        assert "past its copy_by_ns" in srv.log()


def test_eviction_never_takes_a_locked_chunk(tmp_path, make_server, make_worker):
    srv = make_server({"server": {"pool_size": 4 * CHUNK_BYTES}})
    worker = make_worker(srv.url)
    with MessageQueueClient(srv.url) as client:
        a, b = tokens(4, seed=1), tokens(4, seed=2)
        worker("fill", blocks=blocks(0, 8), seed=5)
        assert worker("store", req="a", keys=a, blocks=blocks(0, 4))["finished"]
        assert lookup(client, a, lookup_id="hold", lock=True) == 4
        result = worker("store", req="b", keys=b, blocks=blocks(4, 4))
        assert result["finished"] and "pool is full" in result["failed"]["b"]
        assert lookup(client, a) == 4 and lookup(client, b) == 0
        assert info(client).stats.engine.store_skipped_full == 4
        client.free_lookup_locks("hold")
        assert not worker("store", req="b2", keys=b, blocks=blocks(4, 4))["failed"]
        assert lookup(client, b) == 4 and lookup(client, a) == 0
        assert info(client).stats.engine.evictions == 4


def test_bad_input_gets_typed_errors_while_another_client_is_served(server, client):
    stop = threading.Event()
    pings: list[float] = []

    def keep_pinging() -> None:
        with MessageQueueClient(server.url) as other:
            while not stop.is_set():
                start = time.perf_counter()
                other.wait_until_reachable(5)
                pings.append(time.perf_counter() - start)

    pinger = threading.Thread(target=keep_pinging)
    pinger.start()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 5000)
    raw.connect(server.url)
    try:
        cases = [
            [b"\x01", b"not msgpack", b""],
            [b"\x02", msgspec.msgpack.encode("lmc.nope"), b"\x80"],
            [b"\x03", msgspec.msgpack.encode("lmc.lookup"), b"\xc1"],  # 0xc1: never msgpack
            [b"\x04", msgspec.msgpack.encode("lmc.lookup"), msgspec.msgpack.encode([1, 2])],
            [b"\x05", msgspec.msgpack.encode("lmc.store"), msgspec.msgpack.encode(
                {"instance_id": "x", "chunk_hashes": [], "block_ids": []})],
            [b"\x06", msgspec.msgpack.encode("lmc.store"), msgspec.msgpack.encode(
                {"instance_id": 123, "chunk_hashes": [b"h" * 32], "block_ids": [0, 1, 2, 3]})],
            [b"\x07", msgspec.msgpack.encode("lmc.ping")],
            [b"\x08", msgspec.msgpack.encode("lmc.lookup"), b"\x00" * (17 * 2**20)],
        ]
        codes = []
        for frames in cases:
            raw.send_multipart(frames)
            reply = raw.recv_multipart()
            # The op frame goes back only when it holds a msgpack str or int.
            assert reply[:2] == [frames[0], msgspec.msgpack.encode(None)
                                 if frames[1] == b"not msgpack" else frames[1]]
            codes.append(msgspec.msgpack.decode(reply[2], type=m.ErrorReply).code)
        assert codes == ["bad_request", "unknown_op", "bad_request", "bad_request", "bad_request",
                         "not_registered", "bad_request", "too_large"]
        # LMCache's dialect (its LOOKUP id 8) with a bad payload: acknowledged at once (its status
        # then 0 hits), where LMCache's own server is silent; a ping on the same socket answers.
        raw.send_multipart([b"\x09", msgspec.msgpack.encode(8), b"\x80"])
        raw.send_multipart([b"\x0a", msgspec.msgpack.encode("lmc.ping"), b"\x80"])
        assert raw.recv_multipart() == [b"\x09", msgspec.msgpack.encode(8)]
        assert raw.recv_multipart()[0] == b"\x0a"
    finally:
        raw.close(0)
        stop.set()
        pinger.join(10)
    # a ping takes well under a millisecond; 2 s is what a loop stalled by one of the cases
    # (the 17 MiB frame most of all) would show
    assert pings and max(pings) < 2.0, (len(pings), sorted(pings)[-5:])
    with pytest.raises(RequestTooLargeError):
        lookup(client, tokens(1001))  # the test config allows 1000 keys per request
    assert info(client).stats.transport.errors >= len(cases)


def test_sigterm_stops_cleanly(tmp_path):
    srv = ServerProcess(tmp_path).start()
    worker = WorkerProcess(srv.url)
    try:
        assert srv.stop(signal.SIGTERM) == 0
        assert "stopped" in srv.log()
    finally:
        worker.kill()


@pytest.mark.parametrize("prefault", [True, False])
def test_pool_pages_populated_in_the_background_by_default(tmp_path, prefault):
    """Default: the pool is populated right after the server is ready (SERVER_INFO says when it
    is done, how long it took, and the RSS); ``prefault: false`` leaves the pages to first writes.
    The populate thread's end is not a dead thread: the server keeps serving (and healthy)."""
    overrides = {"server": {"pool_size": "64MiB"}} if prefault else {
        "server": {"pool_size": "64MiB", "prefault": False}}
    srv = ServerProcess(tmp_path, overrides).start()
    try:
        with MessageQueueClient(srv.url) as c:
            def populated() -> m.ServerInfoReply | None:
                reply = info(c)
                return reply if reply.pool_populate == "done" else None

            reply = wait_until(populated, 60) if prefault else info(c)
            if prefault:
                assert reply.pool_populate == "done" and reply.pool_populated_bytes == reply.pool_bytes
                assert reply.pool_populate_s is not None and reply.rss_bytes >= reply.pool_bytes
                # lmcache serve checks its threads every second (kept sleep: it waits for an exit
                # that must not happen; a slow machine can only hide it)
                time.sleep(1.2)
                assert c.wait_until_reachable(2).pid == reply.pid and srv.proc.poll() is None
            else:
                assert (reply.pool_populate, reply.pool_populated_bytes) == ("pending", 0)
                assert reply.pool_populate_s is None and reply.rss_bytes > 0
        # The "ready" panel is printed after the socket is bound: a busy machine may answer
        # SERVER_INFO first (CI's run killed the server before the panel was written).
        wait_until(lambda: "pool pages" in srv.log(), 30, what=lambda: f"the ready panel in {srv.log()!r}")
    finally:
        srv.kill()


def test_a_second_server_on_a_live_ipc_path_is_refused_and_takes_nothing(tmp_path):
    """libzmq silently replaces a live socket file when it binds: a second server on the same
    ipc:// url (or KV events url) took the first one's clients, and removed the file when it
    stopped, leaving the first unreachable while its probes said healthy. It is refused now, and
    a stale file (left by a server that was killed) is still replaced."""
    events = f"ipc://{tmp_path}/events.sock"
    first = ServerProcess(tmp_path, {"server": {"events_url": events}}, name="first").start()
    try:
        for n, url in enumerate((first.url, f"ipc://{tmp_path}/other.sock")):
            second = ServerProcess(tmp_path, {"server": {"url": url, "events_url": events}},
                                   name=f"second{n}")
            second.spawn()
            assert second.proc is not None and second.proc.wait(60) != 0
            assert "in use by another process" in second.log()
        with MessageQueueClient(first.url) as client:
            assert client.ping().pid == first.proc.pid
    finally:
        first.kill()  # SIGKILL: its socket files stay behind
    again = ServerProcess(tmp_path, {"server": {"events_url": events}}, name="first").start()
    try:
        with MessageQueueClient(again.url) as client:
            assert client.ping().pid == again.proc.pid
    finally:
        again.kill()
