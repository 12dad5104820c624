"""CUDA IPC sharing of KV caches and interprocess events, between two real processes.

Skipped without CUDA (see tests/conftest.py). The "server" is a child ``python -c`` process: CUDA
IPC handles cannot be opened by the process that exported them.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from lmcache_core.kv.copy import BlockCopier
from lmcache_core.kv.cuda_events import export_event
from lmcache_core.kv.share import describe_kv_caches
from tests.gpu.ipc_server import CHUNK, SHAPE, ask, finish, start_server

pytestmark = pytest.mark.gpu

def _local_digest(layers: list[torch.Tensor], ids: list[int]) -> str:
    copier = BlockCopier(layers, "flash_attn", CHUNK)
    slots = [torch.empty(copier.chunk_bytes, dtype=torch.uint8)
             for _ in range(len(ids) // copier.blocks_per_chunk)]
    copier.gather(ids, slots)
    torch.cuda.synchronize()
    return hashlib.sha256(b"".join(s.numpy().tobytes() for s in slots)).hexdigest()


@pytest.mark.parametrize("one_allocation", [True, False])
def test_ipc_round_trip_between_processes(one_allocation: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    if one_allocation:
        big = torch.randn(4, *SHAPE, device="cuda", generator=g).to(torch.bfloat16)
        layers = list(big.unbind(0))
    else:
        layers = [torch.randn(SHAPE, device="cuda", generator=g).to(torch.bfloat16)
                  for _ in range(4)]
    kv = {f"layer_{i}": t for i, t in enumerate(layers)}
    layout, block_size, descs = describe_kv_caches(kv)
    assert (layout, block_size) == ("flash_attn", 16)
    assert all(d.kind == "cuda" and d.cuda is not None and d.device_uuid for d in descs)
    ids = [63, 1, 5, 2, 40, 41, 42, 43]
    want = _local_digest(layers, ids)
    proc = start_server(descs, layout, block_size)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()
        assert ready[:2] == ["ready", "cuda"], proc.stderr.read() if proc.stderr else ""
        assert ready[2] == str(one_allocation)
        assert ask(proc, f"gather - {','.join(map(str, ids))}") == want
        assert ask(proc, "scatter - 10,11,12,13") == "done"
        torch.cuda.synchronize()
        assert all(t[:, 10:14].eq(1.0).all() for t in layers)
        assert not layers[0][:, 14:20].eq(1.0).all()
    finally:
        finish(proc)


def test_server_waits_on_worker_event() -> None:
    layers = [torch.zeros(SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    layout, block_size, descs = describe_kv_caches({"a": layers[0], "b": layers[1]})
    proc = start_server(descs, layout, block_size)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("ready")
        # the "forward pass": a long GPU spin, then the KV write, then the event
        side = torch.cuda.Stream()
        event = torch.cuda.Event(interprocess=True)
        with torch.cuda.stream(side):
            torch.cuda._sleep(4_000_000_000)  # ~2 s of GPU cycles
            for t in layers:
                t.fill_(7.0)
            event.record(side)
        handle = export_event(event)
        assert len(handle) == 64
        ids = [0, 1, 2, 3]
        expected = torch.full((4, 64, 8 * 128), 7.0, dtype=torch.bfloat16)  # [L*2, T, W]
        want = hashlib.sha256(expected.view(torch.uint8).numpy().tobytes()).hexdigest()
        assert ask(proc, f"gather {handle.hex()} {','.join(map(str, ids))}") == want
        side.synchronize()
    finally:
        finish(proc)
