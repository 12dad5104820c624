#!/usr/bin/env python3
"""Benchmark ``lmcache serve`` against floors measured in the same run, and print the ratios.

- lookup round trip for a 16k-token prompt (64 chunks, all hits) vs a bare pyzmq DEALER/ROUTER echo
  of a frame of the same size, both across two processes;
- store and retrieve GB/s of Llama-8B-shaped chunks (32 layers, 8 kv heads x 128, bf16, 256 tokens =
  32 MiB) through shared memory vs a plain torch gather/scatter of the same blocks in one process;
- the scheduler adapter's ``check_lookup_result`` on a pending lookup, and a batched store of 32
  requests x 1 chunk vs 32 single stores;
- a TP=1 retrieve of chunks a TP=2 engine stored (head-range pieces) vs a same-TP retrieve and the
  raw scatter;
- a hybrid model (Gemma-3-like: one full-attention group and two sliding-window groups of the same
  shapes, window 1024 at chunk 256): store and retrieve GB/s (each group's pieces: a retrieve loads
  the full group's chunks and only the windows' last chunks) vs the raw gather/scatter of the same
  bytes;
- integrity: store with checksums (xxh3 of each piece, always taken, right after the store's reply)
  vs the raw gather and the raw gather + xxh3, the store until its checksums are recorded, and
  retrieve with ``integrity.verify_on_retrieve`` on (a second server) vs
  off (the main one), taking turns in every round.

``--metrics compare`` runs two servers at once, one with its HTTP listener off and one with it on
(the /metrics collector and the per-request latency histogram), and measures the lookup round trip
and store/retrieve against the same floors, taking turns within every batch and round, then prints
both servers' ratios and how much metrics change them (the issue's target: within 5 %).

Usage: python scripts/bench/bench_server.py [--chunks 8] [--rounds 5] [--lookups 2000]
       [--metrics on|off|compare] [--only hybrid]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchlib import ECHO, timed  # noqa: E402  (beside this script)

LAYERS, HEADS, DIM, BLOCK, CHUNK = 32, 8, 128, 16, 256
PER_CHUNK = CHUNK // BLOCK
BATCH_REQUESTS = 32  # the batched-vs-single stores: one chunk each
COPY_NAP_S = 0.0002  # poll interval while a 256 MiB copy (~20-40 ms) runs in the server


def main() -> None:
    args = parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-bench-"))
    echo_url = f"ipc://{workdir}/echo.sock"
    echo = start_echo(echo_url)
    modes = ["off", "on"] if args.metrics == "compare" else [args.metrics]
    urls = {mode: f"ipc://{workdir}/server-{mode}.sock" for mode in modes}
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for mode, url in urls.items():
            servers.append(start_server(workdir, args, url, http=mode == "on"))
        if args.metrics == "compare":
            compare_metrics(args, urls, echo_url)
        else:
            verify_url = f"ipc://{workdir}/server-verify.sock"  # integrity.verify_on_retrieve on
            servers.append(start_server(workdir, args, verify_url, http=False,
                                        slots=args.chunks + 8,
                                        integrity={"verify_on_retrieve": True}))
            run(args, workdir, server_url=urls[args.metrics], echo_url=echo_url,
                verify_url=verify_url)
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
        echo.kill()
        for server in servers:
            server.wait(30)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=8, help="chunks per store/retrieve request")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--lookup-chunks", type=int, default=64, help="64 x 256 = a 16k-token prompt")
    parser.add_argument("--metrics", choices=("on", "off", "compare"), default="on",
                        help="the server's HTTP listener (metrics) on, off, or two servers compared")
    parser.add_argument("--only", choices=("hybrid",), default=None,
                        help="run only this row (and its floors)")
    return parser.parse_args()


def start_echo(url: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", ECHO, url], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def start_server(workdir: Path, args: argparse.Namespace, url: str, http: bool,
                 slots: int | None = None, integrity: dict | None = None) -> subprocess.Popen[bytes]:
    slots = slots or max(args.chunks, args.lookup_chunks, BATCH_REQUESTS) + 8
    config = yaml.safe_load((ROOT / "configs/llama8b.yaml").read_text())
    config["server"].update(url=url, pool_size=slots * 32 * 2**20,
                            http_url="http://127.0.0.1:0" if http else "off")
    if integrity:
        config["integrity"] = integrity
    name = url.rsplit("/", 1)[-1].removesuffix(".sock")
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (workdir / f"{name}.log").open("wb")
    return subprocess.Popen([sys.executable, "-m", "lmcache_cli", "serve", "-c", str(path),
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)


def run(args: argparse.Namespace, workdir: Path, server_url: str, echo_url: str,
        verify_url: str) -> None:
    import torch

    from lmcache_core.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPSchedulerAdapter,
        LMCacheMPWorkerAdapter,
        LoadStoreOp,
    )
    from lmcache_core.keys import chain_hashes
    from lmcache_core.kv.share import release_shared_kv_caches
    from lmcache_core.protocol import messages as m
    from lmcache_core.transport.client import MessageQueueClient

    ctx = zmq.Context.instance()
    if args.only == "hybrid":
        client = MessageQueueClient(server_url, ctx)
        wait_for(client.server_info)  # the server may still be starting
        wait_populated(client)
        hybrid(args, ctx, server_url, client)
        client.close()
        return
    caches, segment = bench_caches(args)
    worker = wait_for(lambda: LMCacheMPWorkerAdapter(server_url, ctx, "bench", 1, 0, BLOCK))
    worker.register_kv_caches(caches)
    scheduler = LMCacheMPSchedulerAdapter(server_url, ctx, "bench", 1, 0, BLOCK)
    client = worker.mq_client
    populate_s = wait_populated(client)
    chunk_bytes = LAYERS * 2 * CHUNK * HEADS * DIM * 2
    print(f"torch threads {torch.get_num_threads()}, chunk {chunk_bytes / 2**20:.0f} MiB, "
          f"{args.chunks} chunks per request ({args.chunks * chunk_bytes / 2**20:.0f} MiB), "
          f"load average {os.getloadavg()[0]:.2f}; the server's pool populated in "
          f"{populate_s if populate_s is None else round(populate_s, 2)} s (waited for, so it "
          "does not compete with the timed copies)\n")

    # ---- lookup vs echo
    prompt = list(range(args.lookup_chunks * CHUNK))
    hashes = chain_hashes(prompt, CHUNK)
    wait_store(worker, "lk", LoadStoreOp(prompt, list(range(args.lookup_chunks * PER_CHUNK))))
    request = m.LookupRequest(model_name="bench", world_size=1, lookup_id="bench", chunk_hashes=hashes,
                              lock=False)
    assert client.request(request).hit_chunks == args.lookup_chunks
    frame_bytes = len(__import__("msgspec").msgpack.encode(request))
    echo_us, lookup_us = interleaved(
        echo_once(ctx, echo_url, frame_bytes),
        lambda: client.request(request), args.lookups)
    hash_us = timed(lambda: chain_hashes(prompt, CHUNK), 200)
    adapter_us = timed(lambda: scheduler_lookup(scheduler, prompt), min(args.lookups, 500))
    print(f"lookup, {len(prompt)} tokens = {len(hashes)} chunks, all hits (p50 of {args.lookups}):")
    report("  bare zmq echo, same frame size", echo_us, "us")
    report("  lmcache lookup round trip", lookup_us, "us", floor=echo_us, target="<= 2.0x")
    report("  + client-side hashing of the prompt", hash_us, "us")
    report("  scheduler adapter submit..result (hash+rtt)", adapter_us, "us")

    # ---- check_lookup_result on a pending lookup
    pid = server_pid(client)
    os.kill(pid, signal.SIGSTOP)
    try:
        scheduler.maybe_submit_lookup_request("pending", prompt)
        pending_us = timed(lambda: scheduler.check_lookup_result("pending"), 20000)
    finally:
        os.kill(pid, signal.SIGCONT)
    report("  check_lookup_result on a pending lookup", pending_us, "us", target="< 20 us")
    scheduler.end_session("pending").result(10)

    # ---- store / retrieve vs raw gather / scatter
    print(f"\nstore / retrieve, {args.chunks} x 32 MiB chunks per request (median of {args.rounds}):")
    src_blocks = list(range(args.chunks * PER_CHUNK))
    dst_blocks = list(range(args.chunks * PER_CHUNK, 2 * args.chunks * PER_CHUNK))
    nbytes = args.chunks * chunk_bytes
    raw = RawCopy(list(caches.values()), src_blocks, args.chunks)
    store_s, retrieve_s, gather_s, scatter_s, batched_s = [], [], [], [], []
    for r in range(args.rounds + 1):  # floor and ours take turns, so load changes hit both alike
        client.request(m.ClearRequest(force=True))
        toks = [r * 7 + 1, *range(args.chunks * CHUNK - 1)]
        gather_s.append(raw.gather())
        store_s.append(wait_store(worker, f"s{r}", LoadStoreOp(toks, src_blocks)))
        scatter_s.append(raw.scatter())
        # the server's default load deadline (timeouts.load_ms: checked before each chunk copy)
        # and none (0: one batched scatter), first one then the other, so neither gets the
        # warmer destination every time
        for deadline in ((None, 0) if r % 2 else (0, None)):
            worker.load_deadline_ms = deadline
            samples = retrieve_s if deadline is None else batched_s
            samples.append(wait_retrieve(scheduler, worker, f"{deadline}-{r}", toks, dst_blocks))
    check_equal(caches, src_blocks, dst_blocks)
    store_gbs, retrieve_gbs, raw_gather, raw_scatter, batched_gbs = (
        nbytes / statistics.median(samples[1:]) / 1e9
        for samples in (store_s, retrieve_s, gather_s, scatter_s, batched_s))
    report("  raw torch gather (index_select)", raw_gather, "GB/s")
    report("  lmcache store", store_gbs, "GB/s", floor=raw_gather, target=">= 0.9x")
    report("  raw torch scatter (index_copy_)", raw_scatter, "GB/s")
    report("  lmcache retrieve", retrieve_gbs, "GB/s", floor=raw_scatter, target=">= 0.9x")
    report("  lmcache retrieve, no deadline (one scatter)", batched_gbs, "GB/s", floor=raw_scatter)
    report("  deadline checks per chunk vs one scatter", retrieve_gbs, "GB/s", floor=batched_gbs,
           target="~1.0x")

    integrity_rows(args, ctx, verify_url, (worker, scheduler, client), caches, raw, src_blocks,
                   dst_blocks, nbytes)
    cross_tp(args, ctx, server_url, worker, scheduler, client, caches, raw, dst_blocks, nbytes)
    hybrid(args, ctx, server_url, client)

    # ---- batched vs single stores: with copies, then of chunks already cached (pure round trips)
    n = BATCH_REQUESTS
    ops = [LoadStoreOp([1000 + i, *range(CHUNK - 1)], list(range(i * PER_CHUNK, (i + 1) * PER_CHUNK)))
           for i in range(n)]
    for label, clear in (("new chunks (copy-bound)", True), ("chunks already cached (round trips)", False)):
        times = {}
        for mode in ("batched", "single"):
            if clear:
                client.request(m.ClearRequest(force=True))
            ids = [f"{mode}{label[:3]}{i}" for i in range(n)]
            start = time.perf_counter()
            if mode == "batched":
                worker.batched_submit_store_requests(ids, ops, None)
            else:
                for request_id, op in zip(ids, ops, strict=True):
                    worker.submit_store_request(request_id, op, None)
            drain(worker, set(ids))
            times[mode] = time.perf_counter() - start
        print(f"\n{n} requests x 1 chunk, {label}: batched {times['batched'] * 1e3:.2f} ms (1 round trip)"
              f" vs single {times['single'] * 1e3:.2f} ms ({n}): {times['single'] / times['batched']:.2f}x")
    pid = server_pid(client)
    info = client.server_info()
    shared = sum(layer.numel() * layer.element_size() for layer in caches.values())
    print(f"\nserver memory: RSS {rss_mib(pid):.0f} MiB = pool {info.pool_bytes / 2**20:.0f} MiB + mapped "
          f"KV caches {shared / 2**20:.0f} MiB (counted when touched) + the process itself")
    worker.shutdown()
    scheduler.close()
    release_shared_kv_caches(segment)


def bench_caches(args: argparse.Namespace):
    """The benchmark worker's KV caches in shared memory (Llama-8B shape), filled with noise:
    room for the biggest request twice (source and destination blocks)."""
    import torch

    from lmcache_core.kv.share import allocate_shared_kv_caches

    n_blocks = max(args.chunks, args.lookup_chunks, BATCH_REQUESTS) * PER_CHUNK * 2
    caches, segment = allocate_shared_kv_caches(LAYERS, [2, n_blocks, BLOCK, HEADS, DIM],
                                                torch.bfloat16)
    for layer in caches.values():
        layer.uniform_()
    return caches, segment


def compare_metrics(args: argparse.Namespace, urls: dict[str, str], echo_url: str) -> None:
    """Lookup, store and retrieve through the server without metrics and the one with them, in
    turns (the order flips every round), against one echo and one gather/scatter floor."""
    import torch

    from lmcache_core.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPSchedulerAdapter,
        LMCacheMPWorkerAdapter,
        LoadStoreOp,
    )
    from lmcache_core.keys import chain_hashes
    from lmcache_core.kv.share import release_shared_kv_caches
    from lmcache_core.protocol import messages as m

    ctx = zmq.Context.instance()
    caches, segment = bench_caches(args)
    workers, schedulers = {}, {}
    for mode, url in urls.items():
        workers[mode] = wait_for(lambda url=url: LMCacheMPWorkerAdapter(url, ctx, "bench", 1, 0, BLOCK))
        workers[mode].register_kv_caches(caches)
        schedulers[mode] = LMCacheMPSchedulerAdapter(url, ctx, "bench", 1, 0, BLOCK)
    clients = {mode: worker.mq_client for mode, worker in workers.items()}
    for client in clients.values():
        wait_populated(client)
    chunk_bytes = LAYERS * 2 * CHUNK * HEADS * DIM * 2
    print(f"metrics off vs on: two servers, torch threads {torch.get_num_threads()}, "
          f"{args.chunks} x 32 MiB chunks per store/retrieve, load average "
          f"{os.getloadavg()[0]:.2f}\n")

    prompt = list(range(args.lookup_chunks * CHUNK))
    request = m.LookupRequest(model_name="bench", world_size=1, lookup_id="bench",
                              chunk_hashes=chain_hashes(prompt, CHUNK), lock=False)
    for mode in urls:
        wait_store(workers[mode], "lk", LoadStoreOp(prompt, list(range(args.lookup_chunks * PER_CHUNK))))
        assert clients[mode].request(request).hit_chunks == args.lookup_chunks
    frame_bytes = len(__import__("msgspec").msgpack.encode(request))
    lookups = [lambda c=clients[mode]: c.request(request) for mode in urls]
    echo_us, *lookup_us = interleaved_p50s([echo_once(ctx, echo_url, frame_bytes), *lookups], args.lookups)

    src_blocks = list(range(args.chunks * PER_CHUNK))
    dst_blocks = list(range(args.chunks * PER_CHUNK, 2 * args.chunks * PER_CHUNK))
    raw = RawCopy(list(caches.values()), src_blocks, args.chunks)
    floors: dict[str, list[float]] = {"gather": [], "scatter": []}
    times: dict[str, list[float]] = {f"{op} {mode}": [] for op in ("store", "retrieve") for mode in urls}
    for r in range(args.rounds + 1):
        order = list(urls) if r % 2 == 0 else list(urls)[::-1]
        for mode in order:
            clients[mode].request(m.ClearRequest(force=True))
        toks = [r * 7 + 1, *range(args.chunks * CHUNK - 1)]
        floors["gather"].append(raw.gather())
        for mode in order:
            times[f"store {mode}"].append(wait_store(workers[mode], f"s{r}", LoadStoreOp(toks, src_blocks)))
        floors["scatter"].append(raw.scatter())
        for mode in order:
            times[f"retrieve {mode}"].append(
                wait_retrieve(schedulers[mode], workers[mode], f"s{r}", toks, dst_blocks))
    check_equal(caches, src_blocks, dst_blocks)

    def gbs(samples: list[float]) -> float:
        return args.chunks * chunk_bytes / statistics.median(samples[1:]) / 1e9

    ratios = {mode: (lookup_us[i] / echo_us, gbs(times[f"store {mode}"]) / gbs(floors["gather"]),
                     gbs(times[f"retrieve {mode}"]) / gbs(floors["scatter"]))
              for i, mode in enumerate(urls)}
    print(f"bare zmq echo p50 {echo_us:.1f} us; raw gather {gbs(floors['gather']):.2f} GB/s, raw "
          f"scatter {gbs(floors['scatter']):.2f} GB/s (p50 of {args.lookups} lookups, median of "
          f"{args.rounds} rounds)")
    print(f"{'':30s} {'metrics off':>12s} {'metrics on':>12s} {'change':>8s}")
    labels = ("lookup / echo (lower better)", "store / raw gather", "retrieve / raw scatter")
    for i, label in enumerate(labels):
        off, on = ratios["off"][i], ratios["on"][i]
        print(f"{label:30s} {off:12.3f} {on:12.3f} {100 * (on - off) / off:+7.1f}%")
    for worker in workers.values():
        worker.shutdown()
    for scheduler in schedulers.values():
        scheduler.close()
    release_shared_kv_caches(segment)


def integrity_rows(args, ctx, verify_url: str, plain, caches, raw, src_blocks: list[int],
                   dst_blocks: list[int], nbytes: int) -> None:
    """Store with checksums (every store takes them) vs the raw gather and the raw gather + xxh3;
    retrieve with integrity.verify_on_retrieve on (the second server) vs off (the main one)."""
    from lmcache_core.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPSchedulerAdapter,
        LMCacheMPWorkerAdapter,
        LoadStoreOp,
    )
    from lmcache_core.protocol import messages as m

    worker, scheduler, client = plain
    worker_v = wait_for(lambda: LMCacheMPWorkerAdapter(verify_url, ctx, "bench", 1, 0, BLOCK))
    worker_v.register_kv_caches(caches)
    scheduler_v = LMCacheMPSchedulerAdapter(verify_url, ctx, "bench", 1, 0, BLOCK)
    wait_populated(worker_v.mq_client)
    worker.load_deadline_ms = worker_v.load_deadline_ms = None  # both: the server's default
    names = ("gather", "gather + xxh3", "store", "store hashed", "scatter", "retrieve off",
             "retrieve on")
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds + 1):
        for c in (client, worker_v.mq_client):
            c.request(m.ClearRequest(force=True))
        toks = [r * 11 + 5, *range(args.chunks * CHUNK - 1)]
        samples["gather"].append(raw.gather())
        samples["gather + xxh3"].append(raw.gather() + raw.checksum())
        samples["store"].append(wait_store(worker, f"i{r}", LoadStoreOp(toks, src_blocks),
                                           samples["store hashed"]))
        wait_store(worker_v, f"i{r}", LoadStoreOp(toks, src_blocks))
        samples["scatter"].append(raw.scatter())
        turns = [("retrieve off", scheduler, worker), ("retrieve on", scheduler_v, worker_v)]
        for name, sched, work in (turns if r % 2 else turns[::-1]):
            samples[name].append(wait_retrieve(sched, work, f"i{name[-2:]}{r}", toks, dst_blocks))
    check_equal(caches, src_blocks, dst_blocks)
    gbs = {name: nbytes / statistics.median(values[1:]) / 1e9 for name, values in samples.items()}
    verified = worker_v.mq_client.server_info().stats.engine
    print(f"\nintegrity (xxh3-64 per piece), {args.chunks} x 32 MiB chunks (median of {args.rounds}):")
    report("  raw torch gather (index_select)", gbs["gather"], "GB/s")
    report("  raw gather + xxh3 of each chunk", gbs["gather + xxh3"], "GB/s", floor=gbs["gather"])
    report("  lmcache store with integrity (checksum after reply)", gbs["store"], "GB/s",
           floor=gbs["gather"], target=">= 0.9x")
    report("  ... until its checksums are recorded", gbs["store hashed"], "GB/s",
           floor=gbs["gather"])
    report("  raw torch scatter (index_copy_)", gbs["scatter"], "GB/s")
    report("  lmcache retrieve, verify_on_retrieve off", gbs["retrieve off"], "GB/s",
           floor=gbs["scatter"])
    report("  lmcache retrieve, verify_on_retrieve on", gbs["retrieve on"], "GB/s",
           floor=gbs["scatter"])
    report("  verify on vs off", gbs["retrieve on"], "GB/s", floor=gbs["retrieve off"])
    print(f"  (the verifying server checked {verified.integrity_verified_chunks} pieces, "
          f"{verified.integrity_failures} failed)")
    worker_v.shutdown()
    scheduler_v.close()


def wait_for(make):  # the server may still be starting
    deadline = time.monotonic() + 60
    while True:
        try:
            return make()
        except Exception:
            if time.monotonic() > deadline:
                raise


def wait_populated(client, timeout_s: float = 120.0) -> float | None:
    """Wait until the server's background populate of its pool (server.prefault) is over."""

    deadline = time.monotonic() + timeout_s
    while True:
        info = client.server_info()
        if info.pool_populate not in ("pending", "running") or time.monotonic() > deadline:
            return info.pool_populate_s
        time.sleep(0.05)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def server_pid(client) -> int:

    return client.ping().pid


def spin_until(ready, nap_s: float = 0.0) -> None:
    """Poll like a scheduler loop would, letting the client's I/O thread take the GIL between polls
    (a bare busy loop would hold it for the whole 5 ms switch interval). Long copies poll with a
    short nap so the poller does not take a core from the server's copy threads."""
    while not ready():
        time.sleep(nap_s)


def scheduler_lookup(scheduler, prompt: list[int]) -> None:
    scheduler.maybe_submit_lookup_request("adapter", prompt)
    spin_until(lambda: scheduler.check_lookup_result("adapter") is not None)
    scheduler.cleanup_lookup_result("adapter")


def wait_store(worker, request_id: str, op, hashed: list[float] | None = None) -> float:
    """The store's time until vLLM sees it finished; then, untimed, until the server recorded its
    checksums (taken after the reply), so that hashing does not slow the next figure measured.
    ``hashed`` gets the time until then too."""
    start = time.perf_counter()
    worker.submit_store_request(request_id, op, None)
    wait_replies(worker, worker.store_futures(request_id))
    drain(worker, {request_id})
    took = time.perf_counter() - start
    if request_id in worker.failed_stores:
        raise SystemExit(f"store failed: {worker.failed_stores[request_id]}")
    spin_until(lambda: not worker.mq_client.server_info().stats.engine.checksums_pending,
               0.001)  # (each poll is a round trip the server answers)
    if hashed is not None:
        hashed.append(time.perf_counter() - start)
    return took


def wait_retrieve(scheduler, worker, request_id: str, toks: list[int], blocks: list[int],
                  op=None) -> float:
    """The time of a retrieve (after its lookup) of ``op``, by default all of ``blocks``."""
    from lmcache_core.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

    scheduler.cleanup_lookup_result(request_id)
    scheduler.maybe_submit_lookup_request(request_id, toks)
    spin_until(lambda: scheduler.check_lookup_result(request_id) is not None)
    start = time.perf_counter()
    worker.submit_retrieve_request(request_id, op or LoadStoreOp(toks, blocks), None)
    wait_replies(worker, worker.retrieve_futures(request_id))
    spin_until(lambda: request_id in (worker.get_finished(set())[1] or set()), COPY_NAP_S)
    if request_id in worker.failed_retrieves:
        raise SystemExit(f"retrieve failed: {worker.failed_retrieves[request_id]}")
    return time.perf_counter() - start


def wait_replies(worker, futures) -> None:
    """Block on the socket (receiving on this thread) until these replies are in: no nap
    granularity in the figure, and no core taken from the server's copy threads."""
    for future in futures:
        worker.mq_client.wait(future, 60.0)


def drain(worker, request_ids: set[str]) -> None:
    left = set(request_ids)

    def settled() -> bool:
        stores, _ = worker.get_finished(left)
        left.difference_update(stores or set())
        return not left

    spin_until(settled, COPY_NAP_S)


def cross_tp(args, ctx, server_url, worker, scheduler, client, caches, raw, dst_blocks,
             nbytes) -> None:
    """A TP=1 retrieve of chunks stored by the two ranks of a TP=2 engine of the same model
    (each piece holds 4 of the 8 heads: two strided head-range copies per chunk) beside a TP=1
    retrieve of chunks the TP=1 worker stored itself, and the raw scatter floor; taking turns."""
    import torch

    from lmcache_core.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPWorkerAdapter,
        LoadStoreOp,
    )
    from lmcache_core.kv.share import allocate_shared_kv_caches
    from lmcache_core.protocol import messages as m

    blocks = list(range(args.chunks * PER_CHUNK))
    tp1 = list(caches.values())
    ranks, segments = [], []
    for rank in range(2):  # each rank's cache holds its head slice of the TP=1 worker's blocks
        rank_caches, segment = allocate_shared_kv_caches(
            LAYERS, [2, len(blocks), BLOCK, HEADS // 2, DIM], torch.bfloat16)
        for layer, full in zip(rank_caches.values(), tp1, strict=True):
            lo = rank * HEADS // 2
            layer.copy_(full[:, blocks, :, lo:lo + HEADS // 2])
        adapter = LMCacheMPWorkerAdapter(server_url, ctx, "bench", 2, rank, BLOCK)
        adapter.register_kv_caches(rank_caches)
        ranks.append(adapter)
        segments.append(segment)
    same_s, cross_s, scatter_s = [], [], []
    try:
        for r in range(args.rounds + 1):
            client.request(m.ClearRequest(force=True))
            same = [r * 11 + 3, *range(args.chunks * CHUNK - 1)]
            cross = [r * 11 + 5, *range(args.chunks * CHUNK - 1)]
            wait_store(worker, f"same{r}", LoadStoreOp(same, blocks))
            for rank, adapter in enumerate(ranks):
                wait_store(adapter, f"cross{r}-{rank}", LoadStoreOp(cross, blocks))
            worker.load_deadline_ms = 0  # one batched copy for both, as the floor
            for kind in (("same", "cross") if r % 2 else ("cross", "same")):
                toks = same if kind == "same" else cross
                sample = wait_retrieve(scheduler, worker, f"{kind}-x{r}", toks, dst_blocks)
                (same_s if kind == "same" else cross_s).append(sample)
                check_equal(caches, blocks, dst_blocks)  # both loads are byte-exact
            scatter_s.append(raw.scatter())
    finally:
        for adapter in ranks:
            adapter.shutdown()
        worker.load_deadline_ms = None
    same_gbs, cross_gbs, raw_scatter = (nbytes / statistics.median(samples[1:]) / 1e9
                                        for samples in (same_s, cross_s, scatter_s))
    print(f"\ncross-TP retrieve, {args.chunks} x 32 MiB chunks, TP=1 reader (median of "
          f"{args.rounds}):")
    report("  raw torch scatter (index_copy_)", raw_scatter, "GB/s")
    report("  retrieve of TP=1 chunks (same TP)", same_gbs, "GB/s", floor=raw_scatter,
           target=">= 0.9x")
    report("  retrieve of TP=2 pieces (cross TP)", cross_gbs, "GB/s", floor=raw_scatter)
    report("  cross TP vs same TP", cross_gbs, "GB/s", floor=same_gbs, target=">= 0.8x")


#: The hybrid row's model: layers per KV-cache group, the sliding window (tokens), and its groups
#: (Gemma-3's 5:1 sliding:full split into groups of equal layer counts, as vLLM does).
HYBRID_LAYERS, HYBRID_WINDOW = 8, 1024
HYBRID_KINDS = ("full", "sliding", "sliding")


def hybrid(args, ctx, server_url, client) -> None:
    """A Gemma-3-like hybrid engine (three KV-cache groups, one registration each): a store of
    every group's pieces of ``args.chunks`` chunks vs the raw gather of the same blocks, and a
    retrieve (full group: every chunk; the sliding groups: the window's last chunks) vs the raw
    scatter of the same bytes; byte-exact checked, taking turns."""
    import torch

    from lmcache_core.integration.vllm.vllm_multi_process_adapter import (
        KVCacheGroupSpec,
        LMCacheMPSchedulerAdapter,
        LMCacheMPWorkerAdapter,
        LoadStoreOp,
    )
    from lmcache_core.keys import group_piece
    from lmcache_core.kv.share import allocate_shared_kv_caches, release_shared_kv_caches
    from lmcache_core.protocol import messages as m

    n, count = args.chunks, len(HYBRID_KINDS)
    window = group_piece(CHUNK, BLOCK, "sliding", HYBRID_WINDOW).window_chunks
    loaded = min(n, window)  # chunks of each sliding group a retrieve loads
    caches, segment = allocate_shared_kv_caches(  # block 0 stays vLLM's null block, unused
        count * HYBRID_LAYERS, [2, 2 * n * PER_CHUNK + 1, BLOCK, HEADS, DIM], torch.bfloat16)
    for layer in caches.values():
        layer.uniform_()
    names = list(caches)
    specs = [KVCacheGroupSpec(names[g::count], kind, BLOCK,
                              HYBRID_WINDOW if kind == "sliding" else 0)
             for g, kind in enumerate(HYBRID_KINDS)]
    layers = [[caches[name] for name in spec.layer_names] for spec in specs]
    src = list(range(1, 1 + n * PER_CHUNK))
    dst = list(range(1 + n * PER_CHUNK, 1 + 2 * n * PER_CHUNK))
    tail = n * PER_CHUNK - loaded * PER_CHUNK  # the sliding groups' loaded blocks start here
    sliding_dst = [0] * tail + dst[tail:]
    worker = LMCacheMPWorkerAdapter(server_url, ctx, "bench-hybrid", 1, 0, BLOCK)
    scheduler = LMCacheMPSchedulerAdapter(server_url, ctx, "bench-hybrid", 1, 0, BLOCK)
    worker.register_kv_caches(caches, groups=specs)
    # the same layers as one single-group model: the same path without groups, beside it
    plain = LMCacheMPWorkerAdapter(server_url, ctx, "bench-plain", 1, 0, BLOCK)
    plain_scheduler = LMCacheMPSchedulerAdapter(server_url, ctx, "bench-plain", 1, 0, BLOCK)
    plain.register_kv_caches(caches)
    full_layers = layers[0]
    sliding_layers = [layer for group in layers[1:] for layer in group]
    gather = RawCopy([la for group in layers for la in group], src, n)
    scatter = (RawCopy(full_layers, dst, n), RawCopy(sliding_layers, dst[tail:], loaded))
    samples: dict[str, list[float]] = {k: [] for k in ("store", "retrieve", "gather",
                                                       "scatter", "plain_store", "plain_retrieve")}
    try:
        for r in range(args.rounds + 1):
            client.request(m.ClearRequest(force=True))
            toks = [r * 13 + 7, *range(n * CHUNK - 1)]
            samples["gather"].append(gather.gather())
            samples["store"].append(wait_store(worker, f"hs{r}", LoadStoreOp(
                toks, [], group_block_ids=[src] * count)))
            samples["plain_store"].append(wait_store(plain, f"ps{r}", LoadStoreOp(toks, src)))
            samples["scatter"].append(scatter[0].scatter() + scatter[1].scatter())
            op = LoadStoreOp(toks, [], group_block_ids=[dst] + [sliding_dst] * (count - 1))
            samples["retrieve"].append(wait_retrieve(scheduler, worker, f"hr{r}", toks, dst, op))
            for group_layers, loaded_from in ((full_layers, 0), (sliding_layers, tail)):
                check_equal(dict(enumerate(group_layers)), src[loaded_from:], dst[loaded_from:])
            samples["plain_retrieve"].append(
                wait_retrieve(plain_scheduler, plain, f"pr{r}", toks, dst))
    finally:
        for adapter in (worker, scheduler, plain, plain_scheduler):
            adapter.shutdown()
        release_shared_kv_caches(segment)
    hybrid_report(args, samples, n, loaded, window)


def hybrid_report(args, samples: dict[str, list[float]], n: int, loaded: int,
                  window: int) -> None:
    """The hybrid row's figures: GB/s of each (median of the rounds after the first)."""
    count = len(HYBRID_KINDS)
    piece = HYBRID_LAYERS * 2 * CHUNK * HEADS * DIM * 2
    stored, retrieved = count * n * piece, (n + (count - 1) * loaded) * piece
    nbytes = {"store": stored, "gather": stored, "plain_store": stored, "retrieve": retrieved,
              "scatter": retrieved, "plain_retrieve": stored}
    gbs = {k: nbytes[k] / statistics.median(v[1:]) / 1e9 for k, v in samples.items()}
    print(f"\nhybrid model (Gemma-3-like: {count} KV-cache groups x {HYBRID_LAYERS} layers, "
          f"{'/'.join(HYBRID_KINDS)}, window {HYBRID_WINDOW} = {window} chunks), {n} chunks: "
          f"store {stored / 2**20:.0f} MiB, retrieve {retrieved / 2**20:.0f} MiB (median of "
          f"{args.rounds}):")
    report("  raw torch gather of the same blocks", gbs["gather"], "GB/s")
    report("  lmcache hybrid store", gbs["store"], "GB/s", floor=gbs["gather"], target=">= 0.9x")
    report("  the same layers as one group: store", gbs["plain_store"], "GB/s")
    report("  hybrid store vs one group", gbs["store"], "GB/s", floor=gbs["plain_store"],
           target="~1.0x")
    report("  raw torch scatter of the same bytes", gbs["scatter"], "GB/s")
    report("  lmcache hybrid retrieve", gbs["retrieve"], "GB/s", floor=gbs["scatter"],
           target=">= 0.9x")
    report("  the same layers as one group: retrieve", gbs["plain_retrieve"], "GB/s")
    report("  hybrid retrieve vs one group", gbs["retrieve"], "GB/s",
           floor=gbs["plain_retrieve"], target="~1.0x")


class RawCopy:
    """The floor: a plain per-chunk, per-layer torch gather/scatter of the same blocks."""

    def __init__(self, layers, blocks: list[int], chunks: int) -> None:
        import torch

        # One fresh index tensor per chunk: index_copy_ with a row *view* of a larger index tensor
        # takes a slow path in torch 2.13 (~40x slower), which would flatter our ratio.
        self.index = [torch.tensor(blocks[c * PER_CHUNK:(c + 1) * PER_CHUNK]) for c in range(chunks)]
        self.bufs = [torch.empty(len(layers), 2, PER_CHUNK, BLOCK * HEADS * DIM,
                                 dtype=torch.bfloat16) for _ in range(chunks)]
        self.views = [layer.view(2, layer.shape[1], -1) for layer in layers]

    def gather(self) -> float:
        import torch

        start = time.perf_counter()
        for index, buf in zip(self.index, self.bufs, strict=True):
            for li, view in enumerate(self.views):
                torch.index_select(view, 1, index, out=buf[li])
        return time.perf_counter() - start

    def checksum(self) -> float:
        """xxh3-64 of each gathered chunk (what a store adds to its copy)."""
        from lmcache_core.storage.integrity import checksum

        start = time.perf_counter()
        for buf in self.bufs:
            checksum(buf.view(-1).view(__import__("torch").uint8))
        return time.perf_counter() - start

    def scatter(self) -> float:
        start = time.perf_counter()
        for index, buf in zip(self.index, self.bufs, strict=True):
            for li, view in enumerate(self.views):
                view.index_copy_(1, index, buf[li])
        return time.perf_counter() - start


def check_equal(caches, src: list[int], dst: list[int]) -> None:
    for layer in caches.values():
        if not (layer[:, src].view(-1).view(__import__("torch").int16) ==
                layer[:, dst].view(-1).view(__import__("torch").int16)).all():
            raise SystemExit("retrieved bytes differ from the stored ones")


def echo_once(ctx, url: str, frame_bytes: int):
    """One round trip of a lookup-sized frame through the bare ROUTER echo process."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    frames = [b"\x01", b"\xaalmc.lookup", os.urandom(frame_bytes)]

    def once() -> None:
        sock.send_multipart(frames)
        sock.recv_multipart()

    return once


def interleaved(floor, ours, n: int, batch: int = 100) -> tuple[float, float]:
    """p50s (us) of ``floor`` and ``ours``, taking turns in batches so load swings hit both."""
    floor_us, ours_us = interleaved_p50s([floor, ours], n, batch)
    return floor_us, ours_us


def interleaved_p50s(fns, n: int, batch: int = 100) -> list[float]:
    """p50s (us) of each of ``fns``, taking turns in batches so load swings hit them all."""
    for fn in fns:
        timed(fn, batch)  # warm-up
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(max(1, n // batch)):
        for fn, out in zip(fns, samples, strict=True):
            for _ in range(batch):
                start = time.perf_counter()
                fn()
                out.append(time.perf_counter() - start)
    return [statistics.median(out) * 1e6 for out in samples]




def report(label: str, value: float, unit: str, floor: float | None = None, target: str = "") -> None:
    ratio = f"  ratio {value / floor:.2f}x" if floor else ""
    print(f"{label:48s} {value:10.2f} {unit}{ratio}{'  (target ' + target + ')' if target else ''}")


if __name__ == "__main__":
    main()
