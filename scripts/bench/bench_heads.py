#!/usr/bin/env python3
"""Benchmark ``BlockCopier.scatter_heads`` (chunks stored by another TP size) against the same-TP
``scatter`` floor measured in the same run, on CPU, and print GB/s and the ratios.

Llama-8B shape (32 layers, 8 KV heads x 128, bf16, block 16, chunk 256 tokens = 32 MiB), flash_attn,
all layers in one storage (the stacked path), ``--chunks`` chunks per call:

1. ``scatter`` of TP=1 chunks into a TP=1 cache (the floor);
2. ``scatter_heads`` of TP=2 pieces into a TP=1 cache: (2a) the two pieces of a chunk consecutive
   slots of one pool (one fused copy writing whole rows), (2b) each piece in its own storage (two
   half-row copies); plus, with ``--alternatives``, other ways to do (2b) in plain torch;
3. ``scatter_heads`` of a TP=1 piece into rank 1 of TP=2 (a head slice of the piece);
4. ``scatter_heads`` of TP=2 pieces into rank 3 of TP=4 (a slice of piece [4, 8)).

GB/s counts the bytes written into the cache. The cases take turns within every repetition, so load
changes hit all alike; figures are medians of ``--reps`` repetitions after ``--warmup``.

Usage: python scripts/bench/bench_heads.py [--chunks 4] [--reps 7] [--threads 1 2] [--alternatives]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lmcache_core.kv.copy import BlockCopier  # noqa: E402

LAYERS, HEADS, DIM, BLOCK, CHUNK = 32, 8, 128, 16, 256
PER_CHUNK = CHUNK // BLOCK
Pieces = list[list[tuple[torch.Tensor, int, int]]]


def main() -> None:
    args = parse_args()
    n = args.chunks
    blocks = 2 * n * PER_CHUNK
    src_ids = list(range(n * PER_CHUNK))
    dst_ids = list(range(n * PER_CHUNK, 2 * n * PER_CHUNK))
    data = torch.empty(LAYERS, 2, blocks, BLOCK, HEADS, DIM, dtype=torch.bfloat16)
    data.view(torch.int16).random_()

    def cache(lo: int, hi: int) -> BlockCopier:
        layers = list(data[..., lo:hi, :].contiguous().unbind(0))
        copier = BlockCopier(layers, "flash_attn", CHUNK)
        assert copier.stacked
        return copier

    def store(world: int, pooled: bool) -> Pieces:
        """Each chunk's pieces as TP size ``world`` stores them (gather from each rank's cache)."""
        per = HEADS // world
        chunks: Pieces = [[] for _ in range(n)]
        piece_bytes = cache(0, per).chunk_bytes
        pool = torch.empty(n * world * piece_bytes, dtype=torch.uint8) if pooled else None
        for rank in range(world):
            copier = cache(rank * per, (rank + 1) * per)
            slots = [pool[(c * world + rank) * piece_bytes:][:piece_bytes] if pool is not None
                     else torch.empty(piece_bytes, dtype=torch.uint8) for c in range(n)]
            copier.gather(src_ids, slots)
            for c in range(n):
                chunks[c].append((slots[c], rank * per, (rank + 1) * per))
        return chunks

    tp1, tp2_pool, tp2_apart = store(1, False), store(2, True), store(2, False)
    full, half, quarter = cache(0, HEADS), cache(4, 8), cache(6, 8)
    tp1_slots = [pieces[0][0] for pieces in tp1]
    cases: dict[str, tuple[Callable[[], None], int]] = {
        "1  scatter TP=1 -> TP=1 (floor)": (lambda: full.scatter(tp1_slots, dst_ids),
                                            full.chunk_bytes),
        "2a scatter_heads TP=2 -> TP=1, pieces in one pool": (
            lambda: full.scatter_heads(tp2_pool, (0, 8), dst_ids), full.chunk_bytes),
        "2b scatter_heads TP=2 -> TP=1, pieces apart": (
            lambda: full.scatter_heads(tp2_apart, (0, 8), dst_ids), full.chunk_bytes),
        "3  scatter_heads TP=1 -> TP=2 rank 1": (
            lambda: half.scatter_heads(tp1, (4, 8), dst_ids), half.chunk_bytes),
        "4  scatter_heads TP=2 -> TP=4 rank 3": (
            lambda: quarter.scatter_heads(tp2_apart, (6, 8), dst_ids), quarter.chunk_bytes),
    }
    if args.alternatives:
        cases.update(alternatives(full, tp2_apart, dst_ids))
    check(full, tp1_slots, tp2_pool, tp2_apart, dst_ids)

    print(f"Llama-8B chunks ({full.chunk_bytes / 2**20:.0f} MiB at TP=1), {n} per call, "
          f"flash_attn, stacked; median of {args.reps} after {args.warmup} warm-up; "
          f"load average {os.getloadavg()[0]:.2f}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(args.warmup + args.reps):
            for name, (fn, _) in cases.items():
                start = time.perf_counter()
                fn()
                if rep >= args.warmup:
                    samples[name].append(time.perf_counter() - start)
        print(f"\ntorch threads {threads}:")
        floor = 0.0
        for name, (_, chunk_bytes) in cases.items():
            gbs = n * chunk_bytes / statistics.median(samples[name]) / 1e9
            floor = floor or gbs
            target = "  (target >= 0.8x)" if name.startswith("2a") or name.startswith("2b") else ""
            print(f"  {name:<58} {gbs:6.2f} GB/s  {gbs / floor:5.2f}x{target}")


def alternatives(full: BlockCopier, chunks: Pieces, dst_ids: list[int],
                 ) -> dict[str, tuple[Callable[[], None], int]]:
    """Other ways to copy TP=2 pieces in separate storages into a TP=1 cache, in plain torch."""
    layers = full.layers
    base = layers[0]
    step = layers[1].storage_offset() - base.storage_offset()
    cache = base.as_strided((LAYERS * 2, full.num_blocks, BLOCK, HEADS * DIM),
                            (step // 2, *base.stride()[1:3], 1)).view(torch.complex128)
    index = torch.tensor(dst_ids).view(len(chunks), PER_CHUNK)
    halves = [cache[..., : cache.shape[-1] // 2], cache[..., cache.shape[-1] // 2:]]

    def piece(slot: torch.Tensor) -> torch.Tensor:
        return slot.view(torch.complex128).view(LAYERS * 2, PER_CHUNK, BLOCK, -1)

    def narrow() -> None:  # index_copy_ in bf16 (no widening)
        for c, pieces in enumerate(chunks):
            for (slot, _, _), dst in zip(pieces, halves, strict=True):
                dst.view(torch.bfloat16).index_copy_(1, index[c], piece(slot).view(torch.bfloat16))

    def per_block() -> None:  # one strided copy_ per (piece, block)
        for c, pieces in enumerate(chunks):
            for (slot, _, _), dst in zip(pieces, halves, strict=True):
                src = piece(slot)
                for j, block in enumerate(index[c].tolist()):
                    dst[:, block].copy_(src[:, j])

    tile = 8  # groups per L2-sized reassembly tile (8 x 16 blocks x 16 x 2 KiB = 4 MiB)
    temp = torch.empty(tile, PER_CHUNK, BLOCK, cache.shape[-1], dtype=torch.complex128)

    def tiled() -> None:  # reassemble a few groups' whole rows in a small buffer, then one copy
        for c, pieces in enumerate(chunks):
            srcs = [piece(slot) for slot, _, _ in pieces]
            for g in range(0, LAYERS * 2, tile):
                temp[..., : temp.shape[-1] // 2].copy_(srcs[0][g: g + tile])
                temp[..., temp.shape[-1] // 2:].copy_(srcs[1][g: g + tile])
                cache[g: g + tile].index_copy_(1, index[c], temp)

    return {"2b' alt: index_copy_ in bf16 (no widening)": (narrow, full.chunk_bytes),
            "2b' alt: strided copy_ per block": (per_block, full.chunk_bytes),
            "2b' alt: 4 MiB reassembly tiles + index_copy_": (tiled, full.chunk_bytes)}


def check(full: BlockCopier, tp1: list[torch.Tensor], tp2_pool: Pieces, tp2_apart: Pieces,
          dst_ids: list[int]) -> None:
    """All ways give the same cache bytes."""
    got = []
    for fn in (lambda: full.scatter(tp1, dst_ids),
               lambda: full.scatter_heads(tp2_pool, (0, 8), dst_ids),
               lambda: full.scatter_heads(tp2_apart, (0, 8), dst_ids)):
        for layer in full.layers:
            layer.zero_()
        fn()
        got.append(torch.cat([t.view(torch.int16).flatten() for t in full.layers]))
    assert all(torch.equal(got[0], g) for g in got[1:])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=4, help="chunks per call")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--alternatives", action="store_true",
                        help="also time other ways to do case 2b in plain torch")
    return parser.parse_args()


if __name__ == "__main__":
    main()
