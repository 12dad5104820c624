"""MemoryPool: one preallocated tensor, O(1) slots, zero-copy views, pinning fallback."""

from __future__ import annotations

import logging
import time

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
