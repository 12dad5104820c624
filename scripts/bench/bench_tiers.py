#!/usr/bin/env python3
"""Benchmark the Redis tier against plain redis-py on the same bytes, in the same run; print ratios.

- store: chunks committed to an engine with a remote tier, until its writer has SET them all
  (write-behind: blake3 checksum + record header + pipelined SETs) vs redis-py ``SET`` of the same
  bytes, one call per chunk (default client, and with redis-py's own packer as the tier uses);
- retrieve: a second engine (empty memory) tiered ``lookup`` of the whole prefix (one pipelined
  STRLEN, pipelined GETs, checksum, copy into pool slots), then that plus the copy out of the slots
  (what a retrieve adds) vs redis-py ``GET`` of the same keys, one call per chunk;
- a lookup that goes to Redis and finds nothing (the STRLEN round trip and the engine around it) vs
  redis-py ``EXISTS`` of the same keys in one pipeline, and vs one ``PING``;
- a memory-only ``lookup`` of 64 chunks x 2 ranks with no tier attached (the fast path).

Starts its own ``redis-server`` (no persistence) on a free port unless ``--url`` is given.
Usage: python scripts/bench/bench_tiers.py [--chunk-mib 4] [--chunks 16] [--rounds 5] [--url redis://...]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import torch  # noqa: E402
from redis.connection import Encoder, PythonRespSerializer  # noqa: E402

from lmcache_core.engine import CacheEngine, GroupTarget  # noqa: E402
from lmcache_core.keys import ChunkKey, opaque_layout, world_heads  # noqa: E402
from lmcache_core.storage.pool import MemoryPool  # noqa: E402
from lmcache_core.storage.remote import RedisTier  # noqa: E402

MODEL = "bench"
#: No KV shape here: one rank's opaque layout, so each chunk is one piece of heads [0, 1).
LAYOUT = opaque_layout(1)
HEADS = (0, 1)
RANGES = world_heads(LAYOUT, 1)
TARGET = [GroupTarget(LAYOUT, RANGES)]  # a single-layout model: one group


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    proc, url = (None, args.url) if args.url else start_redis()
    try:
        run(args, url)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(5)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="bytes per chunk, in MiB")
    parser.add_argument("--chunks", type=int, default=16, help="chunks per store/retrieve round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lookups", type=int, default=300, help="repetitions of each lookup figure")
    parser.add_argument("--url", default=None, help="use this Redis instead of starting one")
    return parser.parse_args()


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tempfile.mkdtemp(prefix="bench-redis-")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.01)
    return proc, f"redis://127.0.0.1:{port}"


def interleaved(fns: list[Callable[[], object]], rounds: int,
                after: Callable[[], object] | None = None) -> list[float]:
    """Best time of each function, the functions taking turns each round (so load on this shared
    machine hits them alike); ``after`` runs untimed after each round."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
        if after is not None:
            after()
    return best


def median_us(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def run(args: argparse.Namespace, url: str) -> None:
    nbytes = int(args.chunk_mib * 2**20)
    n = args.chunks
    total = nbytes * n
    raw = redis.Redis.from_url(url)
    data = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8) for _ in range(n)]
    blobs = [d.numpy().tobytes() for d in data]
    counter = iter(range(10**9))

    def keys() -> list[ChunkKey]:
        round_id = next(counter)
        return [ChunkKey(MODEL, LAYOUT, *HEADS, round_id.to_bytes(8, "big") + i.to_bytes(24, "big"))
                for i in range(n)]

    print(f"Redis {raw.info()['redis_version']} at {url}; {n} chunks x {args.chunk_mib:g} MiB = "
          f"{total / 2**20:.0f} MiB per round, best of {args.rounds}")

    # ---- store
    def raw_set() -> None:
        for i, blob in enumerate(blobs):
            raw.set(f"raw:{i}", blob)

    pool_a = MemoryPool.slots(nbytes, n, pin=False)
    tier_a = RedisTier(url, queue_size=4 * n, timeout_ms=5000)
    engine_a = CacheEngine(pool_a, 256, remote=tier_a)
    assert engine_a.tiers is not None
    engine_a.tiers.start()  # its writer, writing a's pieces behind the stores
    stored: list[list[ChunkKey]] = []
    reply_s: list[float] = []

    def tier_store() -> None:
        engine_a.store.clear(force=True)
        ks = keys()
        start = time.perf_counter()
        plan = engine_a.store.begin_store(ks, nbytes)
        for i, _, view in plan.writes:
            view.copy_(data[i])
        engine_a.store.finish_store(plan)
        reply_s.append(time.perf_counter() - start)
        assert tier_a.flush(60), "writer did not finish"
        stored.append(ks)

    packer = redis.Redis.from_url(url, command_packer=PythonRespSerializer(
        6000, Encoder("utf-8", "strict", False).encode))

    def raw_set_py() -> None:
        for i, blob in enumerate(blobs):
            packer.set(f"raw:{i}", blob)

    def forget_old() -> None:  # keeps Redis's memory flat: every round writes as much anew
        raw.delete(*[f"raw:{i}" for i in range(n)])
        while len(stored) > 1:
            raw.delete(*[tier_a.redis_key(k) for k in stored.pop(0)])

    raw_set_s, raw_set_py_s, tier_set_s = interleaved([raw_set, raw_set_py, tier_store], args.rounds,
                                                      forget_old)
    for i, blob in enumerate(blobs):
        raw.set(f"raw:{i}", blob)
    assert tier_a.stats().write_dropped == 0
    report("store (until written)", total, tier_set_s, raw_set_s, "redis-py SET per chunk")
    report("", total, tier_set_s, raw_set_py_s, "same, redis-py's own packer")
    print(f"  (the store itself returned in {min(reply_s) * 1e3:.2f} ms: writes go behind)")

    # ---- retrieve
    def raw_get() -> None:
        for i in range(n):
            raw.get(f"raw:{i}")

    pool_b = MemoryPool.slots(nbytes, n, pin=False)
    tier_b = RedisTier(url, timeout_ms=5000)
    engine_b = CacheEngine(pool_b, 256, remote=tier_b)
    out = torch.empty(nbytes, dtype=torch.uint8)
    (last,) = stored

    load_s: list[float] = []

    def tier_get() -> None:
        engine_b.store.clear(force=True)
        ks = last
        start = time.perf_counter()
        hashes = [k.chunk_hash for k in ks]
        hits = engine_b.lookup(MODEL, TARGET, hashes, "bench", tier_timeout_s=60)
        load_s.append(time.perf_counter() - start)
        assert hits == n, f"{hits} of {n} hit"
        plan = engine_b.store.begin_retrieve(MODEL, LAYOUT, HEADS, hashes, "bench")
        for _, ((view, _, _),) in plan.found:
            out.copy_(view)
        engine_b.store.finish_retrieve(plan)

    raw_get_s, tier_get_s = interleaved([raw_get, tier_get], args.rounds)
    report("lookup + load into memory", total, min(load_s), raw_get_s, "redis-py GET per chunk")
    report("retrieve (the above + copy out)", total, tier_get_s, raw_get_s, "redis-py GET per chunk")
    check = engine_b.store.begin_retrieve(MODEL, LAYOUT, HEADS, [last[0].chunk_hash])
    assert torch.equal(check.found[0][1][0][0], data[0]), "bytes differ"
    engine_b.store.finish_retrieve(check)

    # ---- lookup that asks Redis (and finds nothing)
    missing = [ChunkKey(MODEL, LAYOUT, *HEADS, b"\xee" * 24 + i.to_bytes(8, "big"))
               for i in range(n)]
    hashes = [k.chunk_hash for k in missing]
    rkeys = [tier_b.redis_key(k) for k in missing]

    def raw_exists() -> None:
        pipe = raw.pipeline(transaction=False)
        for rkey in rkeys:
            pipe.exists(rkey)
        pipe.execute()

    tier_lookup = median_us(lambda: engine_b.lookup(MODEL, TARGET, hashes, "miss",
                                                    tier_timeout_s=5), args.lookups)
    raw_lookup = median_us(raw_exists, args.lookups)
    ping = median_us(raw.ping, args.lookups)
    print(f"lookup of {n} chunks that goes to Redis: {tier_lookup:8.1f} us   redis-py pipelined "
          f"EXISTS x{n}: {raw_lookup:6.1f} us   ratio {tier_lookup / raw_lookup:.2f}x   "
          f"(PING {ping:.1f} us)")

    # ---- memory-only fast path (no tier)
    plain = CacheEngine(MemoryPool.slots(64, 256, pin=False), 256)
    chain = [bytes([i, 7]) * 16 for i in range(64)]
    two = opaque_layout(2)
    for lo, hi in world_heads(two, 2):
        plain.store.finish_store(plain.store.begin_store(
            [ChunkKey(MODEL, two, lo, hi, c) for c in chain], 8))
    both = [GroupTarget(two, world_heads(two, 2))]
    fast = min(median_us(lambda: plain.lookup(MODEL, both, chain, "f"), args.lookups)
               for _ in range(3))
    print(f"memory lookup, no tier, 64 chunks x 2 ranks: {fast:.1f} us")

    tier_a.stop()
    tier_b.stop()
    print("stats A:", tier_a.stats())
    print("stats B:", tier_b.stats())


def report(what: str, nbytes: int, tier_s: float, raw_s: float, floor: str) -> None:
    gbs = nbytes / tier_s / 1e9
    raw_gbs = nbytes / raw_s / 1e9
    print(f"{what:34s} tier {gbs:6.2f} GB/s   {floor}: {raw_gbs:6.2f} GB/s   "
          f"ratio {gbs / raw_gbs:.2f}x")


if __name__ == "__main__":
    main()
