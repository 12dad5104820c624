"""LMCache 0.5.6's GPU registrations (issue 24): its ``cuda`` descriptors (``CudaIPCWrapper``: the
storage's ``torch.UntypedStorage._share_cuda_()`` tuple and the tensor's view) become our CUDA
descriptors field by field, so the registry checks, opens and reaps them as our own workers'
(``kv.cuda_ipc``); the owner is the process torch's reference-counter file names; ``cuda_raw`` and
``cuda_vmm`` (its isolated-IPC and VMM paths) are refused at once, saying which option sent them.
No GPU needed: nothing here opens CUDA memory."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from lmcache_core.kv.cuda_ipc import REF_COUNTERS_PER_FILE, check_ipc_handle
from lmcache_core.protocol import lmcache_wire as w
from lmcache_core.server.lmcache import translate as t
from lmcache_core.server.lmcache.registrations import registration_request
from tests.unit.mappings import FakeMapping

enc = msgspec.msgpack.encode
PID = os.getpid()
UUID = "GPU-8f7c1a2e-0000-4000-8000-000000000001"
SHAPE, STRIDE = [2, 32, 16, 4, 32], [32 * 16 * 4 * 32, 16 * 4 * 32, 4 * 32, 32, 1]
NBYTES = 2 * 32 * 16 * 4 * 32 * 2


@pytest.fixture
def counter() -> Iterator[bytes]:
    """A reference-counter file as torch makes one for this process."""
    name = f"/torch_{PID}_{secrets.randbelow(10**9)}_0"
    with open(f"/dev/shm{name}", "wb") as f:
        f.truncate(8 * REF_COUNTERS_PER_FILE + 64)
    yield name.encode()
    os.unlink(f"/dev/shm{name}")


def cuda_layer(counter: bytes, i: int = 0, **meta: object) -> msgspec.msgpack.Ext:
    """One layer as LMCache's client sends it: ext 1 holding its tagged ``CudaIPCData``."""
    handle = [0, bytes([i]) * 64, 4 * NBYTES, i * NBYTES, counter, 3 + i, b"e" * 64, True]
    return msgspec.msgpack.Ext(1, enc({
        "type": "cuda", "version": 1, "handle": handle,
        "metadata": {"dtype": "float16", "shape": SHAPE, "stride": STRIDE, "storage_offset": 8,
                     "device_uuid": UUID, **meta}}))


def register_frames(layers: list[msgspec.msgpack.Ext]) -> list[bytes]:
    return [enc(1), enc(1), enc(7), enc(layers), enc("m"), enc(1), enc("vllm"), enc({}),
            enc([])]


def test_cuda_layers_become_our_cuda_descriptors_checked_as_ours(counter: bytes) -> None:
    call = w.decode_call(register_frames([cuda_layer(counter, 0), cuda_layer(counter, 1)]),
                         "register_kv_cache")
    request = registration_request(*call.args[:4], call.args[5], call.args[6])
    assert request.pid == PID and request.layout == "flash_attn" and request.block_size == 16
    for i, desc in enumerate(request.layers):
        assert (desc.kind, desc.dtype, desc.shape, desc.stride) == ("cuda", "float16", SHAPE,
                                                                    STRIDE)
        assert desc.offset_bytes == 8 * 2 and desc.segment_nbytes == 4 * NBYTES
        assert desc.device_uuid == UUID
        assert desc.cuda is not None
        assert (desc.cuda.device, desc.cuda.handle, desc.cuda.storage_nbytes,
                desc.cuda.storage_offset_bytes, desc.cuda.ref_counter_handle,
                desc.cuda.ref_counter_offset, desc.cuda.event_handle,
                desc.cuda.event_sync_required) == (0, bytes([i]) * 64, 4 * NBYTES, i * NBYTES,
                                                   counter, 3 + i, b"e" * 64, True)
        check_ipc_handle(desc.cuda, request.pid)  # what the registry asks before opening it


def test_a_cuda_registration_names_one_live_owner(counter: bytes) -> None:
    def register(layers: list[msgspec.msgpack.Ext]) -> None:
        call = w.decode_call(register_frames(layers), "register_kv_cache")
        registration_request(*call.args[:4], call.args[5], call.args[6])

    with pytest.raises(w.DialectError, match="one process's torch"):
        register([cuda_layer(counter), cuda_layer(b"/torch_1_5_0", 1)])
    with pytest.raises(w.DialectError, match="one process's torch"):
        register([cuda_layer(b"/not_torch")])
    with pytest.raises(w.DialectError, match="not running"):
        register([cuda_layer(b"/torch_4194303_1_0")])  # above any pid this machine hands out
    shm = msgspec.msgpack.Ext(1, enc({
        "type": "cpu_shm", "version": 1, "shm_name": f"/lmcache_kv_{PID}_0", "nbytes": NBYTES,
        "metadata": {"dtype": "float16", "shape": SHAPE, "stride": STRIDE, "storage_offset": 0,
                     "device_uuid": "cpu"}}))
    with pytest.raises(w.DialectError, match="all cpu_shm or all cuda"):
        register([cuda_layer(counter), shm])
    with pytest.raises(w.DialectError, match="on the CPU"):
        register([cuda_layer(counter, device_uuid="cpu")])


@pytest.mark.parametrize(("kind", "option"), [("cuda_raw", "isolated_ipc"),
                                              ("cuda_vmm", "use_vmm_api")])
def test_raw_and_vmm_descriptors_are_refused_naming_their_option(kind: str, option: str) -> None:
    meta = {"dtype": "float16", "shape": SHAPE, "stride": STRIDE, "storage_offset": 0,
            "device_uuid": UUID}
    fields = {"cuda_raw": {"ipc_handle": b"r" * 64, "alloc_offset": 0, "nbytes": NBYTES},
              "cuda_vmm": {"export_id": b"v" * 16, "kind": "posix_fd", "fabric_blob": None,
                           "alloc_size": NBYTES, "alloc_offset": 0, "nbytes": NBYTES}}[kind]
    layer = msgspec.msgpack.Ext(1, enc({"type": kind, "version": 1, "metadata": meta, **fields}))
    with pytest.raises(w.DialectError, match=f"{kind} KV descriptors .*{option}.* not served"):
        w.decode_call(register_frames([layer]), "register_kv_cache")


def test_a_cuda_registrations_copies_wait_on_the_workers_event() -> None:
    from lmcache_core.server.lmcache.front import _event_of

    key = msgspec.convert({"model_name": "m", "world_size": 1, "worker_id": 0,
                           "token_ids": list(range(64)), "start": 0, "end": 64,
                           "request_id": "r"}, w.IPCCacheServerKey)
    assert t.store_request(key, 7, [list(range(4))], 64, 4, b"e" * 64).event_handle == b"e" * 64
    retrieve, _ = t.retrieve_request(key, 7, [list(range(4))], 64, 4, 0, b"e" * 64)
    assert retrieve.event_handle == b"e" * 64
    gpu = msgspec.structs.replace(_shm_request(), layers=[msgspec.structs.replace(
        _shm_request().layers[0], kind="cuda")])
    assert _event_of(gpu, b"e" * 64) == b"e" * 64
    assert _event_of(_shm_request(), b"stub_ipc_handle") == b""  # LMCache's CPU stub: none


def _shm_request() -> Any:
    from lmcache_core.protocol import messages as m

    layer = m.TensorDescriptor(kind="shm", dtype="float16", shape=SHAPE, stride=STRIDE,
                               shm_name="x")
    return m.RegisterKVCacheRequest(instance_id=7, model_name="m", world_size=1, kv_rank=0,
                                    block_size=16, layout="flash_attn", layers=[layer], pid=PID,
                                    hostname="h")


def test_a_cuda_registration_is_kept_and_reaped_as_our_gpu_workers_are(
        counter: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The translated registration goes through the registry's GPU path (a fake mapping in place of
    CUDA memory, as tests/unit/test_gpu_registry.py): a GPU worker, reaped after the short silence
    GPU workers get, its mapping closed and the server's CUDA cache emptied."""
    from lmcache_core.server import registry as registry_module
    from lmcache_core.server.registry import GPU_SILENCE_S, KVRegistry

    emptied: list[int] = []
    monkeypatch.setattr(registry_module, "release_cached_cuda_memory", lambda: emptied.append(1))
    clock = [0.0]
    registry = KVRegistry(lambda request: FakeMapping(), reap_timeout_s=60.0,
                          clock=lambda: clock[0])
    call = w.decode_call(register_frames([cuda_layer(counter, 0), cuda_layer(counter, 1)]),
                         "register_kv_cache")
    gpu = registry.register(registration_request(*call.args[:4], call.args[5], call.args[6]))
    clock[0] = GPU_SILENCE_S - 1
    assert registry.reap() == []
    clock[0] = GPU_SILENCE_S + 1  # far sooner than reap_timeout_s: the GPU workers' rule
    assert registry.reap() == [7] and gpu.mapped.closed and emptied == [1]  # instance 7
