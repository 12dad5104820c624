"""LMCache 0.5.6's own client against ``lmcache serve`` and against LMCache's own server, back to back.

Runs in the environment ``scripts/test-lmcache`` builds (it needs the ``lmcache`` package), e.g.
``~/.cache/lmcache-0.5.6-venv/bin/python scripts/bench/bench_lmcache_client.py``. Both servers get the same
chunk size and the same workload from LMCache's ``LMCacheMPWorkerAdapter`` / ``LMCacheMPSchedulerAdapter``
on CPU KV caches in shared memory (``lmcache_driven``): per iteration, one request of ``--chunks``
chunks is stored, looked up (token mode) and retrieved into other blocks (checked byte-exact), then
its session ended. Prints store and retrieve GB/s and lookup latency (medians) for each server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_MP_TRANSFER_MODE", "lmcache_driven")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch
import yaml
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)

BLOCK = 16
TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def until(fn: Any, what: str) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while (result := fn()) is None or result is False:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {TIMEOUT_S} s")
        time.sleep(0.0002)
    return result


def start_ours(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    url = f"tcp://127.0.0.1:{free_port()}"
    config = {"model": {"name": "bench", "num_layers": args.layers, "num_kv_heads": args.heads,
                        "head_dim": args.head_dim, "dtype": "float16"},
              "world_size": 1, "chunk_size": args.chunk,
              "server": {"url": url, "pool_size": f"{args.pool_mib}MiB", "http_url": "off"}}
    path = tmp / "ours.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_cli", "serve", "-c", str(path)],
                            stdout=(tmp / "ours.log").open("wb"), stderr=subprocess.STDOUT)
    return proc, url


def start_theirs(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    gb = max(args.pool_mib / 1024, 0.25)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
         "--port", str(port), "--l1-size-gb", f"{gb:.3f}", "--no-l1-use-lazy",
         "--eviction-policy", "LRU", "--disable-observability", "--chunk-size", str(args.chunk)],
        stdout=(tmp / "theirs.log").open("wb"), stderr=subprocess.STDOUT)
    return proc, f"tcp://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    ctx = zmq.Context.instance()
    deadline = time.monotonic() + 180  # LMCache's first start in a new env compiles a lot
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-2000:]}")
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(url)
        sock.send_multipart([b"\x00", b"\x18"])  # [0, 24]: LMCache's noop
        ok = sock.poll(500)
        sock.close(0)
        if ok:
            return
    raise RuntimeError(f"server at {url} did not answer:\n{log.read_text()[-2000:]}")


def run(url: str, args: argparse.Namespace, name: str) -> dict[str, float]:
    strategy = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                                pp_size=1, n_servers=1)
    extra = {"lmcache.mp.mq_timeout": TIMEOUT_S}
    per_chunk = args.chunk // BLOCK
    blocks = 2 * args.chunks * per_chunk
    layers = {f"l{i}": torch.zeros(2, blocks, BLOCK, args.heads, args.head_dim,
                                   dtype=torch.float16) for i in range(args.layers)}
    gen = torch.Generator().manual_seed(0)
    for layer in layers.values():
        layer.copy_(torch.randint(-100, 100, layer.shape, generator=gen).half())
    ctx = zmq.Context.instance()
    worker = LMCacheMPWorkerAdapter(url, ctx, "bench", BLOCK, strategy, extra_config=extra)
    worker.register_kv_caches(layers, layout_hints={"kv_layout": "NHD"})
    scheduler = LMCacheMPSchedulerAdapter([url], ctx, "bench", BLOCK, strategy, extra_config=extra)
    src = list(range(args.chunks * per_chunk))
    dst = list(range(args.chunks * per_chunk, blocks))
    end = args.chunks * args.chunk
    nbytes = sum(layer[:, src].numel() * 2 for layer in layers.values())
    stores, retrieves, lookups = [], [], []
    try:
        for it in range(args.iterations + 1):
            tokens = [(it * 7919 + i * 31) % 32000 for i in range(end)]
            req = f"{name}-{it}"
            t0 = time.perf_counter()
            worker.submit_store_request(req, LoadStoreOp(token_ids=tokens, block_ids=[src],
                                                         start=0, end=end),
                                        worker.create_recorded_event())
            until(lambda r=req: r in (worker.get_finished({r})[0] or set()), "store")
            t1 = time.perf_counter()
            time.sleep(0.05)  # LMCache's server makes a store visible a few ms after its reply
            t2 = time.perf_counter()
            scheduler.maybe_submit_lookup_request(req, tokens)
            hit = until(lambda r=req: scheduler.check_lookup_result(r), "lookup")
            t3 = time.perf_counter()
            assert hit == end, f"{name}: lookup hit {hit} of {end} tokens"
            for layer in layers.values():
                layer[:, dst] = 0
            t4 = time.perf_counter()
            worker.submit_retrieve_request(req, LoadStoreOp(token_ids=tokens, block_ids=[dst],
                                                            start=0, end=end),
                                           worker.create_recorded_event())
            until(lambda r=req: r in (worker.get_finished(set())[1] or set()), "retrieve")
            t5 = time.perf_counter()
            assert not worker.get_block_ids_with_load_errors(), f"{name}: load errors"
            for layer in layers.values():
                assert torch.equal(layer[:, src], layer[:, dst]), f"{name}: retrieve not byte-exact"
            scheduler.end_session(req)
            if it:  # the first is a warm-up
                stores.append(t1 - t0)
                lookups.append(t3 - t2)
                retrieves.append(t5 - t4)
    finally:
        scheduler.shutdown()
        worker.shutdown()
    return {"store_gbs": nbytes / statistics.median(stores) / 1e9,
            "retrieve_gbs": nbytes / statistics.median(retrieves) / 1e9,
            "lookup_ms": statistics.median(lookups) * 1000, "mib": nbytes / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=4, help="chunks per request")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--pool-mib", type=int, default=1024)
    parser.add_argument("--only", choices=("ours", "theirs"), default=None)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-lmcache-client-"))
    results: dict[str, dict[str, float]] = {}
    try:
        for name, start in (("lmcache serve", start_ours), ("LMCache 0.5.6 server", start_theirs)):
            if args.only and (args.only == "ours") != (start is start_ours):
                continue
            proc, url = start(args, tmp)
            try:
                wait_ready(url, proc, tmp / ("ours.log" if start is start_ours else "theirs.log"))
                results[name] = run(url, args, name.split()[0])
            finally:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"LMCache 0.5.6 client, lmcache_driven over CPU shared memory, {args.layers} layers x "
          f"{args.heads}x{args.head_dim} fp16, chunk {args.chunk}, {args.chunks} chunks/request, "
          f"median of {args.iterations}")
    print(f"{'server':<22} {'MiB/req':>8} {'store GB/s':>11} {'retrieve GB/s':>14} {'lookup ms':>10}")
    for name, r in results.items():
        print(f"{name:<22} {r['mib']:>8.0f} {r['store_gbs']:>11.2f} {r['retrieve_gbs']:>14.2f} "
              f"{r['lookup_ms']:>10.2f}")


if __name__ == "__main__":
    main()
