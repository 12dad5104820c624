"""The operators' HTTP listener against idle and abusive clients: bounded threads, no traceback
per client that idles past its timeout, probes answered throughout."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from lmcache_core.server import http
from lmcache_core.server.http import HttpListener
from lmcache_core.supervision import Supervisor
from tests.harness import wait_until


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(http._Handler, "timeout", 0.3)
    monkeypatch.setattr(http, "_MAX_CONNECTIONS", 4, raising=False)
    server = HttpListener("127.0.0.1", 0, CollectorRegistry(),
                          {"/healthz": lambda: (True, {"status": "ok"})}, Supervisor())
    base = server.start()
    yield base
    server.stop()


def healthz(base: str) -> int:
    with urllib.request.urlopen(base + "/healthz", timeout=5) as reply:
        return int(reply.status)


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def test_idle_clients_cost_no_traceback_and_probes_still_answer(
        listener: str, capfd: pytest.CaptureFixture[str]) -> None:
    idle = [connect(listener) for _ in range(3)]
    for sock in idle:  # each recv returns once the server closed it, past its 0.3 s timeout
        sock.settimeout(30)
    assert all(sock.recv(1) == b"" for sock in idle)
    assert healthz(listener) == 200
    for sock in idle:
        sock.close()
    assert "Traceback" not in capfd.readouterr().err


def test_connections_past_the_cap_are_closed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http._Handler, "timeout", 30.0)  # held ones stay for the whole test
    monkeypatch.setattr(http, "_MAX_CONNECTIONS", 4, raising=False)
    server = HttpListener("127.0.0.1", 0, CollectorRegistry(),
                          {"/healthz": lambda: (True, {"status": "ok"})}, Supervisor())
    listener = server.start()
    try:
        closed_at_once(server, listener)
    finally:
        server.stop()


def closed_at_once(server: HttpListener, listener: str) -> None:
    held = [connect(listener) for _ in range(4)]
    slots = server._server._connections if server._server is not None else None
    wait_until(lambda: slots is None or not slots._value,  # type: ignore[attr-defined]
               what="the held connections were never accepted")
    extra = connect(listener)
    start = time.monotonic()
    assert extra.recv(1) == b""  # closed without a thread, not after the held ones' 30 s
    assert time.monotonic() - start < 10
    extra.close()
    for sock in held:
        sock.close()
    wait_until(lambda: answers(listener))  # their threads end (closed by the client): room again


def answers(listener: str) -> bool:
    try:
        return healthz(listener) == 200
    except OSError:
        return False
