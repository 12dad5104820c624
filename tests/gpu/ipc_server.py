"""A stand-in server for the CUDA IPC tests: a child ``python -c`` process (CUDA IPC handles cannot
be opened by the process that exported them) that maps a worker's KV caches from their
descriptors and answers ``gather <event hex or -> <block ids>`` (a digest of the chunks, read
after the event) and ``scatter - <block ids>`` lines."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import msgspec

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


def start_server(descs: list, layout: str, block_size: int) -> subprocess.Popen[str]:
    """The "server": a child that maps the KV caches ``descs`` describe, then gathers or scatters
    the blocks each line asks (``ask``)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, layout, str(block_size), str(CHUNK)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO)
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode(descs).decode() + "\n")
    proc.stdin.flush()
    return proc


def ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    reply = proc.stdout.readline().strip()
    if not reply:
        proc.kill()
        raise AssertionError(f"server died: {proc.communicate()[1]}")
    return reply


def finish(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
