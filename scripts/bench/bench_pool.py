#!/usr/bin/env python3
"""Fragmentation and eviction of the memory pool under a mixed workload (no server, no copies).

A stream of stores into one ``CacheEngine``, each of ``--pieces`` new pieces of one size drawn
from three (default: 256 KiB, a TP=8 piece of a small model; 3 MiB, an odd size of 1.5 units;
32 MiB, a Llama-8B chunk), and every few stores a lookup that keeps a random earlier prefix warm.
Once the pool is full it reports, over the second half of the stream:

- fragmentation: bytes the pool has taken (units or slabs in use) / bytes of pieces held;
- eviction per store: bytes a store evicted / bytes it stored, over the stores that evicted
  (1.0: it freed what it needed; a store of a new size that empties a whole slab: far more);
- the share of the pool the held pieces fill, and how many stores found no room.

Run it against another checkout (``PYTHONPATH=/path/to/other python scripts/bench/bench_pool.py``) to
compare allocators on the same stream (same seed).

Usage: python scripts/bench/bench_pool.py [--pool-mib 1024] [--stores 3000] [--sizes 262144,3145728,...]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.keys import ChunkKey, opaque_layout
from lmcache_core.storage.pool import MemoryPool

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-mib", type=int, default=1024)
    parser.add_argument("--stores", type=int, default=3000)
    parser.add_argument("--pieces", type=int, default=4)
    parser.add_argument("--sizes", default=f"{256 << 10},{3 * MIB},{32 * MIB}")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    pool = MemoryPool(args.pool_mib * MIB, pin=False)
    engine = CacheEngine(pool, chunk_size=256)
    rng = random.Random(args.seed)
    layout = opaque_layout(1)
    history: list[tuple[str, list[bytes]]] = []
    samples: list[float] = []
    fill: list[float] = []
    ratios: list[float] = []
    refused = 0
    spent = 0.0
    for n in range(args.stores):
        nbytes = rng.choice(sizes)
        model = f"m{nbytes}"
        hashes = [f"{n}:{i}".encode().ljust(32, b".") for i in range(args.pieces)]
        keys = [ChunkKey(model, layout, 0, 1, chunk_hash) for chunk_hash in hashes]
        figures = engine.snapshot().engine
        before = figures.evictions, figures.bytes_used
        start = time.perf_counter()
        plan = engine.store.begin_store(keys, nbytes)
        engine.store.finish_store(plan)
        spent += time.perf_counter() - start
        history.append((model, hashes))
        if n % 4 == 3 and history:
            warm_model, warm = rng.choice(history[-50:])
            engine.lookup(warm_model, [GroupTarget(layout, ((0, 1),))], warm, "warm", lock=False)
        if n >= args.stores // 2:
            held = engine.snapshot().engine.bytes_used
            freed = before[1] + plan.stored * nbytes - held
            if freed > 0 and plan.stored:
                ratios.append(freed / (plan.stored * nbytes))
            refused += plan.skipped_full > 0
            taken = (pool.num_slabs - pool.free_slabs) * pool.slab_bytes
            samples.append(taken / held)
            fill.append(held / pool.nbytes)
    print(f"pool {pool.nbytes / MIB:.0f} MiB = {pool.num_slabs} x {pool.slab_bytes / MIB:g} MiB, "
          f"piece sizes {', '.join(f'{s / MIB:g} MiB' for s in sizes)}, {args.pieces} pieces a "
          f"store, {args.stores} stores (the second half measured)")
    print(f"  fragmentation (bytes taken / bytes held)   mean {statistics.mean(samples):.3f}  "
          f"max {max(samples):.3f}")
    print(f"  pieces fill of the pool                    mean {statistics.mean(fill):.1%}  "
          f"min {min(fill):.1%}")
    ratios.sort()
    print(f"  evicted / stored, stores that evicted      mean {statistics.mean(ratios):.2f}  "
          f"p99 {ratios[int(len(ratios) * 0.99)]:.2f}  max {ratios[-1]:.2f}")
    print(f"  stores that found no room for some piece   {refused}")
    print(f"  engine time per store (begin+finish)       {spent / args.stores * 1e6:.0f} us")


if __name__ == "__main__":
    main()
