"""A vLLM GPU worker stand-in for the device check (``scripts/gpu-check``), run as its own process.

It allocates a KV cache on ``cuda:0`` (one allocation, ``--gib`` of it), registers it with a
running ``lmcache serve`` through ``LMCacheMPWorkerAdapter`` (CUDA IPC), then does what vLLM's
connector does: the "forward pass" writes blocks on a side stream after a GPU spin, an interprocess
event is recorded on that stream and sent with the store; the local reference to the event is
dropped at once (only ``InflightEvents`` keeps it, as in the connector). It then retrieves the
chunks into other (zeroed) blocks with an event, and compares every byte. It prints one JSON line
``{"ok": ..., "kv_bytes": ..., ...}`` and then waits to be killed (``kill -9`` in the check).

Usage: python tests/gpu/gpu_worker.py URL MODEL LAYERS HEADS HEAD_DIM BLOCK_SIZE GIB CHUNKS
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

import torch
import zmq

from lmcache_core.client.transfers import LoadStoreOp
from lmcache_core.client.worker import LMCacheMPWorkerAdapter
from lmcache_core.kv.cuda_events import InflightEvents

SPIN_CYCLES = 1_000_000_000  # ~0.5 s of GPU time before the KV writes land


def main() -> None:
    url, model = sys.argv[1], sys.argv[2]
    layers_n, heads, dim, block = (int(a) for a in sys.argv[3:7])
    gib, chunks = float(sys.argv[7]), int(sys.argv[8])
    per_block = 2 * block * heads * dim * 2 * layers_n  # bf16, all layers
    num_blocks = max(int(gib * 2**30) // per_block, 8)
    big = torch.zeros(layers_n, 2, num_blocks, block, heads, dim, dtype=torch.bfloat16,
                      device="cuda:0")
    caches = {f"layer_{i}": t for i, t in enumerate(big.unbind(0))}
    adapter = LMCacheMPWorkerAdapter(url, zmq.Context.instance(), model, 1, 0, block,
                                     heartbeat_interval_s=1.0)
    adapter.register_kv_caches(caches)
    result = round_trip(adapter, big, chunks)
    result.update(kv_bytes=big.numel() * big.element_size(), num_blocks=num_blocks)
    print(json.dumps(result), flush=True)
    time.sleep(600)  # until killed


def round_trip(adapter: LMCacheMPWorkerAdapter, big: torch.Tensor, chunks: int) -> dict[str, Any]:
    """Store ``chunks`` chunks written behind a GPU spin, retrieve them elsewhere, compare."""
    bpc = adapter.num_blocks_per_chunk()
    n = chunks * bpc
    src, dst = list(range(n)), list(range(n, 2 * n))
    tokens = torch.randint(0, 32000, (chunks * adapter.chunk_size,)).tolist()
    events = InflightEvents(grace_s=60.0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN_CYCLES)  # the "forward pass" is still running when the store goes
        big[:, :, src] = torch.randn(big[:, :, src].shape, device=big.device).to(big.dtype)
    started = time.monotonic()
    submit(adapter, events, "store", LoadStoreOp(tokens, src), side)
    stored = wait(adapter, events, "store")
    store_s = time.monotonic() - started
    big[:, :, dst] = 0
    started = time.monotonic()
    submit(adapter, events, "retrieve", LoadStoreOp(tokens, dst), torch.cuda.current_stream())
    retrieved = wait(adapter, events, "retrieve")
    torch.cuda.synchronize()
    exact = bool(torch.equal(big[:, :, src], big[:, :, dst]))
    return {"ok": exact and stored["ok"] and retrieved["ok"], "byte_exact": exact,
            "store": stored, "retrieve": retrieved, "store_s": store_s,
            "retrieve_s": time.monotonic() - started, "events_left": len(events)}


def submit(adapter: LMCacheMPWorkerAdapter, events: InflightEvents, kind: str, op: LoadStoreOp,
           stream: torch.cuda.Stream) -> None:
    """Submit with a fresh event on ``stream``, then drop our own reference to it at once."""
    event = events.acquire(lambda: torch.cuda.Event(interprocess=True))
    event.record(stream)
    if kind == "store":
        adapter.submit_store_request(kind, op, event)
        futures = adapter.store_futures(kind)
    else:
        adapter.submit_retrieve_request(kind, op, event)
        futures = adapter.retrieve_futures(kind)
    events.hold(event, futures)
    del event
    gc.collect()  # were the event not held, it would be destroyed here, before the server opens it


def wait(adapter: LMCacheMPWorkerAdapter, events: InflightEvents, kind: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    done = False
    while not done and time.monotonic() < deadline:
        stores, retrieves = adapter.get_finished({kind} if kind == "store" else set())
        done = kind in ((stores or set()) if kind == "store" else (retrieves or set()))
        events.release_answered()
        if not done:
            time.sleep(0.005)
    failures = adapter.failed_stores if kind == "store" else adapter.failed_retrieves
    return {"ok": done and kind not in failures, "finished": done, "failed": failures.get(kind)}


if __name__ == "__main__":
    main()
