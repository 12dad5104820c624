"""CUDA IPC sharing of KV caches and interprocess events, between two real processes.

Skipped without CUDA (see tests/conftest.py). The "server" is a child ``python -c`` process: CUDA
IPC handles cannot be opened by the process that exported them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from lmcache_core.kv.copy import BlockCopier
from lmcache_core.kv.cuda_events import export_event
from lmcache_core.kv.share import describe_kv_caches

pytestmark = pytest.mark.gpu

SHAPE = [2, 64, 16, 8, 128]  # flash_attn
CHUNK = 64
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SERVER = textwrap.dedent("""
    import hashlib, sys, msgspec, torch
    from lmcache_core.kv.cuda_events import CopyStream
    from lmcache_core.kv.mapped import MappedKVCache
    from lmcache_core.protocol.messages import TensorDescriptor
    layout, bs, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    descs = msgspec.json.decode(sys.stdin.readline(), type=list[TensorDescriptor])
    m = MappedKVCache.open(descs, layout, bs, chunk)
    stream = CopyStream(m.device)
    print("ready", m.device.type, m.stacked, flush=True)
    for line in sys.stdin:
        op, event_hex, ids = line.split(" ", 2)
        block_ids = [int(x) for x in ids.split(",")]
        n = len(block_ids) // m.blocks_per_chunk
        slots = [torch.empty(m.chunk_bytes, dtype=torch.uint8).pin_memory() for _ in range(n)]
        if op == "gather":
            with stream.run(bytes.fromhex(event_hex) if event_hex != "-" else b""):
                m.gather(block_ids, slots)
            digest = hashlib.sha256(b"".join(s.numpy().tobytes() for s in slots)).hexdigest()
            print(digest, flush=True)
        elif op == "scatter":
            for s in slots:
                s.view(torch.bfloat16).fill_(1.0)
            with stream.run(b""):
                m.scatter(slots, block_ids)
            print("done", flush=True)
    m.close()
""")


def _start_server(descs: list, layout: str, block_size: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, layout, str(block_size), str(CHUNK)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO)
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode(descs).decode() + "\n")
    proc.stdin.flush()
    return proc


def _ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    reply = proc.stdout.readline().strip()
    if not reply:
        proc.kill()
        raise AssertionError(f"server died: {proc.communicate()[1]}")
    return reply


def _finish(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


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
    proc = _start_server(descs, layout, block_size)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()
        assert ready[:2] == ["ready", "cuda"], proc.stderr.read() if proc.stderr else ""
        assert ready[2] == str(one_allocation)
        assert _ask(proc, f"gather - {','.join(map(str, ids))}") == want
        assert _ask(proc, "scatter - 10,11,12,13") == "done"
        torch.cuda.synchronize()
        assert all(t[:, 10:14].eq(1.0).all() for t in layers)
        assert not layers[0][:, 14:20].eq(1.0).all()
    finally:
        _finish(proc)


def test_server_waits_on_worker_event() -> None:
    layers = [torch.zeros(SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    layout, block_size, descs = describe_kv_caches({"a": layers[0], "b": layers[1]})
    proc = _start_server(descs, layout, block_size)
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
        assert _ask(proc, f"gather {handle.hex()} {','.join(map(str, ids))}") == want
        side.synchronize()
    finally:
        _finish(proc)
