"""The pinned pool pins exactly its size (issue 16, finding 4), with a fake CUDA runtime.

``torch.empty(pin_memory=True)`` rounds to a power of two in PyTorch's host allocator (a 65-127 GiB
pool pinned 128 GiB); the pool now registers one exact-size mapping with ``cudaHostRegister``, says
so in SERVER_INFO, and logs an error (not a warning) when it falls back to pageable memory.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch

from lmcache_core.storage import pinned
from lmcache_core.storage.pool import MemoryPool


class FakeError(int):
    @property
    def name(self) -> str:
        return "cudaErrorMemoryAllocation" if self else "cudaSuccess"


class FakeCudart:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> FakeError:
        if self.fail:
            return FakeError(2)
        self.registered.append((address, nbytes, flags))
        return FakeError(0)

    def cudaHostUnregister(self, address: int) -> FakeError:
        self.unregistered.append(address)
        return FakeError(0)


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)

    empty = torch.empty

    def no_rounding_allocator(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("pin_memory"):
            raise AssertionError("torch's pin_memory (power-of-two rounding) must not be used")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_rounding_allocator)
    return fake


def test_the_pool_pins_exactly_its_size(cudart: FakeCudart) -> None:
    pool = MemoryPool.slots(5056, 3)  # 15168 bytes: torch would pin 16384
    assert pool.pinned and pool.pinned_bytes == 15168
    ((address, nbytes, flags),) = cudart.registered
    assert (address, nbytes, flags) == (pool.tensor.data_ptr(), 15168, 0)
    handle = [pool.allocate(5056) for _ in range(3)][2]
    assert handle is not None
    pool.view(handle)[:] = 7  # plain host memory, writable
    assert int(pool.view(handle).sum()) == 7 * 5056
    del pool
    gc.collect()
    assert cudart.unregistered == [address]  # unpinned with the last view


def test_a_pool_that_cannot_pin_says_so_loudly(cudart: FakeCudart,
                                               caplog: pytest.LogCaptureFixture) -> None:
    cudart.fail = True
    with caplog.at_level(logging.ERROR, logger="lmcache_core.storage.pool"):
        pool = MemoryPool.slots(4096, 2)
    assert not pool.pinned and pool.pinned_bytes == 0 and pool.pin_failed
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert "PAGEABLE" in record.getMessage() and "cudaErrorMemoryAllocation" in record.getMessage()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the host without CUDA")
def test_no_cuda_no_pinning() -> None:
    assert not MemoryPool.slots(4096, 2).pinned
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        pinned.pin_exact((1, 4096))


def test_server_info_reports_the_pinned_bytes(cudart: FakeCudart) -> None:
    from lmcache_core.config import load_config
    from lmcache_core.engine import CacheEngine
    from lmcache_core.server.listing import ServerViews
    from lmcache_core.server.registry import KVRegistry
    from lmcache_core.stats import TransportStats

    pool = MemoryPool.slots(5056, 3)
    views = ServerViews(load_config(None), CacheEngine(pool, 16), pool,
                        KVRegistry(lambda r: None, 60.0), disk=None, remote=None,
                        transport_stats=TransportStats, events_stats=None,
                        url=lambda: "tcp://x", http_url=lambda: None, started=0.0)
    info = views.server_info(None, b"")  # type: ignore[arg-type]
    assert info.stats.engine.pool_pinned_bytes == 15168 and info.stats.workers.gpu_instances == 0


def test_the_ready_panel_says_when_pinning_failed(cudart: FakeCudart) -> None:
    from types import SimpleNamespace

    from lmcache_cli.serve import _pool_pages

    cudart.fail = True
    server = SimpleNamespace(pool=MemoryPool.slots(4096, 2),
                             config=SimpleNamespace(server=SimpleNamespace(prefault=True)))
    assert _pool_pages(server).startswith("NOT pinned: pinning failed")  # type: ignore[arg-type]
    cudart.fail = False
    server.pool = MemoryPool.slots(4096, 2)
    assert _pool_pages(server).startswith("pinned (resident)")  # type: ignore[arg-type]
