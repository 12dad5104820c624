"""ipc:// socket files: claimed before a bind, removed only while they are still ours.

libzmq silently replaces a socket file that already exists when it binds, so a second process
binding the same path would steal the first one's traffic (and remove its file when it stops,
leaving the first unreachable while its probes still say healthy). ``claim`` probes the file
first: a live listener is a BindError, a stale file (its process died) is removed.
``remove_if_ours`` removes a file only if it is still the one this process bound (same inode).
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from lmcache_core.errors import BindError


def remove_if_stale(path: Path) -> bool:
    """Remove ``path`` if no process listens on it (left behind by one that died); True if gone."""
    if not path.exists():
        return True
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:  # refused (nobody listens) or not a socket
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    finally:
        probe.close()
    return False


def claim(path: Path, what: str, hint: str) -> None:
    """Make ``path`` free to bind; BindError naming ``what`` (and ``hint``: who that may be) if a
    live process listens there."""
    if not remove_if_stale(path):
        raise BindError(f"{what} {path} is in use by another process ({hint})")


def inode_of(path: Path) -> int | None:
    """The inode of ``path`` (None if it is gone)."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def remove_if_ours(path: Path, inode: int | None) -> None:
    """Remove ``path`` if it is still the file with ``inode`` (another process may have bound
    the path since: its file stays)."""
    with contextlib.suppress(OSError):
        if inode is not None and os.stat(path).st_ino == inode:
            os.unlink(path)
