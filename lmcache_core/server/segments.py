"""Cleaning up the shared-memory segments of workers that died: after a reap, and at server start.

A worker unlinks its segments when it exits normally; a killed one cannot, so the server does it for
it. The server unlinks a name only when all of these hold, checked again right before the unlink:

- the name is of this project's form (:func:`lmcache_core.kv.shm.parse_segment_name`), created in
  this server's pid namespace (elsewhere its pid would name some other process);
- the process the name embeds is gone: it does not exist, or it is a zombie (killed, not yet waited
  for by its parent, and never to run again);
- the file is a regular file owned by this server's euid or an allowed uid; after a reap, it is the
  very file (device, inode, owner) the server mapped for that worker.

At start, the sweep also takes only names of this server's own scope (``kv.shm.SCOPE_ENV``: a
test suite's processes share one, so two suites on one machine never remove each other's files),
and leaves any file some process still has open or mapped (another server that registered it,
a process that took the name over): abandoned means used by nobody.

So no client can make the server delete another program's shared memory, nor a live worker's.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Collection, Sequence

from lmcache_core.kv.shm import (
    PID_MAX,
    SHM_DIR,
    SegmentFile,
    SegmentOwner,
    name_scope,
    parse_segment_name,
    pid_namespace,
    segment_scope,
)

logger = logging.getLogger(__name__)
LOGGED_NAMES = 5  # names shown in the sweep's log line; the rest are counted


def process_gone(pid: int) -> bool:
    """True when no process ``pid`` runs in this pid namespace, or it is a zombie.

    ValueError for a number no process can have (so it can never be verified)."""
    if not 0 < pid <= PID_MAX:
        raise ValueError(f"{pid} is not a pid (1-{PID_MAX})")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, as another user's process; its state below says whether it is a zombie
    return _process_state(pid) in ("Z", "X")


def _process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` ('R', 'S', 'Z', ...); '?' when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:  # hidden by hidepid, or exited just now (the next check sees it gone)
        return "?"
    # "pid (comm) state ...": comm may hold spaces and parentheses, so split after the last ")".
    fields = text.rpartition(")")[2].split()
    return fields[0] if fields else "?"


def owner_in_this_namespace(owner: SegmentOwner | None) -> bool:
    """True when ``owner`` came from a name of our form made in this server's pid namespace."""
    own = pid_namespace()
    return owner is not None and own != 0 and owner.pid_ns == own


def unlink_dead_owner_segments(pid: int, files: Sequence[SegmentFile]) -> list[str]:
    """Unlink the segments a reaped worker ``pid`` mapped to us, if it is gone and each name still
    points at the file we mapped; the names unlinked."""
    if not files or not process_gone(pid):
        return []
    unlinked = []
    for file in files:
        owner = parse_segment_name(file.name)
        if owner is None or owner.pid != pid or not owner_in_this_namespace(owner):
            continue
        st = _lstat(file.name)
        if st is None or not stat.S_ISREG(st.st_mode):
            continue
        if (st.st_dev, st.st_ino, st.st_uid) != (file.dev, file.ino, file.uid):
            continue  # the name was replaced since we mapped it: not the worker's segment
        if _unlink(file.name):
            unlinked.append(file.name)
    return unlinked


def sweep_stale_segments(allowed_uids: Collection[int] = (), shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink this project's segments in ``shm_dir`` whose creator is gone; the names unlinked.

    Run at server start: workers killed while no server ran (or before it reaped them) leave their
    names behind, and nothing else would ever remove them."""
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError as exc:
        logger.warning("cannot list %s for stale shared memory: %s", shm_dir, exc.strerror)
        return []
    uids = {os.geteuid(), *allowed_uids}
    scope = segment_scope()
    stale = [name for name in names if name_scope(name) == scope and _stale(name, uids, shm_dir)]
    in_use = files_in_use({os.path.join(shm_dir, name) for name in stale}) if stale else set()
    swept = [name for name in stale
             if os.path.join(shm_dir, name) not in in_use and _unlink(name, shm_dir)]
    if swept:
        shown = ", ".join(swept[:LOGGED_NAMES])
        more = f" (+{len(swept) - LOGGED_NAMES} more)" if len(swept) > LOGGED_NAMES else ""
        logger.info("removed %d shared-memory segment(s) of exited workers: %s%s", len(swept),
                    shown, more)
    return swept


def files_in_use(paths: Collection[str], proc: str = "/proc") -> set[str]:
    """Those of ``paths`` that some process has open or mapped now, by the file each path names
    (device and inode: a name replaced since is another file). Processes whose tables cannot be
    read (another user's, or gone meanwhile) are passed over."""
    wanted: dict[tuple[int, int], str] = {}
    for path in paths:
        st = _lstat(os.path.basename(path), os.path.dirname(path))
        if st is not None:
            wanted[(st.st_dev, st.st_ino)] = path
    inodes = {ino for _, ino in wanted}
    found: set[str] = set()
    try:
        pids = [entry for entry in os.listdir(proc) if entry.isdigit()]
    except OSError:
        return found
    for pid in pids:
        for key in _mapped(f"{proc}/{pid}/maps", inodes) + _open(f"{proc}/{pid}/fd", inodes):
            if key in wanted:
                found.add(wanted[key])
        if len(found) == len(wanted):
            break
    return found


def _mapped(maps: str, inodes: Collection[int]) -> list[tuple[int, int]]:
    """(device, inode) of the mappings in a ``/proc/<pid>/maps`` whose inode is wanted."""
    out: list[tuple[int, int]] = []
    try:
        with open(maps, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return out
    for line in lines:
        fields = line.split(None, 5)  # address perms offset dev inode path
        if len(fields) >= 5 and fields[4] != b"0" and int(fields[4]) in inodes:
            major, minor = (int(part, 16) for part in fields[3].split(b":"))
            out.append((os.makedev(major, minor), int(fields[4])))
    return out


def _open(fd_dir: str, inodes: Collection[int]) -> list[tuple[int, int]]:
    """(device, inode) of the files a ``/proc/<pid>/fd`` has open whose inode is wanted."""
    out: list[tuple[int, int]] = []
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return out
    for fd in fds:
        try:
            st = os.stat(f"{fd_dir}/{fd}")  # follows the link to the open file itself
        except OSError:
            continue
        if st.st_ino in inodes:
            out.append((st.st_dev, st.st_ino))
    return out


def _stale(name: str, uids: Collection[int], shm_dir: str) -> bool:
    owner = parse_segment_name(name)
    if owner is None or not owner_in_this_namespace(owner):
        return False
    st = _lstat(name, shm_dir)
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_uid not in uids:
        return False
    return process_gone(owner.pid)


def _lstat(name: str, shm_dir: str = SHM_DIR) -> os.stat_result | None:
    try:
        return os.lstat(os.path.join(shm_dir, name))
    except OSError:
        return None


def _unlink(name: str, shm_dir: str = SHM_DIR) -> bool:
    try:
        os.unlink(os.path.join(shm_dir, name))
    except FileNotFoundError:  # its owner's exit handler, or another server, was first
        return False
    except OSError as exc:
        logger.warning("cannot remove shared memory %s: %s", name, exc.strerror)
        return False
    return True
