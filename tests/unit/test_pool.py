"""MemoryPool: slabs and extents of small units over one preallocated buffer; populate, pinning
fallback."""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from lmcache_core.errors import ConfigError
from lmcache_core.storage import pages
from lmcache_core.storage.pool import ALIGN, MemoryPool, auto_slab_bytes

MIB = 1 << 20


def test_buffer_and_figures() -> None:
    pool = MemoryPool(1000, slab_bytes=256, pin=False)
    assert pool.tensor.shape == (768,) and pool.tensor.dtype == torch.uint8
    assert (pool.nbytes, pool.slab_bytes, pool.num_slabs, pool.free_slabs) == (768, 256, 3, 3)
    assert (pool.num_allocated, pool.bytes_allocated, pool.bytes_free) == (0, 0, 768)
    assert pool.max_alloc_bytes == 768 and pool.class_stats() == {}  # an extent of every unit
    assert not pool.pinned and pool.pinned_bytes == 0


def test_size_classes_round_to_align() -> None:
    pool = MemoryPool(4096, slab_bytes=1024, pin=False)
    assert ALIGN == 64
    assert [pool.size_class(n) for n in (1, 63, 64, 65, 1000, 1024)] == [64, 64, 64, 128, 1024,
                                                                           1024]
    for bad in (0, -1, 4097):
        assert not pool.fits(bad) and not pool.can_allocate(bad)
        with pytest.raises(ValueError):
            pool.size_class(bad)
        with pytest.raises(ValueError):
            pool.allocate(bad)
    assert pool.fits(1024) and pool.fits(4096) and pool.can_allocate(1)


def test_every_handle_is_aligned_and_lowest_first() -> None:
    pool = MemoryPool(5000, slab_bytes=1000 // ALIGN * ALIGN, pin=False)  # 960-byte slabs
    handles = [pool.allocate(100) for _ in range(7)]  # class 128: 7 per slab, 64 bytes left
    assert handles == [i * 128 for i in range(7)]
    assert pool.free_slabs == 4 and pool.slab_class(0) == 128 and pool.slab_class(1) == 0
    odd = [pool.allocate(n) for n in (1, 65, 130, 100, 200, 1, 960)]
    assert odd == [960, 1920, 2880, 2048, 3840, 1024, None]  # a new class takes a new slab
    assert pool.free_slabs == 0 and pool.nbytes == 4800
    assert all(h % ALIGN == 0 for h in handles + odd if h is not None)


def test_slabs_assigned_on_demand() -> None:
    pool = MemoryPool(4096, slab_bytes=1024, pin=False)
    first = pool.allocate(512)
    assert first == 0 and pool.free_slabs == 3
    assert pool.allocate(512) == 512 and pool.free_slabs == 3  # same slab
    assert pool.allocate(512) == 1024 and pool.free_slabs == 2  # slab 0 full: take slab 1
    assert pool.class_stats() == {512: (2, 3)}
    assert (pool.num_allocated, pool.bytes_allocated, pool.bytes_free) == (3, 1536, 4096 - 1536)


def test_two_classes_share_the_pool() -> None:
    pool = MemoryPool(4096, slab_bytes=1024, pin=False)
    a = [pool.allocate(1000) for _ in range(2)]  # class 1024: one per slab
    b = [pool.allocate(200) for _ in range(6)]  # class 256: four per slab
    assert a == [0, 1024]
    assert b == [2048, 2304, 2560, 2816, 3072, 3328]
    assert pool.allocate(1000) is None and not pool.can_allocate(1000)
    assert pool.can_allocate(200)  # slab 3 has two free 256-byte slots
    assert pool.allocate(256) == 3584 and pool.allocate(250) == 3840
    assert pool.allocate(1) is None  # class 64 has no slab and none is free
    assert pool.class_stats() == {256: (2, 8), 1024: (2, 2)}
    assert [pool.slab_class(s) for s in range(4)] == [1024, 1024, 256, 256]
    assert pool.slab_handles(2) == [2048, 2304, 2560, 2816]
    assert pool.slab_of(2600) == 2 and pool.class_of(2560) == 256 and pool.class_of(1024) == 1024


def test_a_freed_slab_is_reused_by_another_class() -> None:
    pool = MemoryPool(2048, slab_bytes=1024, pin=False)
    big = pool.allocate(1024)
    small = [pool.allocate(64) for _ in range(16)]
    assert big == 0 and small[0] == 1024 and pool.allocate(64) is None
    pool.free(big)  # (the engine would evict to get here)
    assert pool.slab_class(0) == 0 and pool.free_slabs == 1 and pool.slab_handles(0) == []
    assert pool.allocate(64) == 0  # class 64 takes the freed slab
    assert pool.slab_class(0) == 64 and pool.class_stats() == {64: (2, 17)}
    for handle in [0, *small]:
        pool.free(handle)
    assert pool.free_slabs == 2 and pool.class_stats() == {} and pool.bytes_allocated == 0
    assert pool.allocate(1024) == 0  # the lowest free slab first


def test_a_freed_slot_is_filled_before_a_new_one() -> None:
    pool = MemoryPool(4096, slab_bytes=1024, pin=False)
    handles = [pool.allocate(256) for _ in range(6)]  # slab 0 full, slab 1 half
    pool.free(handles[1])
    assert pool.allocate(256) == handles[1]  # the hole in slab 0, before slab 1's free slots
    assert pool.allocate(256) == 1536


def test_double_free_and_foreign_handles_raise() -> None:
    pool = MemoryPool(2048, slab_bytes=1024, pin=False)
    handle = pool.allocate(64)
    assert handle is not None
    other = pool.allocate(64)
    pool.free(handle)
    for bad in (handle, 7, 64 * 5, 1024, -64, 2048, 10**9, 64.0, "0"):
        with pytest.raises(ValueError, match="not allocated"):
            pool.free(bad)  # type: ignore[arg-type]
        assert not pool.is_allocated(bad)  # type: ignore[arg-type]
    assert pool.is_allocated(other)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pool.class_of(handle)
    with pytest.raises(ValueError):
        pool.slab_class(2)
    with pytest.raises(ValueError):
        pool.slab_handles(-1)
    with pytest.raises(ValueError):
        pool.slab_of(2048)
    assert pool.num_allocated == 1


def test_view_is_zero_copy_and_bounded() -> None:
    pool = MemoryPool(2048, slab_bytes=1024, pin=False)
    pool.allocate(16)
    handle = pool.allocate(100)  # class 128
    assert handle == 1024
    view = pool.view(handle, 100)
    assert view.shape == (100,) and view.dtype == torch.uint8
    assert view.data_ptr() == pool.tensor.data_ptr() + handle
    view.copy_(torch.arange(100, dtype=torch.uint8))
    assert pool.tensor[handle:handle + 100].tolist() == list(range(100))
    assert pool.view(handle).shape == (128,)  # default: the whole slot
    assert pool.view(handle, 128).shape == (128,)
    with pytest.raises(ValueError, match="exceeds"):
        pool.view(handle, 129)
    with pytest.raises(ValueError, match="not allocated"):
        pool.view(handle + 128, 10)
    pool.free(handle)
    with pytest.raises(ValueError, match="not allocated"):
        pool.view(handle, 10)


@pytest.mark.parametrize(("slot_bytes", "cls"), [(64, 64), (100, 128), (4096, 4096)])
def test_slots_behaves_like_the_equal_slot_pool(slot_bytes: int, cls: int) -> None:
    pool = MemoryPool.slots(slot_bytes, 5, pin=False)
    assert (pool.num_slabs, pool.slab_bytes, pool.nbytes) == (5, cls, 5 * cls)
    handles = [pool.allocate(slot_bytes) for _ in range(5)]
    assert handles == [i * cls for i in range(5)]  # lowest first
    assert pool.allocate(slot_bytes) is None and not pool.can_allocate(slot_bytes)
    pool.free(handles[3])
    assert pool.allocate(slot_bytes) == handles[3]
    assert pool.view(handles[0], slot_bytes).shape == (slot_bytes,)


def test_auto_slab_bytes() -> None:
    assert auto_slab_bytes(1000) == 960  # a small pool: one unit, rounded down to ALIGN
    assert auto_slab_bytes(MIB + 100) == MIB + 64
    for nbytes in (2 * MIB, 100 * MIB, 1 << 30, 4 << 30, (64 << 30) + 1000):
        assert auto_slab_bytes(nbytes) == 2 * MIB  # a huge page, whatever the pool
    pool = MemoryPool(1000, pin=False)
    assert (pool.slab_bytes, pool.num_slabs, pool.nbytes) == (960, 1, 960)


@pytest.mark.parametrize(("nbytes", "slab_bytes", "match"), [
    (0, None, "positive"), (-5, 64, "positive"), (1024, 0, "multiple of 64"),
    (1024, -64, "multiple of 64"), (1024, 100, "multiple of 64"), (100, 128, "smaller than one slab"),
    (63, None, "smaller than one 64-byte"),
])
def test_config_errors(nbytes: int, slab_bytes: int | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MemoryPool(nbytes, slab_bytes, pin=False)


@pytest.mark.parametrize(("slot_bytes", "num_slots"), [(0, 4), (64, 0), (-1, 1)])
def test_slots_config_errors(slot_bytes: int, num_slots: int) -> None:
    with pytest.raises(ConfigError, match="positive"):
        MemoryPool.slots(slot_bytes, num_slots)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works on this host")
def test_pin_failure_falls_back_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_core.storage.pool"):
        pool = MemoryPool.slots(64, 2, pin=True)
    assert not pool.pinned and pool.pin_failed
    assert "cannot pin" in caplog.text
    assert pool.allocate(64) == 0


def test_pin_default_follows_cuda() -> None:
    pool = MemoryPool.slots(64, 2)
    assert pool.pinned == torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned allocation touches the pages")
def test_large_pool_starts_at_once() -> None:
    start = time.perf_counter()
    pool = MemoryPool(4 << 30, pin=False)
    elapsed = time.perf_counter() - start
    assert (pool.num_slabs, pool.slab_bytes) == (2048, 2 * MIB)
    assert elapsed < 5  # ~0.04 s here: a bound on a hang (a busy machine), not a speed target


# ---- extents: an allocation over one unit takes consecutive units, one contiguous view


def test_a_large_allocation_is_an_extent_of_consecutive_units() -> None:
    pool = MemoryPool(8 * 1024, slab_bytes=1024, pin=False)
    small = pool.allocate(100)  # unit 0: a slab of class 128
    big = pool.allocate(3 * 1024 + 1)  # 3073 bytes: class 3136, four units
    assert (small, big) == (0, 1024)
    assert pool.class_of(big) == 3136 and pool.units_of(big) == range(1, 5)
    assert pool.units_for(3 * 1024 + 1) == 4 and pool.units_for(1024) == 1
    assert [pool.slab_handles(u) for u in range(6)] == [[0], [big]] * 1 + [[big]] * 3 + [[]]
    assert [pool.slab_class(u) for u in (0, 1, 4, 5)] == [128, 3136, 3136, 0]
    assert pool.free_slabs == 3 and pool.bytes_taken == 5 * 1024
    assert pool.class_stats() == {128: (1, 1), 3136: (4, 1)}
    view = pool.view(big)
    assert view.shape == (3136,) and view.data_ptr() == pool.tensor.data_ptr() + 1024
    assert pool.view(big, 3073).shape == (3073,)
    with pytest.raises(ValueError, match="exceeds"):
        pool.view(big, 3137)
    for inside in (big + 64, 2048, 4096):
        assert not pool.is_allocated(inside)
    assert not pool.can_allocate(4 * 1024) and pool.can_allocate(3 * 1024)
    assert pool.allocate(4 * 1024) is None  # three free units left, at the end
    pool.free(big)
    assert pool.free_slabs == 7 and pool.units_of(small) == range(0, 1)
    assert pool.allocate(7 * 1024) == 1024  # the freed units merged with the tail
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(big + 1024)


def test_extents_take_the_shortest_run_that_holds_them() -> None:
    pool = MemoryPool(10 * 1024, slab_bytes=1024, pin=False)
    a, b, c, d = (pool.allocate(n * 1024) for n in (3, 1, 2, 4))  # units 0-2, 3, 4-5, 6-9
    assert (a, b, c, d) == (0, 3072, 4096, 6144)
    pool.free(a)  # a run of 3
    pool.free(c)  # a run of 2
    assert pool.allocate(1536) == 4096  # two units: the run of two, not the longer one
    assert pool.allocate(1025) == 0  # two units again: the run of three is the only one left
    assert pool.free_slabs == 1 and pool.allocate(1024) == 2048  # the last free unit


def test_allocate_at_places_an_extent_in_a_given_window() -> None:
    pool = MemoryPool(8 * 1024, slab_bytes=1024, pin=False)
    assert pool.allocate_at(2048, 5) == 5 * 1024 and pool.units_of(5 * 1024) == range(5, 7)
    assert pool.allocate_at(2048, 6) is None  # unit 6 is taken
    assert pool.allocate_at(2048, 7) is None  # past the end
    assert pool.allocate_at(3072, 1) == 1024
    assert pool.free_slabs == 3 and pool.allocate(2048) is None  # units 0, 4 and 7 apart
    with pytest.raises(ValueError, match="slot"):
        pool.allocate_at(1024, 0)


@pytest.mark.parametrize("seed", range(4))
def test_random_slots_and_extents_match_a_model_of_units(seed: int) -> None:
    rng = random.Random(seed)
    unit, n = 1024, 16
    pool = MemoryPool(unit * n, slab_bytes=unit, pin=False)
    sizes = [64, 300, 1024, 1025, 2048, 3000, 5 * 1024]
    live: dict[int, int] = {}  # handle -> class
    for _ in range(2000):
        size = _free_one_or_pick_a_size(rng, pool, live, sizes)
        if size is not None:
            cls = -(-size // 64) * 64
            taken = _units_in_use(live, unit)
            if cls <= unit:
                slab_room = any(live[h] == cls and sum(1 for g in live if g // unit == h // unit
                                                       ) < unit // cls for h in live)
                room = slab_room or len(taken) < n
            else:
                need = -(-cls // unit)
                room = any(all(u not in taken for u in range(s, s + need))
                           for s in range(n - need + 1))
            assert pool.can_allocate(size) == room
            handle = pool.allocate(size)
            assert (handle is not None) == room
            if handle is None:
                continue
            assert handle % 64 == 0 and handle not in live
            live[handle] = cls
        spans = sorted((h, h + c) for h, c in live.items())
        assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(spans))
        assert pool.bytes_allocated == sum(live.values())
        assert pool.free_slabs == n - len(_units_in_use(live, unit))
        for h, c in live.items():
            assert pool.units_of(h) == range(h // unit, (h + max(c, 1) - 1) // unit + 1)
    for handle in list(live):
        pool.free(handle)
    assert pool.free_slabs == n and pool.allocate(n * unit) == 0


def _free_one_or_pick_a_size(rng: random.Random, pool: MemoryPool, live: dict[int, int],
                             sizes: list[int]) -> int | None:
    """A random step of a churn: free a live allocation (None), or the size to allocate next."""
    if live and rng.random() < 0.45:
        handle = rng.choice(list(live))
        pool.free(handle)
        del live[handle]
        return None
    return rng.choice(sizes)


def _units_in_use(live: dict[int, int], unit: int) -> set[int]:
    return {u for h, c in live.items() for u in range(h // unit, (h + c - 1) // unit + 1)}


# ---- randomized allocate/free against a simple model


@pytest.mark.parametrize("seed", range(6))
def test_random_allocate_free_matches_a_model(seed: int) -> None:
    rng = random.Random(seed)
    slab = 4096
    pool = MemoryPool(slab * 12, slab_bytes=slab, pin=False)
    sizes = [1, 60, 64, 100, 700, 1365, 2049, 4096]
    live: dict[int, int] = {}  # handle -> class
    for _ in range(3000):
        n = _free_one_or_pick_a_size(rng, pool, live, sizes)
        if n is not None:
            cls = -(-n // 64) * 64
            expected = pool.can_allocate(n)
            handle = pool.allocate(n)
            assert (handle is not None) == expected
            # the model: a slot is free in a slab of this class, or a slab is free
            by_slab: dict[int, list[int]] = {}
            for h, c in live.items():
                by_slab.setdefault(h // slab, []).append(c)
            room = len(by_slab) < 12 or any(
                cs[0] == cls and len(cs) < slab // cls for cs in by_slab.values())
            assert (handle is not None) == room
            if handle is None:
                continue
            assert handle % 64 == 0 and handle not in live
            assert handle // slab == (handle + cls - 1) // slab  # inside one slab
            live[handle] = cls
        spans = sorted((h, h + c) for h, c in live.items())
        assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(spans))
        assert pool.num_allocated == len(live)
        assert pool.bytes_allocated == sum(live.values())
        assert pool.bytes_free == pool.nbytes - sum(live.values())
        slabs = {h // slab for h in live}
        assert pool.free_slabs == 12 - len(slabs)
        for s in range(12):
            assert pool.slab_handles(s) == sorted(h for h in live if h // slab == s)
            assert pool.slab_class(s) == (live[pool.slab_handles(s)[0]] if s in slabs else 0)
    stats: dict[int, tuple[int, int]] = {}
    for s in slabs:
        cls = pool.slab_class(s)
        n_slabs, n_alloc = stats.get(cls, (0, 0))
        stats[cls] = (n_slabs + 1, n_alloc + len(pool.slab_handles(s)))
    assert pool.class_stats() == stats
    for handle in list(live):
        pool.free(handle)
    assert pool.free_slabs == 12 and pool.num_allocated == 0 and pool.bytes_allocated == 0


# ---- populate (issue 13): map the pages ahead of use, never racing a store into wrong data


def _no_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel without MADV_POPULATE_WRITE: the populate zeroes what no allocation holds."""
    monkeypatch.setattr(MemoryPool, "_populate_advised", lambda self, stop: None)


def _pattern(handle: int, n: int) -> torch.Tensor:
    return torch.full((n,), (handle // 64 * 37 + 11) % 251, dtype=torch.uint8)


def test_prefault_touches_every_page_and_keeps_slots_usable() -> None:
    pool = MemoryPool.slots(4096 * 4, 8, pin=False)
    pool.prefault()
    handle = pool.allocate(4096 * 4)
    assert handle is not None
    view = pool.view(handle)
    view.fill_(7)
    assert int(view.sum()) == 7 * view.numel()
    assert int(pool.tensor.sum()) == 7 * view.numel()  # every other byte was zeroed


@pytest.mark.parametrize("advised", [True, False], ids=["populate-write", "zero-free-slabs"])
def test_populate_keeps_allocations_and_reports(monkeypatch: pytest.MonkeyPatch,
                                                advised: bool) -> None:
    if not advised:
        _no_advice(monkeypatch)
    pool = MemoryPool(16 * MIB, slab_bytes=4 * MIB, pin=False)
    assert (pool.populate_state, pool.populated_bytes, pool.populate_s) == ("pending", 0, None)
    sizes = [MIB, MIB, 3 * MIB, 100_000, 100_000]  # slab 0: two of 1 MiB; 1: 3 MiB; 2: small
    held = [(pool.allocate(n), n) for n in sizes]
    for handle, n in held:
        assert handle is not None
        pool.view(handle, n).copy_(_pattern(handle, n))
    pool.populate()
    assert pool.populate_state == "done" and pool.populated_bytes == pool.nbytes
    assert pool.populate_s is not None and pool.populate_s >= 0
    for handle, n in held:
        assert handle is not None
        assert torch.equal(pool.view(handle, n), _pattern(handle, n))
    pool.populate()  # a second call is a no-op
    assert pool.populate_state == "done"


@pytest.mark.parametrize("advised", [True, False], ids=["populate-write", "zero-free-slabs"])
def test_stores_racing_the_populate_keep_their_bytes(monkeypatch: pytest.MonkeyPatch,
                                                     advised: bool) -> None:
    """Allocations of two sizes are made, written and freed on another thread all through the
    populate; every one still allocated holds exactly what was written."""
    if not advised:
        _no_advice(monkeypatch)
    pool = MemoryPool(64 * MIB, slab_bytes=2 * MIB, pin=False)
    populating = threading.Thread(target=pool.populate)
    held: list[tuple[int, int]] = []
    rng = random.Random(1)
    populating.start()
    rounds = 0
    while populating.is_alive() or rounds < 50:
        n = rng.choice([256 << 10, 96 << 10])
        handle = pool.allocate(n)
        if handle is None:
            for old, _ in held[::2]:
                pool.free(old)
            held = held[1::2]
            continue
        pool.view(handle, n).copy_(_pattern(handle, n))
        held.append((handle, n))
        rounds += 1
    populating.join(10)
    changed = [h for h, n in held if not torch.equal(pool.view(h, n), _pattern(h, n))]
    assert not changed and pool.populate_state == "done" and rounds >= 50


def test_zeroing_skips_held_memory_and_zeroes_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_advice(monkeypatch)
    pool = MemoryPool(4 * MIB, slab_bytes=MIB, pin=False)
    pool.tensor.fill_(9)  # stand-in for stale bytes
    a, b = pool.allocate(256 << 10), pool.allocate(256 << 10)  # slab 0, never-used tail after b
    assert (a, b) == (0, 256 << 10)
    pool.populate()
    assert int(pool.tensor[: 512 << 10].min()) == 9  # held: untouched
    assert int(pool.tensor[512 << 10:].max()) == 0  # the tail of slab 0 and the free slabs
    assert pool.populated_bytes == pool.nbytes


def test_populate_stops_when_asked_and_resumes() -> None:
    stop = threading.Event()
    stop.set()
    pool = MemoryPool.slots(pages.POPULATE_STEP, 2, pin=False)
    pool.populate(stop)
    assert pool.populate_state == "stopped" and pool.populate_s is None
    pool.populate()
    assert pool.populate_state == "done" and pool.populated_bytes == pool.nbytes


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_populate_makes_the_pool_resident() -> None:
    from lmcache_core.storage.pool import process_rss_bytes

    pool = MemoryPool(128 * MIB, slab_bytes=4 * MIB, pin=False)
    before = process_rss_bytes()
    pool.populate()
    assert process_rss_bytes() - before >= 0.9 * pool.nbytes
    assert int(pool.tensor[::4096].sum()) == 0  # fresh pages still read as zeros


def test_a_pool_bigger_than_the_machine_is_a_config_error(monkeypatch) -> None:
    monkeypatch.setattr(pages, "total_memory_bytes", lambda: 4 * MIB)
    with pytest.raises(ConfigError, match=r"server.pool_size: 8388608 bytes \(8.0 MiB\) is more "
                                          r"than this machine's memory \(4.0 MiB\)"):
        MemoryPool(8 * MIB, pin=False)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"server\.pool_size: 109951161678088372224 bytes"):
        MemoryPool(99999999 << 40, pin=False)  # 99999999TiB: overflowed mmap's size before


@pytest.mark.parametrize("exc", [OverflowError("cannot fit 'int' into an index-sized integer"),
                                 OSError(12, "Cannot allocate memory"), MemoryError()])
def test_an_allocation_that_fails_is_a_config_error(monkeypatch, exc) -> None:
    """mmap fails (too big for the address space, ENOMEM), then so does torch's own allocator."""
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(pages.mmap, "mmap", refuse)
    monkeypatch.setattr(pages.torch, "empty", lambda *_a, **_k: (_ for _ in ()).throw(
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8388608")))
    with pytest.raises(ConfigError, match=r"server.pool_size: 8388608 bytes \(8.0 MiB\) cannot "
                                          r"be allocated: "):
        MemoryPool(8 * MIB, pin=False)
