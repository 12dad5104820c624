#!/usr/bin/env python3
"""Stores through two checkouts' servers in turns: this one and ``--before PATH`` (another
checkout, e.g. ``git archive <commit> | tar -x -C PATH``), each store against the raw gather of the
same blocks measured right before it, so load that drifts during the run hits both alike.

``bench_server.py`` runs one checkout per run; on a busy host the load between two runs differs
more than the change being measured. Here every round runs, in an order that flips each round:
gather, store on one server, gather, store on the other. A store's figure is its time until vLLM
sees it finished (``bench_server.wait_store``: the reply and the worker's drain); the server's
checksums, taken after the reply in newer checkouts, are then waited for untimed, so they do not
slow the next figure. Same Llama-8B-shaped chunks and config as ``bench_server.py``.

Usage: python scripts/bench/bench_store_ab.py --before /tmp/lmcache-before [--chunks 4] [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import bench_server as bench  # noqa: E402  (beside this script)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout's root")
    parser.add_argument("--chunks", type=int, default=4, help="chunks per store request")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    args.lookup_chunks = 0  # (bench.bench_caches sizes its caches by these)
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-ab-"))
    roots = {"before": args.before.resolve(), "after": ROOT}
    servers = {name: start(workdir, name, root, args.chunks) for name, root in roots.items()}
    try:
        run(args, {name: f"ipc://{workdir}/{name}.sock" for name in roots})
    finally:
        for server in servers.values():
            server.send_signal(signal.SIGTERM)
        for server in servers.values():
            server.wait(30)


def start(workdir: Path, name: str, root: Path, chunks: int) -> subprocess.Popen[bytes]:
    """``lmcache serve`` of the checkout at ``root`` (its code, imported from there)."""
    config = yaml.safe_load((ROOT / "configs/llama8b.yaml").read_text())
    config["server"].update(url=f"ipc://{workdir}/{name}.sock", http_url="off",
                            pool_size=(chunks + 8) * 32 * 2**20)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (workdir / f"{name}.log").open("wb")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.Popen([sys.executable, "-m", "lmcache_cli", "serve", "-c", str(path),
                             "--log-level", "warning"], cwd=root, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def run(args: argparse.Namespace, urls: dict[str, str]) -> None:
    import torch

    from lmcache_core.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPWorkerAdapter,
        LoadStoreOp,
    )
    from lmcache_core.kv.share import release_shared_kv_caches
    from lmcache_core.protocol import messages as m

    ctx = zmq.Context.instance()
    caches, segment = bench.bench_caches(args)
    workers = {}
    for name, url in urls.items():
        workers[name] = bench.wait_for(
            lambda url=url: LMCacheMPWorkerAdapter(url, ctx, "bench", 1, 0, bench.BLOCK))
        workers[name].register_kv_caches(caches)
        bench.wait_populated(workers[name].mq_client)
    blocks = list(range(args.chunks * bench.PER_CHUNK))
    raw = bench.RawCopy(list(caches.values()), blocks, args.chunks)
    nbytes = args.chunks * bench.LAYERS * 2 * bench.CHUNK * bench.HEADS * bench.DIM * 2
    ratios: dict[str, list[float]] = {name: [] for name in urls}
    speeds: dict[str, list[float]] = {name: [] for name in urls}
    hashed: dict[str, list[float]] = {name: [] for name in urls}  # until checksums recorded
    order = list(urls)
    for r in range(args.rounds + 1):  # the first round warms up (not counted)
        for name in (order if r % 2 else order[::-1]):
            worker = workers[name]
            worker.mq_client.request(m.ClearRequest(force=True))
            floor = raw.gather()
            until: list[float] = []
            took = bench.wait_store(worker, f"{name}{r}",
                                    LoadStoreOp([r * 13 + 3, *range(args.chunks * bench.CHUNK - 1)],
                                                blocks), until)
            if r:
                ratios[name].append(floor / took)
                speeds[name].append(nbytes / took / 1e9)
                hashed[name].append(floor / until[0])
    print(f"stores of {args.chunks} x 32 MiB, torch threads {torch.get_num_threads()}, "
          f"{args.rounds} rounds in turns, load average {os.getloadavg()[0]:.2f}:")
    for name in urls:
        q = statistics.quantiles(ratios[name], n=4)
        print(f"  {name:6s} store {statistics.median(speeds[name]):5.2f} GB/s, "
              f"{statistics.median(ratios[name]):.2f}x the raw gather before it "
              f"(quartiles {q[0]:.2f}-{q[2]:.2f}); until its checksums are recorded "
              f"{statistics.median(hashed[name]):.2f}x")
    after_over_before = [a / b for a, b in zip(ratios["after"], ratios["before"], strict=True)]
    print(f"  after / before, same round: median {statistics.median(after_over_before):.2f}x")
    for worker in workers.values():
        worker.shutdown()
    release_shared_kv_caches(segment)


if __name__ == "__main__":
    main()
