"""MemoryPool: one preallocated tensor, O(1) slots, zero-copy views, pinning fallback."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from lmcache_core.errors import ConfigError
from lmcache_core.storage.pool import MemoryPool


def test_shape_and_figures() -> None:
    pool = MemoryPool(slot_bytes=64, num_slots=5, pin=False)
    assert pool.tensor.shape == (5, 64)
    assert pool.tensor.dtype == torch.uint8
    assert (pool.slot_bytes, pool.num_slots, pool.num_free, pool.num_used) == (64, 5, 5, 0)
    assert pool.nbytes == 320
    assert not pool.pinned


def test_from_bytes_floors_to_whole_slots() -> None:
    pool = MemoryPool.from_bytes(1000, 64, pin=False)
    assert pool.num_slots == 15
    assert pool.nbytes == 960


@pytest.mark.parametrize(("pool_bytes", "slot_bytes"), [(63, 64), (0, 64), (100, 0)])
def test_from_bytes_refuses_zero_slots(pool_bytes: int, slot_bytes: int) -> None:
    with pytest.raises(ConfigError, match=str(slot_bytes)):
        MemoryPool.from_bytes(pool_bytes, slot_bytes)


def test_constructor_refuses_nonpositive_sizes() -> None:
    with pytest.raises(ConfigError):
        MemoryPool(0, 4)
    with pytest.raises(ConfigError):
        MemoryPool(64, 0)


def test_allocate_until_full_then_reuse() -> None:
    pool = MemoryPool(8, 3, pin=False)
    slots = [pool.allocate() for _ in range(3)]
    assert slots == [0, 1, 2]  # lowest first: a lightly used pool touches few pages
    assert pool.allocate() is None
    assert pool.num_free == 0
    pool.free(1)
    assert pool.num_free == 1
    assert pool.allocate() == 1
    assert pool.is_allocated(1)


def test_double_free_and_bad_slot_raise() -> None:
    pool = MemoryPool(8, 2, pin=False)
    slot = pool.allocate()
    assert slot is not None
    pool.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(7)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(-1)
    assert pool.num_free == 2


def test_view_is_zero_copy_row() -> None:
    pool = MemoryPool(16, 4, pin=False)
    slot = pool.allocate()
    assert slot is not None
    view = pool.view(slot)
    assert view.shape == (16,)
    assert view.data_ptr() == pool.tensor.data_ptr() + slot * 16
    view.copy_(torch.arange(16, dtype=torch.uint8))
    assert pool.tensor[slot].tolist() == list(range(16))
    head = pool.view(slot, 5)
    assert head.shape == (5,)
    assert head.data_ptr() == view.data_ptr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works on this host")
def test_pin_failure_falls_back_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_core.storage.pool"):
        pool = MemoryPool(64, 2, pin=True)
    assert not pool.pinned
    assert "cannot pin" in caplog.text
    pool.allocate()


def test_pin_default_follows_cuda() -> None:
    pool = MemoryPool(64, 2)
    assert pool.pinned == torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned allocation touches the pages")
def test_large_pool_starts_at_once() -> None:
    start = time.perf_counter()
    pool = MemoryPool.from_bytes(4 << 30, 32 << 20, pin=False)
    elapsed = time.perf_counter() - start
    assert pool.num_slots == 128
    assert elapsed < 0.5


def test_prefault_touches_every_page_and_keeps_slots_usable():
    pool = MemoryPool(slot_bytes=4096 * 4, num_slots=8, pin=False)
    pool.prefault()
    slot = pool.allocate()
    assert slot is not None
    view = pool.view(slot)
    view.fill_(7)
    assert int(view.sum()) == 7 * view.numel()
    assert int(pool.tensor.sum()) == 7 * view.numel()  # every other byte was zeroed


# ---- populate (issue 13): map the pages ahead of use, never racing a store into wrong data

def _pattern(slot: int, n: int) -> torch.Tensor:
    return torch.full((n,), (slot * 37 + 11) % 251, dtype=torch.uint8)


@pytest.mark.parametrize("advised", [True, False], ids=["populate-write", "zero-free-slots"])
def test_populate_keeps_allocated_slots_and_reports(monkeypatch, advised) -> None:
    if not advised:  # a kernel without MADV_POPULATE_WRITE
        monkeypatch.setattr(MemoryPool, "_populate_advised", lambda self, stop: None)
    pool = MemoryPool(slot_bytes=1 << 20, num_slots=16, pin=False)
    assert (pool.populate_state, pool.populated_bytes, pool.populate_s) == ("pending", 0, None)
    held = [pool.allocate() for _ in range(3)]
    for slot in held:
        assert slot is not None
        pool.view(slot).copy_(_pattern(slot, 1 << 20))
    pool.populate()
    assert pool.populate_state == "done" and pool.populated_bytes == pool.nbytes
    assert pool.populate_s is not None and pool.populate_s >= 0
    for slot in held:
        assert torch.equal(pool.view(slot), _pattern(slot, 1 << 20))
    pool.populate()  # a second call is a no-op
    assert pool.populate_state == "done"


@pytest.mark.parametrize("advised", [True, False], ids=["populate-write", "zero-free-slots"])
def test_stores_racing_the_populate_keep_their_bytes(monkeypatch, advised) -> None:
    """Slots are allocated, written and freed on another thread all through the populate; every
    slot still allocated holds exactly what was written, and no write was lost."""
    import threading

    if not advised:
        monkeypatch.setattr(MemoryPool, "_populate_advised", lambda self, stop: None)
    slot_bytes = 256 << 10
    pool = MemoryPool(slot_bytes=slot_bytes, num_slots=256, pin=False)
    populating = threading.Thread(target=pool.populate)
    errors: list[str] = []
    held: list[int] = []
    populating.start()
    rounds = 0
    while populating.is_alive() or rounds < 50:
        slot = pool.allocate()
        if slot is None:
            for old in held[::2]:
                pool.free(old)
            held = held[1::2]
            continue
        pool.view(slot).copy_(_pattern(slot, slot_bytes))
        held.append(slot)
        rounds += 1
    populating.join(10)
    for slot in held:
        if not torch.equal(pool.view(slot), _pattern(slot, slot_bytes)):
            errors.append(f"slot {slot} changed")
    assert not errors and pool.populate_state == "done" and rounds >= 50


def test_populate_stops_when_asked_and_resumes() -> None:
    import threading

    from lmcache_core.storage import pool as pool_mod

    stop = threading.Event()
    stop.set()
    pool = MemoryPool(slot_bytes=pool_mod._POPULATE_STEP, num_slots=2, pin=False)
    pool.populate(stop)
    assert pool.populate_state == "stopped" and pool.populate_s is None
    pool.populate()
    assert pool.populate_state == "done" and pool.populated_bytes == pool.nbytes


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_populate_makes_the_pool_resident() -> None:
    from lmcache_core.storage.pool import process_rss_bytes

    pool = MemoryPool.from_bytes(128 << 20, 4 << 20, pin=False)
    before = process_rss_bytes()
    pool.populate()
    assert process_rss_bytes() - before >= 0.9 * pool.nbytes
    assert int(pool.tensor[::4096].sum()) == 0  # fresh pages still read as zeros
