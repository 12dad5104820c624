"""The server's listening socket: a ROUTER bound with its options and size cap, an ipc:// file only
its user may connect to (never one a live server listens on), and that file's removal when the
server closes (unless another server has bound the path since)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq

from lmcache_core.errors import BindError
from lmcache_core.transport.ipc_files import claim, inode_of, remove_if_ours

_IPC = "ipc://"


@contextlib.contextmanager
def _owner_only_files(active: bool) -> Iterator[None]:
    """Files created meanwhile get mode 0600: an ipc:// socket is then never connectable by other
    users, not even between its bind and the chmod after it. (The umask is per process; the
    server binds at start, before its other threads make files.)"""
    if not active:
        yield
        return
    previous = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(previous)


def bind_router(context: zmq.Context[Any], url: str,
                max_request_bytes: int) -> tuple[zmq.Socket[Any], str, int | None]:
    """A ROUTER socket bound at ``url``, the url it is bound at (the real port for :0), and for
    ipc:// the inode of its socket file (for ``remove_ipc_file``). An ipc:// path a live server
    listens on is a BindError: libzmq would silently take it over."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    # A hard cap well above the soft limit: bigger frames drop the peer instead of eating memory;
    # frames between the two get a TOO_LARGE reply.
    sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_request_bytes)
    path = url[len(_IPC):] if url.startswith(_IPC) else None
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        try:
            claim(Path(path), "server socket", "is another lmcache serve running there?")
        except BindError:
            sock.close(0)
            raise
    try:
        with _owner_only_files(path is not None):
            sock.bind(url)
    except zmq.ZMQError as exc:
        sock.close(0)
        hint = " (is another lmcache serve running there?)" if exc.errno == errno.EADDRINUSE else ""
        raise BindError(f"cannot listen on {url}: {exc.strerror}{hint}") from None
    if path is not None:
        # Only this user may connect: whoever can talk to the server can make it read and write
        # the shared memory it maps.
        os.chmod(path, 0o600)
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    inode = inode_of(Path(path)) if path is not None else None
    return sock, endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint), inode


def remove_ipc_file(bound_url: str, inode: int | None) -> None:
    """Remove an ipc:// url's socket file if it is still the one bound (inode ``inode``): nothing
    for tcp://, when it is gone already, or when another server has bound the path since."""
    if bound_url.startswith(_IPC):
        remove_if_ours(Path(bound_url[len(_IPC):]), inode)
