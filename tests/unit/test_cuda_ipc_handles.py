"""A CUDA registration's IPC handle is checked before torch opens it: torch trusts its fields
(handle lengths, and the reference-counter file it opens, grows and decrements at an unchecked
offset when the server lets the storage go). No GPU needed: the checks run before CUDA."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import msgspec
import pytest

from lmcache_core.errors import IncompatibleError
from lmcache_core.kv.cuda_ipc import REF_COUNTERS_PER_FILE, check_ipc_handle
from lmcache_core.protocol.messages import CudaIpcHandle

PID = os.getpid()


@pytest.fixture
def counter_file() -> Iterator[str]:
    """A reference-counter file as torch makes one for this process (80 KB + header)."""
    name = f"/torch_{PID}_{secrets.randbelow(10**9)}_0"
    with open(f"/dev/shm{name}", "wb") as f:
        f.truncate(8 * REF_COUNTERS_PER_FILE + 64)
    yield name
    os.unlink(f"/dev/shm{name}")


def handle(counter: str, **changes: object) -> CudaIpcHandle:
    good = CudaIpcHandle(device=0, handle=b"h" * 64, storage_nbytes=1 << 20,
                         storage_offset_bytes=0, ref_counter_handle=counter.encode(),
                         ref_counter_offset=3, event_handle=b"e" * 64)
    return msgspec.structs.replace(good, **changes)


def test_a_handle_as_torch_exports_it_passes(counter_file: str) -> None:
    check_ipc_handle(handle(counter_file), PID)
    check_ipc_handle(handle(counter_file, event_handle=None), PID)


@pytest.mark.parametrize("changes", [
    {"handle": b"h" * 63}, {"handle": b""}, {"event_handle": b"e" * 8},  # read past their end
    {"ref_counter_offset": REF_COUNTERS_PER_FILE},  # an unchecked decrement past the file
    {"ref_counter_offset": 2**40},
])
def test_bad_fields_are_refused(counter_file: str, changes: dict) -> None:
    with pytest.raises(IncompatibleError):
        check_ipc_handle(handle(counter_file, **changes), PID)


@pytest.mark.parametrize("name", [
    "/lmcache-segment-of-someone", "/torch_1_2_3",  # not torch's, or another process's
    "/torch_{pid}_1/../x", "/../etc/passwd", "/torch_{pid}_99999999_0",  # traversal; no file
])
def test_other_files_are_never_opened_by_torch(counter_file: str, name: str) -> None:
    with pytest.raises(IncompatibleError):
        check_ipc_handle(handle(name.format(pid=PID)), PID)


def test_a_small_or_foreign_counter_file_is_refused(counter_file: str) -> None:
    with open(f"/dev/shm{counter_file}", "r+b") as f:
        f.truncate(64)  # torch would grow it: not a file of its own
    with pytest.raises(IncompatibleError, match="reference-counter"):
        check_ipc_handle(handle(counter_file), PID)
