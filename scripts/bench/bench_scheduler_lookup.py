#!/usr/bin/env python3
"""The scheduler adapter's lookup beside a bare pyzmq echo of the same frame, measured in one run.

For hash mode (vLLM block hashes) and token mode (prompt token ids), 1k and 16k tokens, all hits:
- submit -> result: ``maybe_submit_lookup_request`` then ``check_lookup_result`` until it answers,
  p50, vs one DEALER->ROUTER echo round trip of the encoded LookupRequest's size. Two pollers:
  "wait" blocks on the socket between polls (the client's ``wait``: a scheduler that has other work
  sees the reply as soon as it is in), "spin" polls in a busy loop (on 2 cores the spinning thread
  takes a core from the zmq I/O threads and the server, so it is the pessimistic figure);
  "after end" is the "wait" lookup of a request that follows the previous one's ``end_session``
  (vLLM's order: one request ends, the next is looked up), beside the same echo;
- 64 lookups in flight: submit 64, poll them all until all answered (waiting between sweeps);
  lookups/s vs 64 echo frames sent, then 64 received;
- ``check_lookup_result`` on a pending lookup (the server stopped with SIGSTOP).
``--profile`` prints where the time of the hash-mode 1k-token submit -> result goes (cProfile).
``--cpu`` prints, for the echo, a lookup and a lookup after an end (hash mode, the first token
count), the CPU time and context switches per round trip of each process, all their threads
together (Linux: /proc/PID/task/*/schedstat): unlike wall time on a busy 2-core machine, barely
moved by others' load.

Usage: python scripts/bench/bench_scheduler_lookup.py [--iters 2000] [--profile] [--cpu]
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

from benchlib import ECHO  # noqa: E402  (beside this script)

CHUNK, BLOCK = 256, 16
INFLIGHT = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-bench-lookup-"))
    echo = subprocess.Popen([sys.executable, "-c", ECHO, f"ipc://{workdir}/echo.sock"],
                            stdout=subprocess.PIPE, text=True)
    assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
    config = {"model": {"name": "bench", "num_layers": 2, "num_kv_heads": 1, "head_dim": 8,
                        "dtype": "float16"},
              "world_size": 1, "chunk_size": CHUNK,
              "server": {"url": f"ipc://{workdir}/server.sock", "pool_size": "32MiB",
                         "http_url": "off"}}
    (workdir / "bench.yaml").write_text(yaml.safe_dump(config))
    server = subprocess.Popen([sys.executable, "-m", "lmcache_cli", "serve", "-c",
                               str(workdir / "bench.yaml")], stdout=(workdir / "log").open("wb"),
                              stderr=subprocess.STDOUT)
    try:
        run(args, f"ipc://{workdir}/server.sock", f"ipc://{workdir}/echo.sock",
            {"client": os.getpid(), "server": server.pid, "echo": echo.pid})
    finally:
        server.send_signal(signal.SIGCONT)
        server.send_signal(signal.SIGTERM)
        echo.kill()
        server.wait(30)


def run(args: argparse.Namespace, server_url: str, echo_url: str, pids: dict[str, int]) -> None:
    import msgspec
    import torch
    from blake3 import blake3

    from lmcache_core.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPSchedulerAdapter,
        LMCacheMPWorkerAdapter,
        LoadStoreOp,
    )
    from lmcache_core.keys import chain_hashes
    from lmcache_core.kv.share import allocate_shared_kv_caches
    from lmcache_core.protocol import messages as m

    ctx = zmq.Context.instance()
    max_blocks = max(args.tokens) // BLOCK
    caches, _segment = allocate_shared_kv_caches(2, [2, max_blocks, BLOCK, 1, 8], torch.float16)
    worker = wait_for(lambda: LMCacheMPWorkerAdapter(server_url, ctx, "bench", 1, 0, BLOCK))
    worker.register_kv_caches(caches)
    scheduler = LMCacheMPSchedulerAdapter(server_url, ctx, "bench", 1, 0, BLOCK)
    echo = ctx.socket(zmq.DEALER)
    echo.setsockopt(zmq.LINGER, 0)
    echo.connect(echo_url)
    print(f"load average {os.getloadavg()[0]:.2f} (1 min), p50 of {args.iters}; "
          f"echo = DEALER->ROUTER round trip of a frame of the lookup request's size\n")
    print(f"{'case':24s} {'echo us':>8s} {'wait us':>8s} {'ratio':>6s} {'spin us':>8s} {'ratio':>6s}"
          f" {'after end':>9s} {'ratio':>6s}   {'echo/s x64':>10s} {'lookups/s x64':>13s}"
          f" {'ratio':>6s}")
    for n_tokens in args.tokens:
        prompt = list(range(7, 7 + n_tokens))
        prev = b"seed"
        block_hashes = []
        for i in range(n_tokens // BLOCK):
            prev = blake3(prev + i.to_bytes(4, "big")).digest()
            block_hashes.append(prev)
        for mode, keys in (("hash", block_hashes), ("token", prompt)):
            wait_store(worker, f"store-{mode}-{n_tokens}",
                       LoadStoreOp(keys, list(range(n_tokens // BLOCK))))
            hashes = (chain_hashes(keys, CHUNK) if mode == "token"
                      else block_hashes[CHUNK // BLOCK - 1::CHUNK // BLOCK])
            frame = msgspec.msgpack.encode(m.LookupRequest(
                model_name="bench", world_size=1, lookup_id="adapter-0000", chunk_hashes=hashes,
                lock=True))
            frames = [b"\x01" * 8, b"\xaalmc.lookup", frame]
            assert lookup_once(scheduler, "check", keys) == n_tokens, "not all hits"

            def echo_once(frames=frames) -> None:
                echo.send_multipart(frames)
                echo.recv_multipart()

            def lookup(keys=keys) -> None:
                lookup_once(scheduler, "adapter", keys, wait=True)

            def lookup_spin(keys=keys) -> None:
                lookup_once(scheduler, "adapter", keys)

            def lookup_after_end(keys=keys) -> None:
                lookup_once(scheduler, "adapter", keys, wait=True, end=True)

            echo_us, lookup_us = interleaved(echo_once, lookup, args.iters)
            echo2_us, spin_us = interleaved(echo_once, lookup_spin, args.iters)
            echo3_us, after_end_us = interleaved(echo_once, lookup_after_end, args.iters)
            echo_rate, lookup_rate = (
                INFLIGHT / (statistics.median(samples) * 1e-6) for samples in interleaved_samples(
                    lambda frames=frames: echo_many(echo, frames),
                    lambda keys=keys: lookup_many(scheduler, keys), max(10, args.iters // 40)))
            if args.cpu and mode == "hash" and n_tokens == args.tokens[0]:
                cpu_rows = [(name, cpu_per_call(fn, args.iters, pids)) for name, fn in (
                    ("echo", echo_once), ("lookup", lookup), ("lookup after end", lookup_after_end))]
            print(f"{mode + ' mode, ' + str(n_tokens) + ' tokens':24s} {echo_us:8.1f} "
                  f"{lookup_us:8.1f} {lookup_us / echo_us:5.2f}x {spin_us:8.1f} "
                  f"{spin_us / echo2_us:5.2f}x {after_end_us:9.1f} {after_end_us / echo3_us:5.2f}x"
                  f"   {echo_rate:10.0f} "
                  f"{lookup_rate:13.0f} {lookup_rate / echo_rate:5.2f}x")
    print("targets: lookup <= 1.5x the echo; 64 in flight >= 0.5x the echo's rate")
    if args.cpu:
        print(f"\nCPU us and context switches per round trip, hash mode, {args.tokens[0]} tokens, "
              f"{args.iters} round trips (all threads of each process)")
        for name, per in cpu_rows:
            print(f"{name:18s} " + "  ".join(f"{proc} {cpu:6.1f} us {switches:4.2f} sw"
                                            for proc, (cpu, switches) in per.items()))

    pid = scheduler.mq_client.ping().pid
    os.kill(pid, signal.SIGSTOP)
    stopped_by = time.monotonic() + 5  # kill() returns before the process really is stopped
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        if time.monotonic() > stopped_by:
            raise SystemExit("the server did not stop")
        time.sleep(0.001)
    try:
        scheduler.maybe_submit_lookup_request("pending", block_hashes)
        pending = [timed_once(lambda: scheduler.check_lookup_result("pending")) for _ in range(20000)]
        assert scheduler.check_lookup_result("pending") is None, "the lookup was not pending"
    finally:
        os.kill(pid, signal.SIGCONT)
    print(f"\ncheck_lookup_result on a pending lookup: p50 {statistics.median(pending) * 1e6:.2f} us, "
          f"p99 {sorted(pending)[int(len(pending) * 0.99)] * 1e6:.2f} us (target <= 5 us)")
    scheduler.end_session("pending").result(10)
    if args.profile:
        import cProfile
        import pstats

        keys = block_hashes[:1024 // BLOCK]
        for label, fn, n in (("one at a time", lambda: lookup_once(scheduler, "adapter", keys),
                              args.iters),
                             (f"{INFLIGHT} in flight", lambda: lookup_many(scheduler, keys),
                              max(10, args.iters // INFLIGHT))):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(n):
                fn()
            profile.disable()
            print(f"\nprofile: hash mode, 1024 tokens, {label} ({n} rounds)")
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    worker.shutdown()
    scheduler.close()


def lookup_once(scheduler, request_id: str, keys, wait: bool = False, end: bool = False) -> int:
    """One lookup, polled to its answer; then forgotten, or with ``end`` its session ended (the
    release goes out now, so the next lookup follows it)."""
    scheduler.maybe_submit_lookup_request(request_id, keys)
    while (result := scheduler.check_lookup_result(request_id)) is None:
        if wait:  # block on the socket (receiving on this thread) until the reply is in
            scheduler.wait_lookup_result(request_id, 1.0)
    if end:
        scheduler.end_session(request_id)
    else:
        scheduler.cleanup_lookup_result(request_id)
    return result


def lookup_many(scheduler, keys) -> None:
    ids = [f"many-{i}" for i in range(INFLIGHT)]
    for request_id in ids:
        scheduler.maybe_submit_lookup_request(request_id, keys)
    left = ids
    while left:
        left = [request_id for request_id in left if scheduler.check_lookup_result(request_id) is None]
        if left:
            scheduler.wait_lookup_result(left[0], 1.0)
    for request_id in ids:
        scheduler.cleanup_lookup_result(request_id)


def schedstat(pid: int) -> tuple[int, int]:
    """CPU ns and context switches of all of ``pid``'s threads so far (exited ones are lost)."""
    cpu = switches = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        cpu, switches = cpu + int(fields[0]), switches + int(fields[2])
    return cpu, switches


def cpu_per_call(fn, n: int, pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    """Per call of ``fn`` (n calls after n/10 warm-up), each process's CPU us and switches."""
    for _ in range(max(1, n // 10)):
        fn()
    before = {name: schedstat(pid) for name, pid in pids.items()}
    for _ in range(n):
        fn()
    after = {name: schedstat(pid) for name, pid in pids.items()}
    return {name: ((after[name][0] - before[name][0]) / n / 1000,
                   (after[name][1] - before[name][1]) / n) for name in pids}


def echo_many(sock, frames) -> None:
    for _ in range(INFLIGHT):
        sock.send_multipart(frames)
    for _ in range(INFLIGHT):
        sock.recv_multipart()


def wait_store(worker, request_id: str, op) -> None:
    worker.submit_store_request(request_id, op, None)
    deadline = time.monotonic() + 30
    while request_id not in (worker.get_finished({request_id})[0] or set()):
        if time.monotonic() > deadline:
            raise SystemExit("store did not finish")
        time.sleep(0.001)
    if request_id in worker.failed_stores:
        raise SystemExit(f"store failed: {worker.failed_stores[request_id]}")


def wait_for(make):  # the server may still be starting
    deadline = time.monotonic() + 60
    while True:
        try:
            return make()
        except Exception:
            if time.monotonic() > deadline:
                raise


def timed_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_samples(floor, ours, n: int, batch: int = 20) -> tuple[list[float], list[float]]:
    """Samples (us) of ``floor`` and ``ours``, taking turns in batches so load swings hit both."""
    for fn in (floor, ours):  # warm-up
        for _ in range(max(1, batch // 2)):
            fn()
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(max(1, n // batch)):
        for fn, out in ((floor, samples[0]), (ours, samples[1])):
            out.extend(timed_once(fn) * 1e6 for _ in range(batch))
    return samples


def interleaved(floor, ours, n: int) -> tuple[float, float]:
    a, b = interleaved_samples(floor, ours, n, batch=100)
    return statistics.median(a), statistics.median(b)


if __name__ == "__main__":
    main()
