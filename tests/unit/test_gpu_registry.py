"""GPU registrations in the registry, on the CPU with fake mappings (issue 16, findings 3, 5, 6).

A dead worker's GPU memory must not stay mapped: GPU registrations are reaped after a short
silence, their pid is trusted only when it names a process here, closing one empties the server's
CUDA cache, and the copy threads grow with the GPUs registered. A server that forgot a worker gets
freshly exported handles, never the ones it was sent before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from lmcache_core.client import worker as worker_module
from lmcache_core.protocol import messages as m
from lmcache_core.server import registry as registry_module
from lmcache_core.server.registry import GPU_SILENCE_S, KVRegistry
from tests.unit.mappings import FakeMapping, register_request

SHAPE = [2, 8, 16, 2, 64]


def cuda_request(instance_id: int, pid: int, uuid: str = "GPU-0",
                 hostname: str | None = None) -> m.RegisterKVCacheRequest:
    handle = m.CudaIpcHandle(device=0, handle=b"h" * 64, storage_nbytes=1 << 20,
                             storage_offset_bytes=0, ref_counter_handle=b"r" * 64,
                             ref_counter_offset=0)
    desc = m.TensorDescriptor(kind="cuda", dtype="float16", shape=SHAPE, stride=[1] * 5,
                              offset_bytes=0, segment_nbytes=1 << 20, cuda=handle,
                              device_uuid=uuid)
    return register_request(instance_id, pid, desc, hostname)


@pytest.fixture
def clock() -> list[float]:
    return [0.0]


@pytest.fixture
def registry(clock: list[float], monkeypatch: pytest.MonkeyPatch) -> KVRegistry:
    emptied: list[int] = []
    monkeypatch.setattr(registry_module, "release_cached_cuda_memory", lambda: emptied.append(1))
    reg = KVRegistry(lambda request: FakeMapping(), reap_timeout_s=60.0,
                     clock=lambda: clock[0])
    reg.emptied = emptied  # type: ignore[attr-defined]
    return reg


def test_a_silent_gpu_worker_is_reaped_after_the_short_timeout(
        registry: KVRegistry, clock: list[float]) -> None:
    gpu = registry.register(cuda_request(1, os.getpid()))
    clock[0] = GPU_SILENCE_S - 1
    assert registry.reap() == []
    clock[0] = GPU_SILENCE_S + 1  # well before reap_timeout_s (60 s)
    assert registry.reap() == [1]
    assert gpu.mapped.closed
    assert registry.emptied == [1]  # type: ignore[attr-defined]


def test_pings_keep_a_gpu_worker(registry: KVRegistry, clock: list[float]) -> None:
    registry.register(cuda_request(1, os.getpid()))
    for beat in range(1, 10):
        clock[0] = beat * 5.0
        assert registry.touch(1)
        assert registry.reap() == []


def test_a_killed_gpu_worker_is_reaped_at_once(registry: KVRegistry) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        registry.register(cuda_request(2, child.pid))
        assert registry.reap() == []
    finally:
        child.kill()
        child.wait(10)
    assert registry.reap() == [2]  # no wait for silence: the process is gone


def test_a_pid_that_names_no_process_here_is_not_trusted(registry: KVRegistry) -> None:
    """Same hostname, another pid namespace: the pid names no process here (or another one), so
    the registration is reaped by silence only, never as 'exited' while it lives."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)
    foreign = registry.register(cuda_request(3, child.pid))
    assert not foreign.local
    assert registry.reap() == []
    other_host = registry.register(cuda_request(4, os.getpid(), hostname="elsewhere"))
    assert not other_host.local
    assert registry.register(cuda_request(5, os.getpid())).local


def test_gpu_count_sizes_the_copy_threads(registry: KVRegistry) -> None:
    assert registry.gpu_count() == 0
    registry.register(cuda_request(1, os.getpid(), "GPU-a"))
    registry.register(cuda_request(2, os.getpid(), "GPU-a"))
    registry.register(cuda_request(3, os.getpid(), "GPU-b"))
    assert registry.gpu_count() == 2
    registry.unregister(3)
    assert registry.gpu_count() == 1


def test_a_lease_defers_the_unmap_of_a_reaped_gpu_worker(
        registry: KVRegistry, clock: list[float]) -> None:
    gpu = registry.register(cuda_request(1, os.getpid()))
    with registry.lease(1):
        clock[0] = 100.0
        assert registry.reap() == [1]
        assert not gpu.mapped.closed  # a copy (bounded by the event timeout) still runs
    assert gpu.mapped.closed


# ---------------------------------------------------------------- finding 6: export again


class FakeClient:
    server_url = "tcp://fake"
    request_timeout_s = 30.0

    def __init__(self, copy_by: bool = False) -> None:
        self.sent: list[Any] = []
        self.copy_by = copy_by  # what its registration replies say

    def request(self, request: Any, **_kw: Any) -> Any:
        self.sent.append(request)
        return m.RegisterKVCacheReply(chunk_bytes=1 << 20, blocks_per_chunk=16, layout="x",
                                      copy_by=self.copy_by)

    def submit(self, _op: Any, payload: Any) -> Any:
        self.sent.append(payload)
        return SimpleNamespace()


def fake_worker(monkeypatch: pytest.MonkeyPatch, client: FakeClient
                ) -> worker_module.LMCacheMPWorkerAdapter:
    """A worker adapter on ``client``, its KV caches registered (one CUDA layer, exported anew
    each time)."""
    exports = iter(range(100))

    def wrap(kv_caches: dict[str, Any]) -> worker_module.KVCache:
        n = next(exports)
        handle = m.CudaIpcHandle(device=0, handle=b"h" * 64, storage_nbytes=1 << 20,
                                 storage_offset_bytes=0, ref_counter_handle=b"r" * 64,
                                 ref_counter_offset=n)  # each export: its own count slot
        desc = m.TensorDescriptor(kind="cuda", dtype="float16", shape=SHAPE, stride=[1] * 5,
                                  offset_bytes=0, segment_nbytes=1 << 20, cuda=handle,
                                  device_uuid="GPU-0")
        return worker_module.KVCache("flash_attn", 16, [desc])

    monkeypatch.setattr(worker_module, "wrap_kv_caches", wrap)
    worker = worker_module.LMCacheMPWorkerAdapter.__new__(worker_module.LMCacheMPWorkerAdapter)
    worker._conn = SimpleNamespace(vllm_block_size=16, model_name="tiny", world_size=1,
                                   kv_rank=0)  # type: ignore[assignment]
    worker.instance_id = 7
    worker.mq_client = client  # type: ignore[assignment]
    worker._heartbeat, worker._heartbeat_interval_s = None, 0.0
    worker._stores = {}
    worker.register_kv_caches({"layer_0": object()})  # type: ignore[dict-item]
    return worker


def test_registering_again_exports_fresh_handles(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = fake_worker(monkeypatch, FakeClient())
    worker._register_again()  # the server restarted and forgot us
    first, again = worker.mq_client.sent  # type: ignore[attr-defined]
    assert first.instance_id == again.instance_id == 7
    assert first.layers[0].cuda.ref_counter_offset != again.layers[0].cuda.ref_counter_offset


def test_a_store_carries_copy_by_only_to_a_server_that_honours_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``StoreRequest.copy_by_ns`` (half the request timeout from now) goes only to a server whose
    registration replies say it honours it: an older one refuses unknown fields, and would refuse
    every store. A restarted server's replies decide again."""
    op = worker_module.LoadStoreOp([b"h" * 32], [0, 1])
    for honours in (True, False):
        client = FakeClient(copy_by=honours)
        worker = fake_worker(monkeypatch, client)
        # one chunk of the registration, as the connection would hash and block it
        monkeypatch.setattr(worker, "_parts", lambda ops, retrieve: [(7, [b"h" * 32], [0, 1])])
        before = time.monotonic_ns()
        worker.batched_submit_store_requests(["r"], [op], None)
        sent = client.sent[-1]
        assert isinstance(sent, m.StoreRequest) and sent.chunk_hashes == [b"h" * 32]
        if honours:
            assert before + 15 * 10**9 <= sent.copy_by_ns <= time.monotonic_ns() + 15 * 10**9
        else:
            assert sent.copy_by_ns == 0
        client.copy_by = not honours
        worker._register_again()
        worker.batched_submit_store_requests(["r"], [op], None)
        assert (client.sent[-1].copy_by_ns > 0) is (not honours)


# ---------------------------------------------------------------- finding 5: copy threads


def test_copy_threads_grow_with_the_gpus_registered(
        registry: KVRegistry, tmp_path: Any) -> None:
    from lmcache_core.config import load_config
    from lmcache_core.server.handlers import COPY_THREADS_PER_GPU, CacheHandlers
    from lmcache_core.transport.server import MessageQueueServer

    server = MessageQueueServer(f"ipc://{tmp_path}/s.sock", workers=2)
    server.start({})
    try:
        engine = SimpleNamespace(store=SimpleNamespace(), tiers=None)
        handlers = CacheHandlers(load_config(None), engine, registry,  # type: ignore[arg-type]
                                 SimpleNamespace(), started=0.0,  # type: ignore[arg-type]
                                 add_copy_threads=server.add_workers)
        handlers.register_kv_cache(cuda_request(1, os.getpid(), "GPU-a"), b"")
        assert len(server._workers) == 2 + COPY_THREADS_PER_GPU
        handlers.register_kv_cache(cuda_request(2, os.getpid(), "GPU-a"), b"")  # same GPU
        handlers.register_kv_cache(cuda_request(3, os.getpid(), "GPU-b"), b"")
        assert len(server._workers) == 2 + 2 * COPY_THREADS_PER_GPU
        assert all(w.is_alive() for w in server._workers)
    finally:
        server.stop(1.0)
    assert server.add_workers(10) == 2 + 2 * COPY_THREADS_PER_GPU  # none after stop
    assert not any(w.is_alive() for w in server._workers)  # every one joined


def test_the_event_gate_opens_the_worker_event_of_gpu_registrations_only(
        registry: KVRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_core.config import load_config
    from lmcache_core.server import handlers as handlers_module

    opened: list[tuple[bytes, Any]] = []

    def open_event(handle: bytes, device: Any) -> str:
        opened.append((handle, device))
        return "event"

    monkeypatch.setattr(handlers_module, "open_ipc_event", open_event)
    engine = SimpleNamespace(store=SimpleNamespace(), tiers=None)
    handlers = handlers_module.CacheHandlers(load_config(None), engine, registry,  # type: ignore[arg-type]
                                             SimpleNamespace(), started=0.0)  # type: ignore[arg-type]
    gpu = registry.register(cuda_request(1, os.getpid()))
    gpu.mapped.device = "cuda:3"
    store = m.StoreRequest(instance_id=1, chunk_hashes=[], block_ids=[], event_handle=b"e" * 64)
    assert handlers.event_gate(store) == ("event", handlers.event_timeout_s)
    assert opened == [(b"e" * 64, "cuda:3")]
    no_event = m.StoreRequest(instance_id=1, chunk_hashes=[], block_ids=[])
    unknown = m.StoreRequest(instance_id=2, chunk_hashes=[], block_ids=[], event_handle=b"e" * 64)
    assert handlers.event_gate(no_event) is None and handlers.event_gate(unknown) is None
    routes = handlers.routes()
    assert routes[handlers_module.RequestType.STORE].gate == handlers.event_gate
    assert routes[handlers_module.RequestType.RETRIEVE].gate == handlers.event_gate
    # a retrieve waits for its event at most its load deadline (then: a timeout, nothing copied,
    # all its blocks reported failed), as the handler would stop copying at it
    def retrieve(deadline_ms: int | None) -> m.RetrieveRequest:
        return m.RetrieveRequest(instance_id=1, chunk_hashes=[], block_ids=[],
                                 event_handle=b"e" * 64, deadline_ms=deadline_ms)

    assert handlers.event_gate(retrieve(None)) == ("event", 2.0)  # timeouts.load_ms
    assert handlers.event_gate(retrieve(250)) == ("event", 0.25)
    assert handlers.event_gate(retrieve(0)) == ("event", handlers.event_timeout_s)  # no deadline
    assert handlers.load_deadline_s(retrieve(0)) is None


# ---------------------------------------------------------------- finding 3: a closed connection


def test_a_gpu_worker_whose_connection_closed_is_reaped_after_the_grace(
        registry: KVRegistry, clock: list[float]) -> None:
    from lmcache_core.server.registry import DISCONNECT_GRACE_S

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)  # a pid that names no process here: not local, no pid check
    gpu = registry.register(cuda_request(1, child.pid), client=b"A")
    cpu_like = registry.register(cuda_request(2, child.pid), client=b"B")
    registry.disconnected(b"A")
    clock[0] = DISCONNECT_GRACE_S / 2
    assert registry.reap() == []  # a hint, not yet a verdict
    clock[0] = DISCONNECT_GRACE_S + 0.1
    assert registry.reap() == [1] and gpu.mapped.closed
    assert not cpu_like.mapped.closed


def test_a_worker_heard_from_after_the_report_is_kept(
        registry: KVRegistry, clock: list[float]) -> None:
    registry.register(cuda_request(1, os.getpid()), client=b"A")
    registry.register(cuda_request(2, os.getpid()), client=b"B")
    registry.disconnected(b"A")
    registry.disconnected(b"B")
    clock[0] = 0.5
    assert registry.touch(1, b"A2")  # it reconnected: a new identity
    with registry.lease(2):  # a store of it arrived: the connection number was reused
        pass
    clock[0] = 10.0
    assert registry.reap() == []
    registry.disconnected(b"A")  # the old identity again: no longer this worker's
    clock[0] = 14.0
    assert registry.reap() == []
