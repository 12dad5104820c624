"""ipc:// socket plumbing shared by the lookup client and server: bind, connect, remove.

libzmq silently replaces a socket file that already exists when it binds, so a second process with
the same engine id would steal the first one's traffic. ``bind_pull`` claims the file first
(``transport.ipc_files``: a live listener is an error, a stale file is removed); ``unbind`` removes
the file only if it is still the one this socket created.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import zmq

from lmcache_core.errors import BindError
from lmcache_core.transport.ipc_files import claim, remove_if_ours

RECONNECT_IVL_MS = 50
#: A connection whose peer never completes the ZMTP greeting is dropped (and redialled) this soon.
HANDSHAKE_IVL_MS = 1000
RECONNECT_IVL_MAX_MS = 250  # a restarted peer is found again within a quarter second


def bind_pull(context: zmq.Context[Any], path: Path, max_msg_bytes: int,
              rcvhwm: int) -> tuple[zmq.Socket[Any], int]:
    """A PULL socket bound at ``path``, and the inode of the file it created."""
    claim(path, "lookup socket", "another engine with the same engine_id and runtime_dir?")
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    try:
        sock.bind(f"ipc://{path}")
        inode = os.stat(path).st_ino
    except (zmq.ZMQError, OSError) as exc:
        sock.close(0)
        raise BindError(f"cannot bind lookup socket {path}: {exc}") from None
    return sock, inode


def connect_push(context: zmq.Context[Any], path: Path, sndhwm: int) -> zmq.Socket[Any]:
    """A PUSH socket connected to ``path``; messages queue (up to ``sndhwm``) until a peer binds."""
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    try:
        sock.connect(f"ipc://{path}")
    except BaseException:  # e.g. a path too long for ipc (any client may name one): no leak
        sock.close(0)
        raise
    return sock


def unbind(sock: zmq.Socket[Any], path: Path, inode: int) -> None:
    """Remove ``sock``'s socket file (if no one has replaced it since), then close it (linger 0).

    In that order: ZMQ closes the listener asynchronously, and a peer redialling the path in between
    would otherwise reach the dying listener's backlog and hang in its handshake, even after a new
    process has bound the path again.
    """
    remove_if_ours(path, inode)
    sock.close(0)
