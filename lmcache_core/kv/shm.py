"""POSIX shared-memory segments (``/dev/shm/<name>``) mapped with ``mmap``, viewed as tensors.

Not ``multiprocessing.shared_memory``: on Python 3.11 its resource tracker unlinks a segment when
any process that merely attached to it exits. Here only an explicit :meth:`SharedSegment.unlink`
removes the name, and unlinking never invalidates existing mappings.

Lifetime of the mapping: every tensor from :meth:`SharedSegment.tensor` shares one torch storage
built with ``torch.frombuffer`` over the ``mmap`` object, and that storage keeps a reference to the
``mmap`` object (but no buffer export, so ``mmap.close()`` would *not* be refused and would leave
dangling tensors). :meth:`SharedSegment.close` therefore never calls ``mmap.close()``: it drops
the segment's own references, so the pages are unmapped at once when no tensor view remains, and
otherwise when the last view is garbage-collected. No tensor can ever point at unmapped memory.

Whose segments a server may touch: a server maps whatever a client registers, read-write and with
its own privileges, so it must not become a deputy for other programs' shared memory. Names made
by :func:`lmcache_core.kv.share.new_segment_name` carry their creator:
``lmcache[-<word>...]-<pid>-<pid namespace>-<12 random hex>``. :meth:`SharedSegment.attach` with
``owner_pid`` refuses any other name or another pid (:func:`check_segment_name`), and every attach
refuses a file owned by a uid other than this process's or an allowed one
(:func:`check_segment_uid`). The pid namespace is in the name because a pid names a process only
within its namespace: whoever cleans up after a dead owner needs to know the pid is its own.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import stat
import threading
import weakref
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, NamedTuple

from lmcache_core.errors import IncompatibleError, NotRegisteredError, ProtocolError
from lmcache_core.kv.madvise import populate_step
from lmcache_core.kv.tensors import contiguous_stride, span_elems

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
MAX_NAME_LEN = 200
#: One ``madvise`` call of :meth:`SharedSegment.populate` (a few ms; the GIL released): a stop,
#: or a close that should unmap, waits at most one step.
POPULATE_STEP = 8 << 20


def validate_segment_name(name: str) -> str:
    """``name`` if it is a safe segment name (1-200 chars, no '/', no NUL, not '.' or '..')."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise ProtocolError(f"shared-memory name must be 1-{MAX_NAME_LEN} characters: {name!r}")
    if "/" in name or "\0" in name or name in (".", ".."):
        raise ProtocolError(f"invalid shared-memory name {name!r} (no '/', NUL, '.' or '..')")
    return name


def segment_path(name: str) -> str:
    """``/dev/shm/<name>`` after validating ``name``."""
    return os.path.join(SHM_DIR, validate_segment_name(name))


# ---------------------------------------------------------------- whose segment it is

PID_MAX = 2**22  # the ceiling of Linux's pid_max: no process has a larger pid
_OWN_NAME = re.compile(
    r"lmcache(?:-[A-Za-z0-9_.]+)*-(?P<pid>[1-9][0-9]{0,6})-(?P<ns>[0-9]{1,20})-[0-9a-f]{12}")
NAME_FORM = "lmcache[-<word>...]-<pid>-<pid namespace>-<12 hex>"

#: The environment variable naming this process's segment scope. A scope keeps one run's segments
#: apart from another's on one machine: names made under it carry the word ``scope.<scope>``
#: after ``lmcache`` (``scoped_prefix``), and a server's start-up sweep removes only its own
#: scope's names of dead owners (no scope: names without one). A test suite gives all its
#: processes one scope (``tests/conftest.py``), so a second suite's servers never sweep the
#: names its tests left on purpose for a dead pid.
SCOPE_ENV = "LMCACHE_SHM_SCOPE"
_SCOPE_WORD = re.compile(r"[A-Za-z0-9_]{1,32}")
_SCOPE_PREFIX = "scope."


def segment_scope() -> str:
    """This process's scope (``LMCACHE_SHM_SCOPE``), "" for none; ValueError for a value that is
    not 1-32 letters, digits or underscores."""
    scope = os.environ.get(SCOPE_ENV, "")
    if scope and not _SCOPE_WORD.fullmatch(scope):
        raise ValueError(f"{SCOPE_ENV}={scope[:40]!r}: a scope is 1-32 letters, digits or "
                         "underscores")
    return scope


def scoped_prefix(prefix: str) -> str:
    """``prefix`` (``lmcache`` or ``lmcache-...``) with this process's scope word after
    ``lmcache``, if it has a scope and the prefix none yet."""
    scope = segment_scope()
    if not scope or name_scope(prefix + "-") or not (prefix == "lmcache"
                                                     or prefix.startswith("lmcache-")):
        return prefix  # (a prefix of another form stays as it is, and is refused as it was)
    return f"lmcache-{_SCOPE_PREFIX}{scope}{prefix[len('lmcache'):]}"


def name_scope(name: str) -> str:
    """The scope a segment name was made under ("" for none)."""
    for word in name.split("-")[1:]:
        if word.startswith(_SCOPE_PREFIX):
            return word[len(_SCOPE_PREFIX):]
    return ""


class SegmentOwner(NamedTuple):
    """The creator a segment name of this project's form embeds."""

    pid: int
    pid_ns: int  # the inode of its pid namespace; 0 when the creator could not read it


class SegmentFile(NamedTuple):
    """Which file a segment name pointed at when it was mapped (to re-check before unlinking)."""

    name: str
    dev: int
    ino: int
    uid: int


def parse_segment_name(name: str) -> SegmentOwner | None:
    """The owner embedded in a name of this project's form; None for any other name."""
    match = _OWN_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None or int(match["pid"]) > PID_MAX:
        return None
    return SegmentOwner(int(match["pid"]), int(match["ns"]))


def pid_namespace() -> int:
    """This process's pid namespace (inode of ``/proc/self/ns/pid``); 0 when it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


#: LMCache 0.5.6's own CPU segments (its ``CpuShmTensorWrapper``): ``lmcache_kv_<pid>_<n>``.
_LMCACHE_NAME = re.compile(r"lmcache_kv_(?P<pid>[1-9][0-9]{0,6})_(?P<n>[0-9]{1,20})")


def parse_lmcache_segment_name(name: str) -> int | None:
    """The creator's pid in a name of LMCache 0.5.6's own form; None for any other name. Such
    names are admitted for that pid only and never unlinked by this server (their client does)."""
    match = _LMCACHE_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None or int(match["pid"]) > PID_MAX:
        return None
    return int(match["pid"])


def check_segment_name(name: str, owner_pid: int) -> None:
    """IncompatibleError unless ``name`` was made by lmcache (or LMCache) for ``owner_pid``."""
    if parse_lmcache_segment_name(name) == owner_pid:
        return
    owner = parse_segment_name(name)
    if owner is None:
        raise IncompatibleError(
            f"shared-memory segment {name!r} is not an lmcache segment (names are {NAME_FORM}, "
            "from lmcache_core.kv.share.new_segment_name); the server maps no other segment")
    if owner.pid != owner_pid:
        raise IncompatibleError(
            f"shared-memory segment {name!r} was created by process {owner.pid}, not by the "
            f"registering process {owner_pid}; a worker registers only segments it created")


def check_segment_uid(name: str, uid: int, allowed_uids: Collection[int] = ()) -> None:
    """IncompatibleError unless the segment's file owner ``uid`` is ours or allowed."""
    own = os.geteuid()
    if uid != own and uid not in allowed_uids:
        raise IncompatibleError(
            f"shared-memory segment {name!r} is owned by uid {uid}, not by this server's uid "
            f"{own} nor one in server.shm_allowed_uids {sorted(allowed_uids)}; run the workers as "
            "the server's user or allow their uid")


class SharedSegment:
    """One mapped shared-memory segment. Build with :meth:`create` or :meth:`attach`."""

    def __init__(self, name: str, mapping: mmap.mmap, nbytes: int, owner: bool,
                 file: SegmentFile) -> None:
        self._name = name
        self._file = file
        self._mmap: mmap.mmap | None = mapping
        self._nbytes = nbytes
        self._owner_pid = os.getpid() if owner else 0
        self._base: torch.Tensor | None = None  # uint8 over the whole mapping, made lazily

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, name: str, nbytes: int, *, reserve: bool = True) -> SharedSegment:
        """Create ``/dev/shm/<name>`` (must not exist) of ``nbytes`` bytes, mode 0o600, and map it.

        ``reserve`` allocates the pages now (``posix_fallocate``), so a full ``/dev/shm`` fails
        here with ENOSPC instead of a SIGBUS on first touch later. New pages read as zero.
        """
        path = segment_path(name)
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"shared-memory segment size must be a positive int, got {nbytes!r}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise FileExistsError(
                errno.EEXIST, f"shared-memory segment {name!r} already exists", path) from None
        try:
            os.ftruncate(fd, nbytes)
            if reserve:
                os.posix_fallocate(fd, 0, nbytes)
            mapping = _map(fd, nbytes)
            file = _file_of(name, os.fstat(fd))
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        return cls(name, mapping, nbytes, owner=True, file=file)

    @classmethod
    def attach(cls, name: str, expected_min_nbytes: int = 0, *, owner_pid: int | None = None,
               allowed_uids: Collection[int] = ()) -> SharedSegment:
        """Map an existing segment read-write.

        NotRegisteredError if it does not exist; IncompatibleError if it is not a regular file, is
        not accessible, is smaller than ``expected_min_nbytes``, is owned by a uid other than this
        process's euid and ``allowed_uids``, or (with ``owner_pid``) its name is not one lmcache
        made for that process.
        """
        path = segment_path(name)
        if owner_pid is not None:
            check_segment_name(name, owner_pid)  # before opening anything
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotRegisteredError(
                f"shared-memory segment {name!r} does not exist ({path}); it was released or its "
                "owner exited") from None
        except OSError as exc:
            raise IncompatibleError(
                f"cannot open shared-memory segment {name!r}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IncompatibleError(f"{path} is not a shared-memory segment")
            check_segment_uid(name, st.st_uid, allowed_uids)
            if st.st_size <= 0 or st.st_size < expected_min_nbytes:
                raise IncompatibleError(
                    f"shared-memory segment {name!r} has {st.st_size} bytes, expected at least "
                    f"{max(expected_min_nbytes, 1)}")
            mapping = _map(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(name, mapping, st.st_size, owner=False, file=_file_of(name, st))

    # ------------------------------------------------------------------ properties

    @property
    def name(self) -> str:
        return self._name

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def file(self) -> SegmentFile:
        """The file (device, inode, owner uid) the name pointed at when it was mapped."""
        return self._file

    @property
    def owner(self) -> bool:
        """True when this process created the segment (a forked child is not its owner)."""
        return self._owner_pid == os.getpid()

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def shrunk(self) -> int | None:
        """The file's size now, if its owner truncated it below what is mapped (touching a page
        past its end would kill this process with SIGBUS); else None. One fstat."""
        mapping = self._mmap
        if mapping is None:
            return None
        size = mapping.size()  # fstat of the mapping's own descriptor: this inode, not the name
        return size if size < self._nbytes else None

    @property
    def address(self) -> int:
        """The virtual address of the first byte of this process's mapping."""
        return self._base_tensor().data_ptr()

    # ------------------------------------------------------------------ views

    def tensor(
        self,
        dtype: torch.dtype,
        shape: Sequence[int],
        stride: Sequence[int] | None = None,
        offset_bytes: int = 0,
    ) -> torch.Tensor:
        """A zero-copy view of ``dtype``/``shape``/``stride`` starting ``offset_bytes`` in.

        All views of one segment share one storage. IncompatibleError if the byte span does not
        fit in the segment or ``offset_bytes`` is not a multiple of the item size.
        """
        import torch

        shape = [int(s) for s in shape]
        stride = contiguous_stride(shape) if stride is None else [int(s) for s in stride]
        itemsize = dtype.itemsize
        span = span_elems(shape, stride) * itemsize
        if offset_bytes < 0 or offset_bytes % itemsize:
            raise IncompatibleError(
                f"offset {offset_bytes} in segment {self._name!r} is not a non-negative multiple "
                f"of the {dtype} item size {itemsize}")
        if offset_bytes + span > self._nbytes:
            raise IncompatibleError(
                f"tensor {shape} (stride {stride}, {span} bytes) at offset {offset_bytes} does "
                f"not fit in segment {self._name!r} of {self._nbytes} bytes")
        storage = self._base_tensor().untyped_storage()
        view = torch.empty((0,), dtype=dtype)
        return view.set_(storage, offset_bytes // itemsize, shape, stride)

    def _base_tensor(self) -> torch.Tensor:
        if self._mmap is None:
            raise NotRegisteredError(f"shared-memory segment {self._name!r} is closed")
        if self._base is None:
            import torch

            self._base = torch.frombuffer(self._mmap, dtype=torch.uint8)
        return self._base

    # ------------------------------------------------------------------ page tables

    def populate(self, stop: threading.Event | None = None) -> bool | None:
        """Map every page of the segment into this process now (``MADV_POPULATE_WRITE``, Linux
        >= 5.14; the contents are left as they are), so later copies take no page fault: each
        4 KiB page touched for the first time costs a fault of ~1-3 us, which made a 24 MiB load
        into blocks this process had not touched yet 2.5x slower (scripts/profile_hit.py). The
        pages of a segment made by :meth:`create` exist already: only page tables are added.

        Steps of ``POPULATE_STEP`` through ctypes (the GIL is released); between steps the
        mapping is not held, so a :meth:`close` meanwhile unmaps within one step. True when done;
        False when ``stop`` was set or the segment closed; None when the kernel lacks the advice.
        OSError for another failure (e.g. EFAULT: the owner truncated the file)."""
        try:
            address = self.address  # of this mapping: the same until it is unmapped
        except NotRegisteredError:  # closed
            return False
        for offset in range(0, self._nbytes, POPULATE_STEP):
            mapping = self._mmap
            if mapping is None or (stop is not None and stop.is_set()):
                return False
            length = min(POPULATE_STEP, self._nbytes - offset)
            try:
                if not populate_step(address + offset, length, offset == 0,
                                     f" of {self._name!r}"):
                    return None
            finally:
                del mapping  # not held between steps (see close)
        return True

    # ------------------------------------------------------------------ teardown

    def close(self) -> bool:
        """Drop this segment's hold on the mapping; True if it was unmapped right now.

        Views from :meth:`tensor` that are still alive keep the pages mapped (and valid) until the
        last one is dropped; then they are unmapped. Idempotent.
        """
        if self._mmap is None:
            return True
        ref = weakref.ref(self._mmap)
        self._base = None  # frees the shared storage if no view holds it
        self._mmap = None
        return ref() is None

    def unlink(self) -> None:
        """Remove the name from ``/dev/shm`` (mappings stay valid). Idempotent."""
        _unlink_quietly(segment_path(self._name))

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        role = "owner" if self.owner else "attached"
        return f"SharedSegment({self._name!r}, {self._nbytes} bytes, {role}, {state})"




def _map(fd: int, nbytes: int) -> mmap.mmap:
    return mmap.mmap(
        fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _file_of(name: str, st: os.stat_result) -> SegmentFile:
    return SegmentFile(name, st.st_dev, st.st_ino, st.st_uid)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
