#!/usr/bin/env python3
"""Token hashing (``keys.chain_hashes``) of a prompt beside its floors, measured in the same run.

Floors: ``blake3`` over the same chunk-sized buffers with nothing else (the compressions themselves:
the chain is sequential, one call per chunk), and the list -> C array conversion of the prompt.
``--before FILE`` also times another keys.py (e.g. ``git show HEAD~1:lmcache_core/keys.py``).

Usage: python scripts/bench/bench_keys.py [--tokens 16384] [--chunk-size 256] [--before /tmp/keys_before.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
from array import array
from pathlib import Path

import numpy as np
from blake3 import blake3

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchlib import timed  # (beside this script)

from lmcache_core.keys import chain_hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--before", type=Path, help="another keys.py to time beside this one")
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(0, 128_256) for _ in range(args.tokens)]
    forms = {"list": tokens, "numpy int64": np.array(tokens, dtype=np.int64),
             "numpy uint32": np.array(tokens, dtype=np.uint32)}
    n_chunks = args.tokens // args.chunk_size
    block = bytes(32 + args.chunk_size * 4)

    hasher = blake3()

    def blake3_floor() -> None:  # one hasher, reset: no object made per chunk
        for _ in range(n_chunks):
            hasher.update(block)
            hasher.digest()
            hasher.reset()

    implementations = {"now": chain_hashes}
    if args.before:
        spec = importlib.util.spec_from_file_location("keys_before", args.before)
        assert spec is not None and spec.loader is not None
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        implementations["before"] = before.chain_hashes
        assert before.chain_hashes(tokens, args.chunk_size) == chain_hashes(tokens, args.chunk_size)
    floor = timed(blake3_floor, args.iters)
    convert = timed(lambda: array("I", tokens), args.iters)
    print(f"{args.tokens} tokens, {n_chunks} chunks of {args.chunk_size} (p50 of {args.iters})")
    print(f"  floor: {n_chunks} x blake3({len(block)} bytes), nothing else   {floor:8.1f} us")
    print(f"  floor: list -> array('I') conversion                 {convert:8.1f} us")
    for name, fn in implementations.items():
        for form, data in forms.items():
            us = timed(lambda fn=fn, data=data: fn(data, args.chunk_size), args.iters)
            print(f"  chain_hashes ({name:6s}) of a {form:13s}            {us:8.1f} us"
                  f"  ratio {us / floor:.2f}x the blake3 floor")


if __name__ == "__main__":
    main()
