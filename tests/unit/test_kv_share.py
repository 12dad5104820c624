"""Worker-side sharing (allocate/describe/move/release) and the server-side MappedKVCache."""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import msgspec
import pytest
import torch

from lmcache_core.errors import IncompatibleError, NotRegisteredError, ProtocolError
from lmcache_core.kv.copy import BlockCopier
from lmcache_core.kv.cuda_events import CopyStream, export_event, wait_on_ipc_event
from lmcache_core.kv.mapped import MappedKVCache
from lmcache_core.kv.share import (
    allocate_shared_kv_caches,
    describe_kv_caches,
    find_segment,
    release_shared_kv_caches,
)
from lmcache_core.kv.shm import segment_path
from lmcache_core.protocol.messages import RegisterKVCacheRequest, TensorDescriptor

SHAPE = [2, 32, 16, 2, 8]  # flash_attn: 32 blocks of 16 tokens, 2 heads x 8 dims
CHUNK = 64
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _release(own_objects_gc: None) -> Iterator[None]:
    yield
    gc.collect()  # of this test's objects only (own_objects_gc)
    release_shared_kv_caches()


def _maps() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def _filled(num_layers: int = 4, shape: list[int] = SHAPE,
            dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    caches, _ = allocate_shared_kv_caches(num_layers, shape, dtype, name_prefix="lmcache-test")
    g = torch.Generator().manual_seed(0)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return caches


def test_allocate_and_describe() -> None:
    names = [f"model.layers.{i}.attn" for i in range(3)]
    caches, seg = allocate_shared_kv_caches(3, SHAPE, torch.float16, "lmcache-test", names)
    assert list(caches) == names
    assert all(t.is_contiguous() and not t.any() for t in caches.values())
    layout, block_size, descs = describe_kv_caches(caches)
    assert (layout, block_size) == ("flash_attn", 16)
    step = 2 * 32 * 16 * 2 * 8 * 2
    for i, d in enumerate(descs):
        assert (d.kind, d.shm_name, d.segment_nbytes) == ("shm", seg.name, seg.nbytes)
        assert (d.dtype, d.shape, d.stride) == ("float16", SHAPE, list(caches[names[0]].stride()))
        assert d.offset_bytes == i * step and d.device_uuid == "cpu"
    # the descriptors travel in a registration request
    req = RegisterKVCacheRequest(instance_id=1, model_name="m", world_size=1, kv_rank=0,
                                 block_size=block_size, layout=layout, layers=descs)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=RegisterKVCacheRequest)
    assert back.layers == descs


def test_mapped_matches_local_copier_and_is_stacked() -> None:
    caches = _filled()
    layout, block_size, descs = describe_kv_caches(caches)
    local = BlockCopier(list(caches.values()), layout, CHUNK)
    ids = [31, 0, 7, 8, 20, 21, 5, 6]
    with MappedKVCache.open(descs, layout, block_size, CHUNK) as mapped:
        assert mapped.stacked and local.stacked
        assert (mapped.chunk_bytes, mapped.blocks_per_chunk, mapped.num_blocks) == (
            local.chunk_bytes, 4, 32)
        a = [torch.empty(mapped.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
        b = [torch.empty(mapped.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
        mapped.gather(ids, a)
        local.gather(ids, b)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        # a scatter through the server's mapping is seen by the worker's tensors
        mapped.scatter([torch.zeros(mapped.chunk_bytes, dtype=torch.uint8)], [1, 2, 3, 4])
        assert not next(iter(caches.values()))[:, 1:5].any()


def test_plain_cpu_tensor_moved_in_place() -> None:
    g = torch.Generator().manual_seed(1)
    t0 = torch.randn(SHAPE, generator=g).to(torch.bfloat16)
    t1 = torch.randn(SHAPE, generator=g).to(torch.bfloat16)
    kv = {"a": t0, "b": t1}
    attn_ref = [t0]  # e.g. an attention layer's reference to the same tensor object
    want = (t0.clone(), t1.clone())
    old_ptr = t0.data_ptr()
    layout, _, descs = describe_kv_caches(kv)
    assert kv["a"] is t0 and attn_ref[0] is t0  # same objects...
    assert t0.data_ptr() != old_ptr and find_segment(t0.data_ptr(), 1) is not None  # ...new memory
    assert torch.equal(t0, want[0]) and torch.equal(t1, want[1])
    assert descs[0].shm_name == descs[1].shm_name
    with MappedKVCache.open(descs, layout, 16, CHUNK) as mapped:
        assert mapped.stacked
        t0.fill_(3.0)  # the worker writes through its old reference...
        slot = torch.empty(mapped.chunk_bytes, dtype=torch.uint8)
        mapped.gather([0, 1, 2, 3], [slot])  # ...and the server sees it
        got = slot.view(torch.bfloat16).view(2, 2, CHUNK, 16)
        assert got[0].eq(3.0).all() and torch.equal(got[1, 0, :16], want[1][0, 0].reshape(16, 16))


def test_vllm_style_views_of_a_raw_buffer_are_moved() -> None:
    nbytes = 2 * 32 * 16 * 2 * 8 * 2
    raw = torch.zeros(3 * nbytes, dtype=torch.int8)
    kv = {f"l{i}": raw[i * nbytes:(i + 1) * nbytes].view(torch.float16).view(SHAPE)
          for i in range(3)}
    kv["l1"].fill_(2.0)
    del raw
    layout, _, descs = describe_kv_caches(kv)
    assert kv["l1"].eq(2.0).all() and not kv["l0"].any()
    assert len({d.shm_name for d in descs}) == 1
    assert all(t._base is None for t in kv.values())  # no longer views of the old buffer
    with MappedKVCache.open(descs, layout, 16, CHUNK) as mapped:
        assert mapped.stacked


def test_unmovable_tensor_raises_clear_error_and_changes_nothing() -> None:
    t = torch.ones(SHAPE, dtype=torch.float16)
    k_view = t[0]  # a view taken before registration would be left behind
    ptr = t.data_ptr()
    with pytest.raises(IncompatibleError, match="allocate_shared_kv_caches"):
        describe_kv_caches({"x": t})
    assert t.data_ptr() == ptr and k_view.data_ptr() == ptr
    del k_view
    with pytest.raises(IncompatibleError, match="moving was not allowed"):
        describe_kv_caches({"x": t}, move_to_shared=False)
    p = torch.nn.Parameter(torch.ones(SHAPE), requires_grad=False)
    with pytest.raises(IncompatibleError, match="Parameter"):
        describe_kv_caches({"p": p})
    other = torch.zeros(SHAPE)
    alias = other.view(-1)
    with pytest.raises(IncompatibleError, match="allocate_shared_kv_caches"):
        describe_kv_caches({"o": other})
    del alias


def test_sibling_view_outside_kv_caches_is_refused() -> None:
    buf = torch.zeros(2, *SHAPE, dtype=torch.float16)
    mine, theirs = buf[0], buf[1]  # the caller keeps `theirs`, which shares mine's storage
    del buf
    with pytest.raises(IncompatibleError, match="1 other tensor"):
        describe_kv_caches({"x": mine})
    del theirs


def test_inference_tensors() -> None:
    with torch.inference_mode():
        t = torch.full(SHAPE, 5.0, dtype=torch.float16)
        v = torch.ones(SHAPE, dtype=torch.float16)
        v_view = v[0]  # inference views are not tracked as views; the storage count sees it
    layout, _, descs = describe_kv_caches({"t": t})
    assert t.eq(5.0).all() and find_segment(t.data_ptr(), 1) is not None
    assert descs[0].kind == "shm" and layout == "flash_attn"
    with pytest.raises(IncompatibleError, match="share its memory"):
        describe_kv_caches({"v": v})
    del v_view


def test_describe_checks_layers() -> None:
    with pytest.raises(ProtocolError):
        describe_kv_caches({})
    caches, _ = allocate_shared_kv_caches(2, SHAPE, torch.float16, "lmcache-test")
    mixed = {"a": caches["layer_0"], "b": caches["layer_1"].view(torch.bfloat16)}
    with pytest.raises(IncompatibleError, match="differs from layer 0"):
        describe_kv_caches(mixed)
    layout, bs, _ = describe_kv_caches(caches, layout="flash_attn")
    assert (layout, bs) == ("flash_attn", 16)
    mla, _ = allocate_shared_kv_caches(2, [8, 16, 40], torch.float16, "lmcache-test")
    assert describe_kv_caches(mla)[:2] == ("mla", 16)


def test_release_unlinks() -> None:
    _, seg = allocate_shared_kv_caches(1, SHAPE, torch.float16, "lmcache-test")
    path = segment_path(seg.name)
    assert os.path.exists(path)
    assert release_shared_kv_caches(seg) == 1
    assert not os.path.exists(path) and seg.closed


def test_mapped_open_validation() -> None:
    caches = _filled(2)
    layout, bs, descs = describe_kv_caches(caches)
    with pytest.raises(IncompatibleError, match=r"chunk size 40 .* block size 16"):
        MappedKVCache.open(descs, layout, bs, 40)
    with pytest.raises(IncompatibleError, match="block size 16, but the registration says 8"):
        MappedKVCache.open(descs, layout, 8, CHUNK)
    with pytest.raises(ProtocolError):
        MappedKVCache.open([], layout, bs, CHUNK)
    with pytest.raises(IncompatibleError, match="differs from layer 0"):
        MappedKVCache.open([descs[0], msgspec.structs.replace(descs[1], dtype="float16")],
                           layout, bs, CHUNK)
    with pytest.raises(IncompatibleError, match="unknown tensor dtype"):
        MappedKVCache.open([msgspec.structs.replace(d, dtype="bogus") for d in descs],
                           layout, bs, CHUNK)
    missing = [msgspec.structs.replace(d, shm_name="lmcache-test-nope") for d in descs]
    with pytest.raises(NotRegisteredError, match="does not exist"):
        MappedKVCache.open(missing, layout, bs, CHUNK)
    bigger = [msgspec.structs.replace(d, segment_nbytes=d.segment_nbytes + 1) for d in descs]
    with pytest.raises(IncompatibleError, match="expected at least"):
        MappedKVCache.open(bigger, layout, bs, CHUNK)
    beyond = [descs[0], msgspec.structs.replace(descs[1], offset_bytes=descs[1].segment_nbytes)]
    with pytest.raises(IncompatibleError, match="does not fit"):
        MappedKVCache.open(beyond, layout, bs, CHUNK)
    with pytest.raises(ProtocolError, match="name"):
        MappedKVCache.open([msgspec.structs.replace(d, shm_name="../etc") for d in descs],
                           layout, bs, CHUNK)


def test_cuda_descriptor_without_cuda_is_incompatible() -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    desc = TensorDescriptor(kind="cuda", dtype="bfloat16", shape=SHAPE,
                            stride=[16384, 512, 32, 16, 1], device_uuid="GPU-x")
    with pytest.raises(IncompatibleError, match=r"torch.cuda.is_available\(\) is False"):
        MappedKVCache.open([desc], "flash_attn", 16, CHUNK)


def test_close_unmaps_at_once() -> None:
    caches = _filled(2)
    layout, bs, descs = describe_kv_caches(caches)
    mapped = MappedKVCache.open(descs, layout, bs, CHUNK)
    path = segment_path(descs[0].shm_name)
    # the worker maps it too; count this process's mappings of the segment
    before = _maps().count(path)
    mapped.close()
    assert _maps().count(path) == before - 1
    assert mapped.closed and mapped.chunk_bytes > 0  # figures stay readable
    with pytest.raises(NotRegisteredError, match="unregistered"):
        mapped.gather([0, 1, 2, 3], [torch.empty(mapped.chunk_bytes, dtype=torch.uint8)])
    mapped.close()  # idempotent


def test_second_process_maps_descriptors_and_reads_identical_bytes() -> None:
    caches = _filled(4)
    layout, bs, descs = describe_kv_caches(caches)
    ids = [9, 3, 30, 4, 11, 12, 13, 0]
    local = BlockCopier(list(caches.values()), layout, CHUNK)
    slots = [torch.empty(local.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
    local.gather(ids, slots)
    want = hashlib.sha256(b"".join(s.numpy().tobytes() for s in slots)).hexdigest()
    code = textwrap.dedent(f"""
        import hashlib, sys, msgspec, torch
        from lmcache_core.kv.mapped import MappedKVCache
        from lmcache_core.protocol.messages import TensorDescriptor
        descs = msgspec.json.decode(sys.stdin.buffer.read(), type=list[TensorDescriptor])
        with MappedKVCache.open(descs, {layout!r}, {bs}, {CHUNK}) as m:
            slots = [torch.empty(m.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
            m.gather({ids!r}, slots)
            print(hashlib.sha256(b"".join(s.numpy().tobytes() for s in slots)).hexdigest())
            ones = torch.ones(m.chunk_bytes // 2, dtype=torch.bfloat16)
            m.scatter([ones.view(torch.uint8)], [20, 21, 22, 23])
            print(m.stacked)
    """)
    proc = subprocess.run([sys.executable, "-c", code], input=msgspec.json.encode(descs),
                          capture_output=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr.decode()
    got, stacked = proc.stdout.decode().split()
    assert got == want and stacked == "True"
    assert all(t[:, 20:24].eq(1.0).all() for t in caches.values())  # the server's write landed
    assert all(os.path.exists(segment_path(d.shm_name)) for d in descs)  # not unlinked by it


def test_cpu_event_helpers_are_no_ops() -> None:
    assert export_event(None) == b""
    assert wait_on_ipc_event(b"", None) is None
    stream = CopyStream()
    assert not stream.is_cuda and stream.stream is None
    with stream.run(b""):
        pass
    stream.synchronize()
    with pytest.raises(IncompatibleError), stream.run(b"x" * 64):
        pass
    with pytest.raises(ProtocolError, match="64 bytes"):
        wait_on_ipc_event(b"short", "cuda:0")
    with pytest.raises(IncompatibleError, match="cpu"):
        wait_on_ipc_event(b"x" * 64, "cpu")


def test_owned_segments_unlinked_at_exit() -> None:
    code = ("import torch; from lmcache_core.kv.share import allocate_shared_kv_caches; "
            "_, seg = allocate_shared_kv_caches(1, [4, 16, 8], torch.float16, 'lmcache-test'); "
            "print(seg.name)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(segment_path(proc.stdout.strip()))
