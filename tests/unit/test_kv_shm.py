"""SharedSegment: POSIX shared memory by name, zero-copy tensor views, safe close, two processes."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator

import pytest
import torch

from lmcache_core.errors import IncompatibleError, NotRegisteredError, ProtocolError
from lmcache_core.kv.shm import SharedSegment, segment_path, validate_segment_name


@pytest.fixture
def name() -> Iterator[str]:
    n = f"lmcache-test-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    yield n
    if os.path.exists(f"/dev/shm/{n}"):
        os.unlink(f"/dev/shm/{n}")


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return path in f.read()


def test_create_attach_unlink(name: str) -> None:
    seg = SharedSegment.create(name, 4096)
    assert seg.owner and seg.nbytes == 4096 and not seg.closed
    assert os.stat(segment_path(name)).st_mode & 0o777 == 0o600
    other = SharedSegment.attach(name, expected_min_nbytes=4096)
    assert not other.owner and other.nbytes == 4096
    a = seg.tensor(torch.uint8, [4096])
    b = other.tensor(torch.uint8, [4096])
    assert int(b.sum()) == 0  # fresh pages read as zero
    a[100:200] = 7
    assert int(b[100:200].sum()) == 700 and int(b.sum()) == 700
    seg.unlink()
    assert not os.path.exists(segment_path(name))
    b[0] = 1  # mappings outlive the name
    assert int(a[0]) == 1
    seg.unlink()  # idempotent
    del a, b
    assert seg.close() and other.close()


def test_create_refuses_existing(name: str) -> None:
    seg = SharedSegment.create(name, 64)
    with pytest.raises(FileExistsError, match="already exists"):
        SharedSegment.create(name, 64)
    seg.unlink()
    seg.close()


def test_attach_missing_is_not_registered(name: str) -> None:
    with pytest.raises(NotRegisteredError, match="does not exist"):
        SharedSegment.attach(name)


def test_attach_too_small_is_incompatible(name: str) -> None:
    seg = SharedSegment.create(name, 1024)
    with pytest.raises(IncompatibleError, match="1024 bytes, expected at least 4096"):
        SharedSegment.attach(name, expected_min_nbytes=4096)
    seg.unlink()
    seg.close()


@pytest.mark.parametrize("bad", ["", "a/b", "/x", ".", "..", "x" * 201, "a\0b"])
def test_bad_names_refused(bad: str) -> None:
    with pytest.raises(ProtocolError):
        validate_segment_name(bad)
    with pytest.raises(ProtocolError):
        SharedSegment.attach(bad)


def test_name_of_200_chars_ok() -> None:
    assert validate_segment_name("y" * 200) == "y" * 200


def test_tensor_view_dtype_stride_offset(name: str) -> None:
    seg = SharedSegment.create(name, 4096)
    t = seg.tensor(torch.bfloat16, [4, 8], [16, 1], offset_bytes=64)
    assert t.shape == (4, 8) and t.stride() == (16, 1) and t.dtype == torch.bfloat16
    assert t.data_ptr() == seg.address + 64
    t.fill_(1.5)
    raw = seg.tensor(torch.bfloat16, [2048])
    assert float(raw[32]) == 1.5 and float(raw[32 + 8]) == 0.0  # the gap between rows untouched
    assert float(raw[31]) == 0.0
    seg.unlink()


def test_tensor_span_checked(name: str) -> None:
    seg = SharedSegment.create(name, 1024)
    seg.tensor(torch.float32, [256])  # exactly fits
    with pytest.raises(IncompatibleError, match="does not fit"):
        seg.tensor(torch.float32, [257])
    with pytest.raises(IncompatibleError, match="does not fit"):
        seg.tensor(torch.float32, [2, 2], [255, 1])
    with pytest.raises(IncompatibleError, match="does not fit"):
        seg.tensor(torch.uint8, [1], offset_bytes=1024)
    with pytest.raises(IncompatibleError, match="multiple"):
        seg.tensor(torch.float16, [4], offset_bytes=3)
    with pytest.raises(ProtocolError):
        seg.tensor(torch.float16, [4, 4], [4])
    seg.unlink()


def test_close_without_views_unmaps_now(name: str) -> None:
    seg = SharedSegment.create(name, 8192)
    t = seg.tensor(torch.uint8, [8192])
    t[0] = 1
    del t
    assert _mapped(segment_path(name))
    assert seg.close() is True
    gc.collect()
    assert not _mapped(segment_path(name))
    assert seg.close() is True  # idempotent
    with pytest.raises(NotRegisteredError, match="closed"):
        seg.tensor(torch.uint8, [1])
    seg.unlink()


def test_close_with_live_views_keeps_them_valid(name: str) -> None:
    seg = SharedSegment.create(name, 8192)
    view = seg.tensor(torch.int32, [16], offset_bytes=128)
    view.copy_(torch.arange(16, dtype=torch.int32))
    assert seg.close() is False  # a view still holds the mapping
    assert _mapped(segment_path(name))
    assert view.tolist() == list(range(16))  # still valid memory, no crash
    view += 1
    assert int(view.sum()) == sum(range(1, 17))
    del view
    gc.collect()
    assert not _mapped(segment_path(name))  # unmapped with the last view
    seg.unlink()


def test_second_process_attaches_and_writes(name: str) -> None:
    seg = SharedSegment.create(name, 1 << 16)
    mine = seg.tensor(torch.uint8, [1 << 16])
    mine[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    code = textwrap.dedent(f"""
        import torch
        from lmcache_core.kv.shm import SharedSegment
        seg = SharedSegment.attach({name!r}, expected_min_nbytes={1 << 16})
        t = seg.tensor(torch.uint8, [{1 << 16}])
        assert t[:4].tolist() == [1, 2, 3, 4], t[:4].tolist()
        t[1000:1100] = 42
        t[-1] = 9
        print("ok", seg.owner)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "False"]
    assert int(mine[1000:1100].sum()) == 4200 and int(mine[-1]) == 9
    assert os.path.exists(segment_path(name))  # the attacher's exit did not unlink it
    seg.unlink()


def _minor_faults_writing_every_page(t: torch.Tensor) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t[::4096] = 7  # one byte in each page
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_populate_maps_every_page_so_writes_take_no_fault(name: str) -> None:
    """What a server does to a worker's segment it maps (kv.mapped): the pages already exist
    (created, reserved) but this mapping's page tables are empty, so every first write faults;
    after populate none does (a few stray faults of other allocations are allowed)."""
    pages = 1024
    owner = SharedSegment.create(name, pages * 4096)
    cold = SharedSegment.attach(name)
    assert _minor_faults_writing_every_page(cold.tensor(torch.uint8, [pages * 4096])) >= pages // 2
    warm = SharedSegment.attach(name)
    assert warm.populate() is True
    view = warm.tensor(torch.uint8, [pages * 4096])
    assert _minor_faults_writing_every_page(view) < pages // 10
    assert int(owner.tensor(torch.uint8, [pages * 4096])[4096 * 5]) == 7  # contents shared
    del view
    for seg in (cold, warm, owner):
        seg.close()
    owner.unlink()


def test_populate_stops_when_asked_or_closed(name: str) -> None:
    import threading

    seg = SharedSegment.create(name, 8192)
    stop = threading.Event()
    stop.set()
    assert seg.populate(stop) is False
    seg.close()
    assert seg.populate() is False  # closed: nothing mapped to populate
    seg.unlink()
