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
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache_core.errors import IncompatibleError, NotRegisteredError, ProtocolError
from lmcache_core.kv.tensors import contiguous_stride, span_elems

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
MAX_NAME_LEN = 200


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


class SharedSegment:
    """One mapped shared-memory segment. Build with :meth:`create` or :meth:`attach`."""

    def __init__(self, name: str, mapping: mmap.mmap, nbytes: int, owner: bool) -> None:
        self._name = name
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
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        return cls(name, mapping, nbytes, owner=True)

    @classmethod
    def attach(cls, name: str, expected_min_nbytes: int = 0) -> SharedSegment:
        """Map an existing segment read-write.

        NotRegisteredError if it does not exist; IncompatibleError if it is not a regular file, is
        not accessible, or is smaller than ``expected_min_nbytes``.
        """
        path = segment_path(name)
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
            if st.st_size <= 0 or st.st_size < expected_min_nbytes:
                raise IncompatibleError(
                    f"shared-memory segment {name!r} has {st.st_size} bytes, expected at least "
                    f"{max(expected_min_nbytes, 1)}")
            mapping = _map(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(name, mapping, st.st_size, owner=False)

    # ------------------------------------------------------------------ properties

    @property
    def name(self) -> str:
        return self._name

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def owner(self) -> bool:
        """True when this process created the segment (a forked child is not its owner)."""
        return self._owner_pid == os.getpid()

    @property
    def closed(self) -> bool:
        return self._mmap is None

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


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
