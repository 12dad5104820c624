#!/usr/bin/env python3
"""Benchmark the in-process async lookup against a bare PUSH/PULL echo measured in the same run.

For world size 1 and 2: worker processes (spawned, as vLLM's are), each with a ``CacheEngine`` holding
all 64 chunks of a 16k-token prompt for its rank and an ``LMCacheAsyncLookupServer``; and echo
processes that answer each PUSHed message with a response-sized message over the same kind of
ipc:// PUSH/PULL pair. The client sits in this process. Figures:

- latency: ``lookup()`` until the result, one lookup at a time (p50/p99), waiting with
  ``wait_for_result`` and with a scheduler-style tight loop on ``lookup_cache``; the echo sends a
  request-sized message to every worker and waits for every reply;
- throughput: lookups per second with ``--inflight`` lookups outstanding (batches);
- the client's cost of hashing the prompt, which is part of every lookup and no part of the echo;
  "pre-hashed" runs repeat each figure with the prompt's hashes computed once, which isolates the
  messaging and the workers' engine lookups (what the echo is a floor for).

Usage: python scripts/bench/bench_async_lookup.py [--tokens 16384] [--iters 400] [--inflight 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lmcache_core.keys import TokenDatabase  # noqa: E402
from lmcache_core.lookup_client import (  # noqa: E402
    LMCacheAsyncLookupClient,
    LMCacheEngineConfig,
    LMCacheMetadata,
)
from lmcache_core.lookup_client.messages import (  # noqa: E402
    LookupRequestMsg,
    LookupResponseMsg,
    encode,
)

MODEL = "bench"
CHUNK = 256
WARMUP = 50  # untimed lookups first


def worker_main(conn: Connection, runtime_dir: str, worker_id: int, world_size: int,
                tokens: list[int]) -> None:
    import torch

    from lmcache_core.engine import CacheEngine
    from lmcache_core.keys import ChunkKey, chain_hashes, opaque_layout, rank_heads
    from lmcache_core.lookup_client import LMCacheAsyncLookupServer
    from lmcache_core.storage.pool import MemoryPool

    torch.set_num_threads(1)
    hashes = chain_hashes(tokens, CHUNK)
    engine = CacheEngine(MemoryPool.slots(64, len(hashes) + 8, pin=False), CHUNK)
    # The lookup server asks under the opaque layout of its world size (it knows no KV shape):
    # this rank's piece of each chunk is heads rank_heads(layout, world_size, worker_id).
    layout = opaque_layout(world_size)
    heads = rank_heads(layout, world_size, worker_id)
    plan = engine.store.begin_store([ChunkKey(MODEL, layout, *heads, h) for h in hashes], 64)
    engine.store.finish_store(plan)
    server = LMCacheAsyncLookupServer(engine, LMCacheMetadata(
        model_name=MODEL, world_size=world_size, worker_id=worker_id, engine_id="bench",
        runtime_dir=runtime_dir))
    conn.send("ready")
    conn.recv()
    server.close()
    engine.close()


def echo_main(conn: Connection, runtime_dir: str, worker_id: int) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{runtime_dir}/echo.w{worker_id}.sock")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{runtime_dir}/echo.sched.sock")
    reply = encode(LookupResponseMsg(lookup_id="x" * 12, seq=1, worker_id=worker_id,
                                     num_hit_tokens=16384))
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    conn.send("ready")
    while not conn.poll():
        if poller.poll(100):
            while True:
                try:
                    pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                push.send(reply)
    pull.close(0)
    push.close(0)


def spawn(target: Callable[..., None], *args: object) -> tuple[Any, Connection]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return proc, parent


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_echo(runtime_dir: str, world_size: int, request: bytes, iters: int,
               inflight: int) -> dict[str, float]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{runtime_dir}/echo.sched.sock")
    pushes = []
    for w in range(world_size):
        push = ctx.socket(zmq.PUSH)
        push.connect(f"ipc://{runtime_dir}/echo.w{w}.sock")
        pushes.append(push)

    def round_trip() -> None:
        for push in pushes:
            push.send(request)
        for _ in pushes:
            pull.recv()

    for _ in range(50):
        round_trip()
    lat = []
    for _ in range(iters):
        start = time.perf_counter()
        round_trip()
        lat.append(time.perf_counter() - start)
    batches = max(1, iters * 4 // inflight)
    start = time.perf_counter()
    for _ in range(batches):
        for _ in range(inflight):
            for push in pushes:
                push.send(request)
        for _ in range(inflight * world_size):
            pull.recv()
    rate = batches * inflight / (time.perf_counter() - start)
    for sock in (pull, *pushes):
        sock.close(0)
    return {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "rate": rate}


class PrehashedTokens(TokenDatabase):
    """Hashes a prompt once and then returns the same hashes: isolates the rest of a lookup."""

    def __init__(self, chunk_size: int) -> None:
        super().__init__(chunk_size)
        self._memo: tuple[int, list[bytes]] | None = None

    def chunk_hashes(self, token_ids: Any) -> list[bytes]:
        if self._memo is None or self._memo[0] != id(token_ids):
            self._memo = (id(token_ids), super().chunk_hashes(token_ids))
        return self._memo[1]


def bench_lookup(runtime_dir: str, world_size: int, tokens: list[int], iters: int,
                 inflight: int, prehashed: bool) -> dict[str, float]:
    client = LMCacheAsyncLookupClient(
        LMCacheEngineConfig(chunk_size=CHUNK, lookup_timeout_ms=10_000),
        LMCacheMetadata(model_name=MODEL, world_size=world_size, engine_id="bench",
                        runtime_dir=runtime_dir))
    if prehashed:
        client.token_database = PrehashedTokens(CHUNK)
    expected = len(tokens) // CHUNK * CHUNK
    ids = [f"req-{i:06d}" for i in range(max(iters, inflight, WARMUP))]

    def one(lookup_id: str, spin: bool) -> float:
        start = time.perf_counter()
        client.lookup(tokens, lookup_id)
        if spin:
            result = None
            while result is None:
                result = client.lookup_cache(lookup_id)
        else:
            result = client.wait_for_result(lookup_id, 10)
        elapsed = time.perf_counter() - start
        assert result == expected, (result, expected)
        client.clear_lookup_status(lookup_id)  # as the scheduler does after using it
        return elapsed

    try:
        for i in range(WARMUP):
            one(ids[i], spin=False)
        wait = [one(ids[i], spin=False) for i in range(iters)]
        spin = [one(ids[i], spin=True) for i in range(iters)]
        batches = max(1, iters * 4 // inflight)
        start = time.perf_counter()
        for _ in range(batches):
            batch = ids[:inflight]
            for lookup_id in batch:
                client.lookup(tokens, lookup_id)
            for lookup_id in batch:
                assert client.wait_for_result(lookup_id, 10) == expected
                client.clear_lookup_status(lookup_id)
        rate = batches * inflight / (time.perf_counter() - start)
        assert client.stats()["timeouts"] == 0
    finally:
        client.close()
    return {"p50": pct(wait, 0.5), "p99": pct(wait, 0.99), "spin_p50": pct(spin, 0.5),
            "spin_p99": pct(spin, 0.99), "rate": rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    rng = random.Random(0)
    tokens = [rng.randrange(128_000) for _ in range(args.tokens)]
    db = TokenDatabase(CHUNK)
    hashes = db.chunk_hashes(tokens)
    request = encode(LookupRequestMsg(lookup_id="req-000000", seq=1, reply_to="bench.x.sock",
                                      hashes=hashes, offsets=db.chunk_offsets(len(hashes))))
    hash_times = []
    for _ in range(200):
        start = time.perf_counter()
        db.chunk_hashes(tokens)
        hash_times.append(time.perf_counter() - start)
    hash_us = statistics.median(hash_times) * 1e6
    print(f"prompt: {args.tokens} tokens = {len(hashes)} chunks of {CHUNK}; request {len(request)} B")
    print(f"client hashing of the prompt (part of every lookup): {hash_us:.0f} us")

    for world_size in args.world_sizes:
        runtime_dir = tempfile.mkdtemp(prefix="lkb", dir="/tmp")
        procs = [spawn(worker_main, runtime_dir, w, world_size, tokens) for w in range(world_size)]
        procs += [spawn(echo_main, runtime_dir, w) for w in range(world_size)]
        try:
            for _, conn in procs:
                if not conn.poll(120):
                    raise SystemExit("a worker did not start")
                conn.recv()
            echo = bench_echo(runtime_dir, world_size, request, args.iters, args.inflight)
            look = bench_lookup(runtime_dir, world_size, tokens, args.iters, args.inflight, False)
            pre = bench_lookup(runtime_dir, world_size, tokens, args.iters, args.inflight, True)
        finally:
            for _, conn in procs:
                conn.send("stop")
            for proc, _ in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            shutil.rmtree(runtime_dir, ignore_errors=True)
        us = 1e6
        print(f"\nworld size {world_size}  (echo: one request-sized PUSH to each worker, "
              "a response-sized reply from each)")
        print(f"  {'echo round trip':<29} p50 {echo['p50'] * us:6.0f} us  "
              f"p99 {echo['p99'] * us:6.0f} us")
        for name, fig in (("lookup", look), ("lookup, pre-hashed", pre)):
            for mode, p50, p99 in (("wait", "p50", "p99"), ("poll", "spin_p50", "spin_p99")):
                print(f"  {name + ' (' + mode + ')':<29} p50 {fig[p50] * us:6.0f} us  "
                      f"p99 {fig[p99] * us:6.0f} us  p50 ratio {fig[p50] / echo['p50']:.2f}x")
        print(f"  throughput, {args.inflight} in flight: echo {echo['rate']:.0f}/s, lookups "
              f"{look['rate']:.0f}/s ({look['rate'] / echo['rate']:.3f}x; hashing alone caps it at "
              f"{1e6 / hash_us:.0f}/s), pre-hashed {pre['rate']:.0f}/s ({pre['rate'] / echo['rate']:.3f}x)")


if __name__ == "__main__":
    main()
