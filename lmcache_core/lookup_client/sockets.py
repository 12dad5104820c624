"""The lookup client's sockets: the PULL socket it binds for the workers' answers and one PUSH
socket per lookup-server worker (what the I/O core, ``transport.io_core``, does not share).

The PUSH sockets are shared by the caller's thread (requests) and the background thread (cleanups)
under one lock, the PULL socket by every thread that drains it under another; the locks also give
ZMQ the memory barrier it needs when a socket changes threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import zmq

from lmcache_core.lookup_client import _ipc
from lmcache_core.lookup_client.config import LMCacheMetadata
from lmcache_core.transport.io_core import receive_ready

_MAX_RESPONSE_BYTES = 64 * 2**10
_HWM = 100_000


class LookupSockets:
    """Binds the PULL socket at ``pull_path`` and connects a PUSH socket to each worker."""

    def __init__(self, context: zmq.Context[Any], metadata: LMCacheMetadata,
                 worker_ids: Sequence[int], pull_path: Path) -> None:
        self.pull_path = pull_path
        self.pull, self._pull_inode = _ipc.bind_pull(context, pull_path, _MAX_RESPONSE_BYTES, _HWM)
        self._push: dict[int, zmq.Socket[Any]] = {}
        try:
            for worker in worker_ids:
                self._push[worker] = _ipc.connect_push(context, metadata.worker_socket(worker), _HWM)
        except Exception:
            self._close_push()
            _ipc.unbind(self.pull, pull_path, self._pull_inode)
            raise
        self._send_lock = threading.Lock()  # guards the PUSH sockets
        self._recv_lock = threading.Lock()  # guards the PULL socket
        self.pull_open = True

    def send_all(self, buf: bytes) -> list[int]:
        """Send ``buf`` to every worker; returns those whose queue is full (or closed)."""
        failed: list[int] = []
        with self._send_lock:
            for worker, sock in self._push.items():
                try:
                    sock.send(buf, zmq.NOBLOCK)
                except (zmq.Again, zmq.ZMQError):
                    failed.append(worker)
        return failed

    def send(self, buf: bytes, workers: Iterable[int]) -> tuple[int, list[int]]:
        """Send ``buf`` to ``workers`` (unknown ids are skipped): how many sent, and which failed."""
        sent = 0
        failed: list[int] = []
        with self._send_lock:
            for worker in workers:
                sock = self._push.get(worker)
                if sock is None:
                    continue
                try:
                    sock.send(buf, zmq.NOBLOCK)
                    sent += 1
                except zmq.ZMQError:
                    failed.append(worker)
        return sent, failed

    def receive(self, limit: int) -> list[bytes]:
        """Up to ``limit`` answers that have arrived (none once the PULL socket is closed).

        The receive lock is held only for non-blocking receives (microseconds). Reading stops at
        EAGAIN, so the socket's FD signals the next message, or at ``limit``.
        """
        with self._recv_lock:
            if not self.pull_open:
                return []
            return receive_ready(self.pull, limit, multipart=False)

    def close_pull(self) -> None:
        """Close the PULL socket and remove its file (if still its own); receives then get nothing."""
        with self._recv_lock:
            self.pull_open = False
            _ipc.unbind(self.pull, self.pull_path, self._pull_inode)

    def close_push(self) -> None:
        with self._send_lock:
            self._close_push()

    def _close_push(self) -> None:
        for sock in self._push.values():
            sock.close(0)
        self._push.clear()
