"""A client's closed connection reaches the server (issue 16, finding 3): ``PeerWatch``.

The identity reported is the one its requests came from, so the registry can reap a killed GPU
worker's registration within seconds, whatever host or pid namespace it ran in.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

from lmcache_core.protocol import RequestType
from lmcache_core.protocol import messages as m
from lmcache_core.transport import MessageQueueClient, MessageQueueServer, Route


def _server(url: str, seen: list[bytes], gone: list[bytes],
            event: threading.Event) -> MessageQueueServer:
    def ping(_p: Any, client: bytes) -> m.PingReply:
        seen.append(client)
        return m.PingReply(version="t", chunk_size=16, uptime_s=0.0, pid=0)

    def on_disconnect(identity: bytes) -> None:
        gone.append(identity)
        event.set()

    server = MessageQueueServer(url, workers=1, on_disconnect=on_disconnect)
    server.start({RequestType.PING: Route(ping)})
    return server


def _wait(event: threading.Event) -> float:
    started = time.monotonic()
    assert event.wait(5.0)
    return time.monotonic() - started


def test_a_closed_client_is_reported_with_its_identity(tmp_path: Any) -> None:
    seen: list[bytes] = []
    gone: list[bytes] = []
    event = threading.Event()
    for url in ("tcp://127.0.0.1:0", f"ipc://{tmp_path}/p.sock"):
        seen.clear()
        gone.clear()
        event.clear()
        server = _server(url, seen, gone, event)
        try:
            with MessageQueueClient(server.bound_url) as client:
                client.wait_until_reachable(2)
                assert not gone
            assert _wait(event) < 2.0
            assert gone == seen[:1] and len(set(seen)) == 1
        finally:
            server.stop(1.0)


KILLED = textwrap.dedent("""
    import sys, time
    from lmcache_core.transport import MessageQueueClient
    client = MessageQueueClient(sys.argv[1])
    client.wait_until_reachable(5)
    print("up", flush=True)
    time.sleep(60)
""")


def test_a_killed_process_is_reported(tmp_path: Any) -> None:
    seen: list[bytes] = []
    gone: list[bytes] = []
    event = threading.Event()
    server = _server(f"ipc://{tmp_path}/k.sock", seen, gone, event)
    child = subprocess.Popen([sys.executable, "-c", KILLED, server.bound_url],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        os.kill(child.pid, signal.SIGKILL)  # it cannot say goodbye
        assert _wait(event) < 2.0
        assert gone == seen[:1]
    finally:
        child.kill()
        child.wait(10)
        server.stop(1.0)


def test_without_an_observer_nothing_is_monitored(tmp_path: Any) -> None:
    server = MessageQueueServer(f"ipc://{tmp_path}/n.sock", workers=1)
    server.start({})
    try:
        assert server._peers is None
    finally:
        server.stop(1.0)
