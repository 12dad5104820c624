"""The GPU-path fixes of issue 16, on a real device (skipped without CUDA; each test bounded).

- finding 1: the producer drops its own reference to the interprocess event right after export;
  ``InflightEvents`` keeps it alive, and the server's copy waits for the KV writes behind it. The
  negative control gathers without any wait and must see the stale bytes, else the test could not
  tell a wait from no wait;
- findings 3/5: a wait on an event that has not completed times out instead of hanging;
- finding 4: the pinned pool is page-locked and exactly its size;
- finding 7: float8 KV caches round-trip byte-exact on the GPU;
- finding 2: memory CUDA IPC cannot export is refused with the setting named.
"""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lmcache_core.errors import LMCacheTimeoutError
from lmcache_core.kv.copy import BlockCopier
from lmcache_core.kv.cuda_events import InflightEvents, export_event, wait_event_done
from lmcache_core.kv.share import describe_kv_caches
from lmcache_core.storage.pool import MemoryPool
from lmcache_core.transport.future import MessagingFuture
from tests.gpu.ipc_server import REPO, SHAPE, ask, finish, start_server

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]
SPIN = 4_000_000_000  # GPU cycles: ~2 s on current parts


def _digest_of(value: float) -> str:
    expected = torch.full((4, 64, 8 * 128), value, dtype=torch.bfloat16)  # [L*2, T, W] of 4 blocks
    return hashlib.sha256(expected.view(torch.uint8).numpy().tobytes()).hexdigest()


def _late_write(layers: list[torch.Tensor], value: float) -> tuple[torch.cuda.Stream, bytes,
                                                                   InflightEvents]:
    """The "forward pass": a GPU spin, then the KV write, then the event, on a side stream. The
    event's only reference left is the keeper's (as in the connector)."""
    side = torch.cuda.Stream()
    keeper = InflightEvents(grace_s=60.0)
    event = torch.cuda.Event(interprocess=True)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)
        for t in layers:
            t.fill_(value)
        event.record(side)
    handle = export_event(event)
    keeper.hold(event, [MessagingFuture()])  # unanswered until the test ends
    del event
    gc.collect()
    return side, handle, keeper


@pytest.mark.parametrize("wait", [True, False], ids=["event-held", "negative-control-no-wait"])
def test_server_sees_the_writes_behind_a_held_event(wait: bool) -> None:
    layers = [torch.zeros(SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    layout, block_size, descs = describe_kv_caches({"a": layers[0], "b": layers[1]})
    proc = start_server(descs, layout, block_size)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("ready")
        side, handle, keeper = _late_write(layers, 7.0)
        got = ask(proc, f"gather {handle.hex() if wait else '-'} 0,1,2,3")
        if wait:
            assert got == _digest_of(7.0)  # the event outlived our reference: waited on
        else:
            assert got == _digest_of(0.0)  # no wait: stale bytes, so the test can tell
        side.synchronize()
        assert len(keeper) == 1
    finally:
        finish(proc)


def test_a_wait_on_an_unfinished_event_times_out_then_completes() -> None:
    side = torch.cuda.Stream()
    event = torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)
        event.record(side)
    with pytest.raises(LMCacheTimeoutError):
        wait_event_done(event, 0.2)
    wait_event_done(event, 60.0)
    assert event.query()


def test_pinned_pool_is_page_locked_and_exact() -> None:
    pool = MemoryPool.slots(slot_bytes=3 << 20, num_slots=5, pin=True)  # 15 MiB: torch would pin 16
    assert pool.pinned and pool.pinned_bytes == 15 << 20
    assert pool.tensor.is_pinned()
    src = torch.arange(3 << 20, device="cuda", dtype=torch.int64).to(torch.uint8)
    pool.view(4).copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(pool.view(4), src.cpu())


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_round_trip_on_the_gpu(name: str) -> None:
    dtype = getattr(torch, name)
    raw = torch.randint(0, 256, (3, *SHAPE), dtype=torch.uint8, device="cuda")
    layers = list(raw.view(dtype).unbind(0))
    copier = BlockCopier(layers, "flash_attn", 64)
    slots = [torch.empty(copier.chunk_bytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
    copier.gather([9, 3, 4, 5, 60, 61, 62, 63], slots)
    target = torch.zeros_like(raw)
    BlockCopier(list(target.view(dtype).unbind(0)), "flash_attn", 64).scatter(
        slots, [0, 1, 2, 3, 4, 5, 6, 7])
    torch.cuda.synchronize()
    assert torch.equal(target[:, :, :8], raw[:, :, [9, 3, 4, 5, 60, 61, 62, 63]])


EXPORT = textwrap.dedent("""
    import torch
    from lmcache_core.errors import IncompatibleError
    from lmcache_core.kv.cuda_ipc import export_storage
    t = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    try:
        export_storage(t)
        print("exported")
    except IncompatibleError as exc:
        print("refused", "expandable_segments" in str(exc))
""")


def test_expandable_segments_export_works_or_is_refused_by_name() -> None:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", EXPORT], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("exported", "refused True"), out.stdout + out.stderr
    print(f"expandable_segments:True -> {out.stdout.strip()}")
