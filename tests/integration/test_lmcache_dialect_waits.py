"""LMCache 0.5.6's wire on a real in-process server, from raw DEALER frames: ``wait_prefetch_status``
answered later without blocking anyone; lookup locks with ``num_kv_readers`` readers, released by
each retrieve and by ``free_lookup_locks`` over ``[start, end)``; LMCache's ops in the latency
histogram of ``/metrics`` under their own labels (issue 15)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from lmcache_core.protocol import messages as m
from lmcache_core.server.app import CacheServer
from tests.integration.dialect import call, dealer, enc, key, kv_server_with
from tests.integration.servers import tiny_config


def blocked_lookups_server(tmp: Path, **extra: Any) -> tuple[CacheServer, threading.Event]:
    """A started server with a disk tier (LMCache lookups then run on a copy thread) whose
    lookups wait for ``release`` and then report 3 hit chunks."""
    srv = CacheServer(tiny_config(tmp, **{"disk.path": f"{tmp}/disk", **extra}))
    release = threading.Event()

    def lookup(request: m.LookupRequest, client: bytes, readers: int = 1) -> m.LookupReply:
        assert release.wait(10)
        return m.LookupReply(hit_chunks=3)

    srv.handlers.lookup = lookup  # type: ignore[method-assign]
    srv.start()
    return srv, release


@pytest.fixture
def slow_lookups(short_tmp: Path) -> Iterator[tuple[CacheServer, threading.Event]]:
    srv, release = blocked_lookups_server(short_tmp)
    yield srv, release
    release.set()
    srv.stop(2)


@pytest.fixture
def tiered_kv_server(short_tmp: Path
                     ) -> Iterator[tuple[CacheServer, list[np.ndarray], list[msgspec.msgpack.Ext]]]:
    """``kv_server`` with a disk tier: LMCache's lookups run on a copy thread after their ack."""
    yield from kv_server_with(short_tmp, **{"disk.path": f"{short_tmp}/disk"})


def test_wait_prefetch_status_waits_without_blocking_anyone(slow_lookups) -> None:
    srv, release = slow_lookups
    waiter, other = dealer(srv.url), dealer(srv.url)
    try:
        assert call(waiter, [enc(1), enc(8), enc(key("w")), enc(1)]) == [enc(1), enc(8)]
        assert call(waiter, [enc(2), enc(9), enc("w")]) == [enc(2), enc(9)]  # running: None
        # A wait that times out: None ([uid, op]) at about its timeout.
        started = time.monotonic()
        assert call(waiter, [enc(3), enc(10), enc("w"), enc(0.5)]) == [enc(3), enc(10)]
        assert 0.4 <= time.monotonic() - started < 5.0  # 10x the timeout
        # A wait parked on the running lookup: a ping from another client, and one from the
        # waiting client itself, are answered at once.
        waiter.send_multipart([enc(4), enc("wait_prefetch_status"), enc("w"), enc(30.0)])
        time.sleep(0.2)
        started = time.monotonic()
        assert call(other, [enc(5), enc(22), enc(None)]) == [enc(5), enc(22), enc(True)]
        assert call(waiter, [enc(6), enc(24)]) == [enc(6), enc(24), enc("OK")]
        assert time.monotonic() - started < 1.0
        assert not waiter.poll(200)  # the wait is still parked
        release.set()  # the lookup completes: the wait gets its count at once
        assert waiter.poll(5000)
        assert waiter.recv_multipart() == [enc(4), enc("wait_prefetch_status"), enc(3)]
        assert call(waiter, [enc(7), enc(9), enc("w")]) == [enc(7), enc(9), enc(0)]  # once
        # A wait on a finished lookup answers at once.
        assert call(waiter, [enc(8), enc(8), enc(key("v")), enc(1)]) == [enc(8), enc(8)]
        assert call(waiter, [enc(9), enc(10), enc("v"), enc(5.0)]) == [enc(9), enc(10), enc(3)]
    finally:
        waiter.close(0)
        other.close(0)


# ---------------------------------------------------------------- num_kv_readers, free_lookup_locks

def test_lookup_locks_wait_for_every_reader_and_free_releases_its_range(kv_server) -> None:
    srv, layers, descs = kv_server
    rng = np.random.default_rng(15)
    for layer in layers:
        layer[...] = rng.standard_normal(layer.shape).astype(np.float16)
    sent = [layer[:, :12].copy() for layer in layers]  # 3 chunks of 4 blocks
    sock = dealer(srv.url)
    uid = iter(range(100, 1000))

    def ask(op: int, *payloads: Any) -> list[bytes] | None:
        u = next(uid)
        reply = call(sock, [enc(u), enc(op), *map(enc, payloads)])
        assert reply is not None and reply[:2] == [enc(u), enc(op)], reply
        return [msgspec.msgpack.decode(f) for f in reply[2:]]

    try:
        assert ask(1, 7, descs, "tiny", 1, "vllm", {}, []) == []  # register (void)
        stored = key("s", end=192, worker_id=0)
        assert ask(6, stored, 7, [list(range(12))], b"") == [[b"", True]]
        # A lookup for two readers: every hit chunk locked until both read it.
        assert ask(8, key("r", end=192, num_kv_readers=2), 1) == []
        assert ask(9, "r") == [3]
        assert len(srv.engine.store.inspect().locks_of("r")) == 3
        # free_lookup_locks over [128, 192): chunk 2 only; chunks 0 and 1 stay locked.
        assert ask(12, key("r", end=192, num_kv_readers=2) | {"start": 128}, 1) == []
        assert len(srv.engine.store.inspect().locks_of("r")) == 2
        for layer in layers:
            layer[:, 12:] = 0
        dst = [[list(range(12, 20))], [list(range(12, 20))]]  # chunks 0-1 into blocks 12-19
        got = key("r", end=128, worker_id=0, num_kv_readers=2)
        assert ask(7, got, 7, dst[0], b"", 0) == [[b"", True]]  # the first reader
        assert len(srv.engine.store.inspect().locks_of("r")) == 2
        for layer, want in zip(layers, sent, strict=True):
            assert np.array_equal(layer[:, 12:20], want[:, :8])
        assert ask(7, got, 7, dst[1], b"", 0) == [[b"", True]]  # the second: the locks go
        assert srv.engine.store.inspect().locks_of("r") == [] and srv.engine.snapshot().engine.locks_held == 0
        # A retrieve counts a read of every chunk of its range, the whole chunks it skips too.
        assert ask(8, key("k", end=192), 1) == [] and ask(9, "k") == [3]
        assert ask(7, key("k", end=192, worker_id=0), 7, [list(range(12, 24))], b"", 130) == \
            [[b"", True]]
        assert srv.engine.store.inspect().locks_of("k") == []
        # One reader (vLLM's non-MLA default): a free of everything left releases it all.
        assert ask(8, key("q", end=192), 1) == [] and ask(9, "q") == [3]
        assert ask(7, key("q", end=64, worker_id=0), 7, [list(range(12, 16))], b"", 0) == \
            [[b"", True]]
        assert len(srv.engine.store.inspect().locks_of("q")) == 2
        assert ask(12, key("q", end=192), 1) == [] and srv.engine.store.inspect().locks_of("q") == []
    finally:
        sock.close(0)


def test_lmcache_ops_are_timed_under_their_own_labels(kv_server) -> None:
    import urllib.request

    srv, _, descs = kv_server
    sock = dealer(srv.url)
    try:
        assert call(sock, [enc(1), enc(1), enc(7), enc(descs), enc("tiny"), enc(1), enc("vllm"),
                           enc({}), enc([])]) == [enc(1), enc(1)]
        assert call(sock, [enc(2), enc("store"), enc(key("s", worker_id=0)), enc(7),
                           enc([list(range(8))]), enc(b"")]) == [enc(2), enc("store"),
                                                                 enc([b"", True])]
        assert call(sock, [enc(3), enc(8), enc(key("r")), enc(1)]) == [enc(3), enc(8)]
        assert call(sock, [enc(4), enc(9), enc("r")]) == [enc(4), enc(9), enc(2)]
        for uid in (5, 6):
            assert call(sock, [enc(uid), enc(24)]) == [enc(uid), enc(24), enc("OK")]
    finally:
        sock.close(0)
    assert srv.metrics is not None and srv.http_url is not None
    with urllib.request.urlopen(srv.http_url + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    counts = {op: srv.metrics.registry.get_sample_value(
        "lmcache_request_duration_seconds_count", {"op": f"lmcache.{op}"})
        for op in ("register_kv_cache", "store", "lookup", "query_prefetch_status", "noop")}
    assert counts == {"register_kv_cache": 1, "store": 1, "lookup": 1,
                      "query_prefetch_status": 1, "noop": 2}
    assert 'lmcache_request_duration_seconds_count{op="lmcache.store"} 1.0' in text
    # Our own ops keep their labels, untouched by LMCache's.
    assert srv.metrics.registry.get_sample_value(
        "lmcache_request_duration_seconds_count", {"op": "store"}) == 0


def test_a_lookup_dropped_from_a_full_queue_ends_with_no_hits(short_tmp: Path) -> None:
    """An acknowledged LMCache lookup that the copy threads' queue has no room for reports 0 hit
    chunks (its client recomputes) instead of staying "running" until the client gives up."""
    srv, release = blocked_lookups_server(short_tmp, **{"server.max_request_bytes": 4096})
    sock = dealer(srv.url)
    try:
        ids = [f"r{i}" for i in range(20)]  # ~3 KB each: the queue holds 16 KB (4 x 4096)
        tokens = list(range(1000))
        for uid, request_id in enumerate(ids):
            frame = enc(key(request_id, token_ids=tokens))
            assert call(sock, [enc(uid), enc(8), frame, enc(1)]) == [
                enc(uid), enc(8)]
        before = [call(sock, [enc(100 + i), enc(9), enc(r)]) for i, r in enumerate(ids)]
        dropped = [r for r, reply in zip(ids, before, strict=True) if reply is not None
                   and reply[2:] == [enc(0)]]
        running = [r for r, reply in zip(ids, before, strict=True) if reply is not None
                   and reply[2:] == []]
        assert dropped and running and len(dropped) + len(running) == len(ids)
        release.set()
        deadline = time.monotonic() + 10
        while running and time.monotonic() < deadline:
            running = [r for r in running
                       if (reply := call(sock, [enc(999), enc(9), enc(r)])) is not None
                       and reply[2:] == []]
            time.sleep(0.01)
        assert not running  # every one that ran got its result
    finally:
        release.set()
        sock.close(0)
        srv.stop(2)


def test_a_long_lookup_dropped_from_a_full_queue_is_acknowledged(short_tmp: Path) -> None:
    """A long prompt's lookup goes to the copy threads before its ack: dropped there (the queue
    full), it is acknowledged at once, undecoded (its status then 0: it recomputes), rather than
    left without an answer until its client's own timeout."""
    from lmcache_core.server.lmcache.front import INLINE_LOOKUP_BYTES

    srv, release = blocked_lookups_server(short_tmp, **{"server.max_request_bytes": 300 << 10})
    sock = dealer(srv.url)
    try:
        frames = [enc(key(f"long{uid}", end=640, token_ids=[70_000] * 55_000))
                  for uid in range(12)]
        assert all(INLINE_LOOKUP_BYTES < len(frame) < 300 << 10 for frame in frames)
        for uid, frame in enumerate(frames):  # the copy threads and their queue hold a few;
            sock.send_multipart([enc(uid), enc(8), frame, enc(1)])  # the rest are dropped
        acked: list[int] = []
        while sock.poll(1000):  # the blocked ones answer nothing until released
            reply = sock.recv_multipart()
            assert reply[1:] == [enc(8)], reply
            acked.append(msgspec.msgpack.decode(reply[0]))
        assert len(acked) >= 4  # the dropped ones, acknowledged while the others are blocked
        for uid in acked:
            assert call(sock, [enc(99), enc(9), enc(f"long{uid}")]) == [enc(99), enc(9), enc(0)]
    finally:
        release.set()
        sock.close(0)
        srv.stop(2)


def test_a_failing_skipped_release_does_not_hide_the_retrieve_failure(kv_server,
                                                                      monkeypatch) -> None:
    from lmcache_core.errors import NotRegisteredError

    srv, _, descs = kv_server
    dialect = srv.lmcache
    sock = dealer(srv.url)

    def gone(*_args: Any, **_kwargs: Any) -> None:
        raise NotRegisteredError("reaped meanwhile")

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("release failed")

    try:
        assert call(sock, [enc(1), enc(1), enc(7), enc(descs), enc("tiny"), enc(1), enc("vllm"),
                           enc({}), enc([])]) == [enc(1), enc(1)]
        monkeypatch.setattr(dialect.handlers, "retrieve", gone)
        monkeypatch.setattr(srv.engine.store, "release_lookup_reads", broken)
        # The skipped chunks' release fails in the retrieve's finally: the retrieve's own failure
        # is still answered in-band (not silence, as an exception from the finally would make it).
        reply = call(sock, [enc(2), enc(7), enc(key("k", end=192, worker_id=0)), enc(7),
                            enc([list(range(12))]), enc(b""), enc(130)], timeout_ms=3000)
        assert reply == [enc(2), enc(7), enc([b"", False])]
    finally:
        sock.close(0)


def test_a_lookup_whose_session_ends_while_it_runs_leaves_no_locks(tiered_kv_server) -> None:
    """On a tiered server a lookup runs on a copy thread after its ack, and end_session is
    served at once: ended first, it found nothing to release, and the lookup then locked its
    hits for nobody until the lock TTL. The lookup now releases them itself."""
    srv, _, descs = tiered_kv_server
    sock = dealer(srv.url)
    engine = srv.engine
    started, release, looked_up = threading.Event(), threading.Event(), threading.Event()
    lookup = engine.lookup

    def held_back(*args: Any, **kwargs: Any) -> int:
        started.set()
        assert release.wait(10)
        try:
            return lookup(*args, **kwargs)  # locks its hits
        finally:
            looked_up.set()

    try:
        assert call(sock, [enc(1), enc(1), enc(7), enc(descs), enc("tiny"), enc(1),
                           enc("vllm"), enc({}), enc([])]) == [enc(1), enc(1)]
        stored = key("s", end=192, worker_id=0)
        assert call(sock, [enc(2), enc(6), enc(stored), enc(7), enc([list(range(12))]),
                           enc(b"")]) == [enc(2), enc(6), enc([b"", True])]
        engine.lookup = held_back  # type: ignore[method-assign]
        assert call(sock, [enc(3), enc(8), enc(key("e", end=192)), enc(1)]) == [enc(3), enc(8)]
        assert started.wait(5)
        assert call(sock, [enc(4), enc(13), enc("e")]) == [enc(4), enc(13)]  # ended first
        release.set()
        assert looked_up.wait(5)
        deadline = time.monotonic() + 2
        while engine.store.inspect().locks_of("e") or engine.snapshot().engine.locks_held:
            assert time.monotonic() < deadline, engine.store.inspect().locks_of("e")
            time.sleep(0.01)
        assert call(sock, [enc(5), enc(9), enc("e")]) == [enc(5), enc(9), enc(0)]  # not kept
    finally:
        release.set()
        sock.close(0)


@pytest.mark.parametrize("fixture", ["kv_server", "tiered_kv_server"])
def test_two_lookups_each_get_their_own_count_asked_in_the_opposite_order(fixture: str,
                                                                          request) -> None:
    """Two lookups that finish with different hit counts (1 and 3 chunks of the same stored
    prompt), their statuses asked in the opposite order (by query, then by wait): each gets its
    own count, once. Answering every lookup with the count of the latest one to finish (a
    result kept per server, not per request id) passed every other test."""
    srv, _, descs = request.getfixturevalue(fixture)
    sock = dealer(srv.url)
    uid = iter(range(100, 1000))

    def ask(op: int, *payloads: Any) -> list[Any]:
        u = next(uid)
        reply = call(sock, [enc(u), enc(op), *map(enc, payloads)])
        assert reply is not None and reply[:2] == [enc(u), enc(op)], reply
        return [msgspec.msgpack.decode(f) for f in reply[2:]]

    def status(op: int, request_id: str) -> int:
        deadline = time.monotonic() + 10
        while (got := ask(op, request_id) if op == 9 else ask(op, request_id, 5.0)) == []:
            assert time.monotonic() < deadline, f"{request_id} still running"
        return got[0]

    try:
        assert ask(1, 7, descs, "tiny", 1, "vllm", {}, []) == []
        assert ask(6, key("s", end=192, worker_id=0), 7, [list(range(12))], b"") == [[b"", True]]
        for op in (9, 10):  # query_prefetch_status, then wait_prefetch_status
            short, long = f"short{op}", f"long{op}"
            assert ask(8, key(short, end=64), 1) == []  # finishes first, 1 chunk
            assert ask(8, key(long, end=192), 1) == []  # finishes last, 3 chunks
            assert status(op, long) == 3
            assert status(op, short) == 1
            assert ask(9, short) == [0] and ask(9, long) == [0]  # handed over once
            for request_id in (short, long):
                assert ask(12, key(request_id, end=192), 1) == []
                assert ask(13, request_id) == []
        assert srv.engine.snapshot().engine.locks_held == 0
    finally:
        sock.close(0)
