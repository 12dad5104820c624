"""LMCache 0.5.6's wire on a real in-process server, from raw DEALER frames: ``wait_prefetch_status``
answered later without blocking anyone (issue 15)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from lmcache_core.config import load_config
from lmcache_core.protocol import messages as m
from lmcache_core.server.app import CacheServer
from tests.integration.servers import TINY

enc = msgspec.msgpack.encode


def call(sock: zmq.Socket, frames: list[bytes], timeout_ms: int = 5000) -> list[bytes] | None:
    sock.send_multipart(frames)
    if not sock.poll(timeout_ms):
        return None
    return sock.recv_multipart()


def key(request_id: str, end: int = 128, **extra: Any) -> dict:
    return {"model_name": "tiny", "world_size": 1, "worker_id": None,
            "token_ids": list(range(200)), "start": 0, "end": end, "request_id": request_id,
            "cache_salt": "", "request_configs": None, "num_kv_readers": 1, **extra}


def dealer(url: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    return sock


def server_config(tmp: str, **extra: Any) -> Any:
    overrides = {f"{s}.{k}": v for s in ("model", "server", "timeouts") for k, v in TINY[s].items()}
    overrides.update({"chunk_size": 64, "server.url": f"ipc://{tmp}/w.sock",
                      "server.http_url": None, **extra})
    return load_config(overrides=overrides)


@pytest.fixture
def short_tmp() -> Iterator[str]:
    tmp = tempfile.mkdtemp(prefix="lmwait", dir="/tmp")  # ipc paths: at most 107 bytes
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def slow_lookups(short_tmp: str) -> Iterator[tuple[CacheServer, threading.Event]]:
    """A server with a disk tier (LMCache lookups then run on a copy thread) whose lookups wait
    for ``release`` and then report 3 hit chunks."""
    srv = CacheServer(server_config(short_tmp, **{"disk.path": f"{short_tmp}/disk"}))
    release = threading.Event()

    def lookup(request: m.LookupRequest, client: bytes) -> m.LookupReply:
        assert release.wait(10)
        return m.LookupReply(hit_chunks=3)

    srv.handlers.lookup = lookup  # type: ignore[method-assign]
    srv.start()
    yield srv, release
    release.set()
    srv.stop(2)


def test_wait_prefetch_status_waits_without_blocking_anyone(slow_lookups) -> None:
    srv, release = slow_lookups
    waiter, other = dealer(srv.url), dealer(srv.url)
    try:
        assert call(waiter, [enc(1), enc(8), enc(key("w")), enc(1)]) == [enc(1), enc(8)]
        assert call(waiter, [enc(2), enc(9), enc("w")]) == [enc(2), enc(9)]  # running: None
        # A wait that times out: None ([uid, op]) at about its timeout.
        started = time.monotonic()
        assert call(waiter, [enc(3), enc(10), enc("w"), enc(0.5)]) == [enc(3), enc(10)]
        assert 0.4 <= time.monotonic() - started < 2.0
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
