"""``PeerWatch``: tells the server which clients' connections closed.

A ROUTER socket reports neither directly. Each message's first frame carries the file descriptor
of the connection it came in on (``SRCFD``), and a socket monitor reports each closed descriptor, so
the server learns the identities of a connection that closed, e.g. of a worker that was killed,
within one loop turn. Descriptors are reused: a new connection may get a closed one's number before
its close was read here, so a report is a hint (the registry gives a reported client a short grace
in which any request of it cancels the report), not a verdict.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)
_RCVMORE = int(zmq.RCVMORE)  # an int: the enum member costs ~1 us a frame


class PeerWatch:
    """Connection of each client identity, and a callback for the clients of closed ones."""

    def __init__(self, sock: zmq.Socket[Any], on_disconnect: Callable[[bytes], None]) -> None:
        self._monitor: zmq.Socket[Any] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._on_disconnect = on_disconnect
        self._fd_of: dict[bytes, int] = {}  # live connections' clients only: pruned on close

    @property
    def monitor(self) -> zmq.Socket[Any]:
        """The monitor socket, to poll beside the ROUTER socket."""
        return self._monitor

    def recv(self, sock: zmq.Socket[Any]) -> list[bytes]:
        """One message (as ``recv_multipart``), noting its client's connection."""
        first = sock.recv(zmq.NOBLOCK, copy=False)
        identity = first.bytes
        # A libzmq without SRCFD: nothing to track (reaping then relies on pings and pids).
        with contextlib.suppress(zmq.ZMQError, ValueError, TypeError):
            self._fd_of[identity] = int(first.get(zmq.SRCFD))
        frames = [identity]
        while sock.getsockopt(_RCVMORE):
            frames.append(sock.recv(zmq.NOBLOCK))
        return frames

    def drain(self) -> None:
        """Report the clients of every connection the monitor says closed."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            fd = int(event["value"])
            gone = [identity for identity, known in self._fd_of.items() if known == fd]
            for identity in gone:
                del self._fd_of[identity]
                try:
                    self._on_disconnect(identity)
                except Exception:  # an observer's bug must not stop the loop
                    logger.exception("reporting the disconnect of %s failed", identity.hex())

    def close(self, sock: zmq.Socket[Any]) -> None:
        """Stop monitoring (before ``sock`` closes)."""
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        self._monitor.close(0)
