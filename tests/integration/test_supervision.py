"""A real ``lmcache serve`` whose thread dies exits non-zero within about a second."""

from __future__ import annotations

import os
import time

import pytest

from lmcache_core.errors import LMCacheError
from lmcache_core.protocol import messages as m
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.servers import FaultyServer


def _poke(url: str, payload: m.PingRequest | m.UnregisterKVCacheRequest) -> None:
    with MessageQueueClient(url, connect_timeout_s=5, request_timeout_s=1) as client, \
            pytest.raises(LMCacheError):
        client.request(payload)


def _wait_for_socket(path: str, timeout_s: float = 120) -> None:
    wait_until(lambda: os.path.exists(path), timeout_s, "the server never bound its socket")


def test_a_dead_transport_loop_ends_the_process(tmp_path):
    server = FaultyServer(tmp_path, "loop").start()
    _wait_for_socket(server.url[len("ipc://"):])
    sent = time.monotonic()
    _poke(server.url, m.PingRequest())  # no answer: the loop died on it
    code, _ = server.exit_code_within(20)
    elapsed = time.monotonic() - sent
    log = server.log()
    assert code == 1, log
    assert "thread lmcache-server-loop died" in log and "InjectedFault" in log
    # ~2 s (the request timeout, then the exit); bounded at 10x: it exits by itself, soon
    assert elapsed < 20, f"exited {elapsed:.2f}s after the loop died (request timeout 1s)"


def test_a_dead_copy_worker_ends_the_process(tmp_path):
    server = FaultyServer(tmp_path, "worker").start()
    sent = time.monotonic()
    _poke(server.url, m.UnregisterKVCacheRequest(instance_id=1))
    code, _ = server.exit_code_within(20)
    assert code == 1 and "thread lmcache-server-worker-0 died" in server.log()
    assert time.monotonic() - sent < 20  # ~2 s: the request timeout, then the exit (10x)


def test_a_dead_housekeeper_ends_the_process(tmp_path):
    server = FaultyServer(tmp_path, "housekeeper").start()
    server.trigger()
    code, waited = server.exit_code_within(20)  # housekeeping runs every second
    assert code == 1 and "thread lmcache-housekeeping died" in server.log()
    assert waited < 20  # ~1-2 s: the next tick, then the exit (10x)
