"""The device check of issue 16: one command, a few minutes on a lent GPU, one summary line.

Run it as ``scripts/gpu-check`` (the wrapper picks the Python). Steps, each bounded; a failed step
is reported and the others still run:

1. ``pytest -m gpu tests/gpu`` (each test has a timeout);
2. a real ``lmcache serve`` (Llama-8B shape, 256-token chunks) and a GPU worker registered through
   the adapter (``tests/gpu/gpu_worker.py``): store/retrieve with events, byte-exact; then
   ``kill -9`` of the worker and the seconds until ``torch.cuda.mem_get_info`` shows its KV memory
   free again (finding 3);
3. ``lmcache store-bench --gpus 0`` against that server, beside pinned ``copy_`` of the same bytes
   measured here (device->host and host->device);
4. a large pinned pool (``--pool-gib``): seconds to allocate it and its pinned bytes (finding 4);
5. LMCache 0.5.6's own worker adapter registering a GPU KV cache against ``lmcache serve`` (its
   ``cuda`` descriptors), store and retrieve byte-exact (``tests/lmcache/test_lmcache_client_gpu.py``,
   issue 24), when the ``lmcache`` package is installed (reported skipped otherwise).

The last line printed starts ``gpu-check:``; ``--json FILE`` also writes every figure. Exit 0 when
every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
MODEL: dict[str, Any] = {"name": "gpu-check-llama8b", "num_layers": 32, "num_kv_heads": 8,
                         "head_dim": 128, "dtype": "bfloat16"}
CHUNK = 256


def main() -> int:
    args = _parse()
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible (torch.cuda.is_available() is False); nothing run")
        return 2
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("pytest", lambda: _pytest(args.pytest_timeout)),
        ("server", lambda: _with_server(args)),
        ("pool", lambda: _pool(args.pool_gib)),
        ("lmcache_client", lambda: _lmcache_client(args.pytest_timeout)),
    ]
    for name, step in steps:
        started = time.monotonic()
        try:
            report[name] = step()
        except Exception as exc:  # a failed step is a figure too; the others still run
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        report[name]["seconds"] = round(time.monotonic() - started, 1)
        print(f"== {name}: {json.dumps(report[name])}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    ok = all(report[name].get("ok") for name, _ in steps)
    print(_summary(report, ok))
    return 0 if ok else 1


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-gib", type=float, default=24.0,
                        help="pinned pool to time (torch's pin_memory would pin 32 GiB)")
    parser.add_argument("--kv-gib", type=float, default=4.0, help="the worker's KV cache")
    parser.add_argument("--server-pool-gib", type=float, default=4.0)
    parser.add_argument("--chunks", type=int, default=16, help="chunks per store-bench round")
    parser.add_argument("--pytest-timeout", type=float, default=240.0)
    parser.add_argument("--json", metavar="FILE", help="also write every figure here")
    return parser.parse_args()


def _run(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout_s)


# ---------------------------------------------------------------- 1. pytest -m gpu


def _pytest(timeout_s: float) -> dict[str, Any]:
    out = _run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs",
                "-p", "no:cacheprovider", "-s"], timeout_s)
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]
    notes = [line for line in out.stdout.splitlines() if line.startswith("expandable_segments")]
    if out.returncode != 0:
        print(out.stdout[-6000:], out.stderr[-2000:], sep="\n")
    return {"ok": out.returncode == 0, "result": tail, "notes": notes}


# ---------------------------------------------------------------- 5. LMCache's own client


def _lmcache_client(timeout_s: float) -> dict[str, Any]:
    """LMCache's worker adapter with a GPU KV cache against a real server (its pytest file)."""
    import importlib.util

    if importlib.util.find_spec("lmcache") is None:
        return {"ok": True, "skipped": "the lmcache package is not installed here"}
    env = {**os.environ, "LMCACHE_MP_TRANSFER_MODE": "lmcache_driven",
           "LMCACHE_TRACK_USAGE": "false"}
    out = subprocess.run([sys.executable, "-m", "pytest", "tests/lmcache/test_lmcache_client_gpu.py",
                          "-q", "-rs", "-p", "no:cacheprovider"], capture_output=True, text=True,
                         cwd=ROOT, timeout=timeout_s, env=env)
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]
    if out.returncode != 0:
        print(out.stdout[-6000:], out.stderr[-2000:], sep="\n")
    return {"ok": out.returncode == 0 and "passed" in tail, "result": tail}


# ---------------------------------------------------------------- 2-3. a real server


def _with_server(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lmcache-gpu-check-") as tmp:
        config = Path(tmp) / "config.yaml"
        url = f"tcp://127.0.0.1:{_free_port()}"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "model": MODEL, "world_size": 1, "chunk_size": CHUNK,
            "server": {"url": url, "pool_size": f"{args.server_pool_gib}GiB", "workers": 2,
                       "http_url": "http://127.0.0.1:0"},
            "timeouts": {"connect_s": 5, "request_s": 30, "lookup_ms": 2000, "lock_ttl_s": 60},
        }))
        log = (Path(tmp) / "serve.log").open("w")
        server = subprocess.Popen([sys.executable, "-m", "lmcache_cli", "serve", "-c", str(config)],
                                  cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready_s = _wait_ready(config, server)
            out: dict[str, Any] = {"server_ready_s": ready_s}
            out["worker"] = _worker_and_kill(url, args.kv_gib)
            out["store_bench"] = _store_bench(config, args.chunks)
            out["ok"] = bool(out["worker"].get("ok") and out["store_bench"].get("ok"))
            return out
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
            tail = (Path(tmp) / "serve.log").read_text()[-3000:]
            if server.returncode not in (0, -signal.SIGTERM):
                print(f"lmcache serve exited {server.returncode}:\n{tail}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(config: Path, server: subprocess.Popen[bytes], timeout_s: float = 120) -> float:
    """Seconds until ``lmcache ping`` answers (the pool is pinned by then)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"lmcache serve exited with {server.returncode}")
        if _run([sys.executable, "-m", "lmcache_cli", "ping", "-c", str(config), "--json"],
                30).returncode == 0:
            return round(time.monotonic() - started, 2)
        time.sleep(0.5)
    raise TimeoutError(f"lmcache serve did not answer within {timeout_s:g}s")


def _worker_and_kill(url: str, kv_gib: float) -> dict[str, Any]:
    """Register a GPU worker, round-trip with events, kill -9 it, time until its memory is free."""
    import torch

    free_before, _ = torch.cuda.mem_get_info(0)
    worker = subprocess.Popen(
        [sys.executable, "tests/gpu/gpu_worker.py", url, MODEL["name"], str(MODEL["num_layers"]),
         str(MODEL["num_kv_heads"]), str(MODEL["head_dim"]), "16", str(kv_gib), "8"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        line = _readline(worker, 180)
        result: dict[str, Any] = json.loads(line)
        free_held, _ = torch.cuda.mem_get_info(0)
        result["held_gib"] = round((free_before - free_held) / GIB, 2)
    finally:
        worker.kill()  # SIGKILL: the worker cannot unregister
        killed = time.monotonic()
        worker.wait(30)
    slack = max(256 << 20, result.get("kv_bytes", 0) // 20)
    freed_s = _wait_free(free_before - slack, killed, 90.0)
    result["freed_after_kill_s"] = freed_s
    result["ok"] = bool(result.get("ok")) and freed_s is not None
    return result


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    import selectors

    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise TimeoutError(f"the GPU worker printed nothing within {timeout_s:g}s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the GPU worker died: {proc.stderr.read()[-3000:]}")
    return line


def _wait_free(target: int, since: float, timeout_s: float) -> float | None:
    """Seconds from ``since`` until the GPU's free memory is back to ``target`` (None: never)."""
    import torch

    while time.monotonic() - since < timeout_s:
        if torch.cuda.mem_get_info(0)[0] >= target:
            return round(time.monotonic() - since, 2)
        time.sleep(0.1)
    return None


def _store_bench(config: Path, chunks: int) -> dict[str, Any]:
    out = _run([sys.executable, "-m", "lmcache_cli", "store-bench", "-c", str(config), "--gpus",
                "0", "--chunks", str(chunks), "--rounds", "3", "--json"], 300)
    if out.returncode != 0 and not out.stdout.strip().startswith("{"):
        return {"ok": False, "error": (out.stderr or out.stdout)[-2000:]}
    total = json.loads(out.stdout).get("total", {})
    floor = _pinned_copy_gbps(chunks * _chunk_bytes())
    keys = ("store_gbps", "retrieve_gbps", "raw_gather_gbps", "raw_scatter_gbps", "store_vs_raw",
            "retrieve_vs_raw", "store_p50_ms", "retrieve_p50_ms", "mismatched_bytes")
    result: dict[str, Any] = {k: total.get(k) for k in keys}
    result.update(floor)
    result["store_vs_pinned_d2h"] = _ratio(total.get("store_gbps"), floor["pinned_d2h_gbps"])
    result["retrieve_vs_pinned_h2d"] = _ratio(total.get("retrieve_gbps"),
                                              floor["pinned_h2d_gbps"])
    result["ok"] = out.returncode == 0 and total.get("mismatched_bytes") == 0
    return result


def _chunk_bytes() -> int:
    return int(2 * MODEL["num_layers"] * CHUNK * MODEL["num_kv_heads"] * MODEL["head_dim"] * 2)


def _pinned_copy_gbps(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Plain ``copy_`` between a device tensor and pinned host memory: the floor of the copies."""
    import torch

    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    out = {}
    for name, dst, src in (("pinned_d2h_gbps", host, device), ("pinned_h2d_gbps", device, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = round(nbytes * repeats / (time.perf_counter() - started) / 1e9, 2)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# ---------------------------------------------------------------- 4. a large pinned pool


def _pool(gib: float) -> dict[str, Any]:
    from lmcache_core.storage.pool import MemoryPool

    started = time.monotonic()
    pool = MemoryPool(int(gib * GIB), pin=True)
    seconds = time.monotonic() - started
    pinned = pool.pinned_bytes
    power_of_two = 1 << (pool.nbytes - 1).bit_length()  # what torch's pin_memory would pin
    ok = pool.pinned and pinned == pool.nbytes and pool.tensor.is_pinned()
    slabs, slab_bytes = pool.num_slabs, pool.slab_bytes
    del pool
    return {"ok": ok, "pool_gib": round(gib, 2), "pin_s": round(seconds, 2),
            "pinned_gib": round(pinned / GIB, 2), "slabs": slabs,
            "slab_mib": round(slab_bytes / (1 << 20), 2),
            "torch_pin_memory_would_pin_gib": round(power_of_two / GIB, 2)}


# ---------------------------------------------------------------- summary


def _summary(report: dict[str, Any], ok: bool) -> str:
    parts = [f"gpu-check: {'OK' if ok else 'FAILED'} on {report['device']} (torch {report['torch']})"]
    parts.append(f"pytest {report['pytest'].get('result', report['pytest'].get('error'))}")
    server = report["server"]
    worker = server.get("worker", {})
    if worker:
        parts.append(f"e2e byte-exact {worker.get('byte_exact')}, worker memory "
                     f"({worker.get('held_gib')} GiB) free {worker.get('freed_after_kill_s')} s "
                     "after kill -9")
    bench = server.get("store_bench", {})
    if bench.get("store_gbps") is not None:
        parts.append(f"store {bench['store_gbps']} GB/s ({bench.get('store_vs_pinned_d2h')}x pinned"
                     f" copy_), retrieve {bench['retrieve_gbps']} GB/s "
                     f"({bench.get('retrieve_vs_pinned_h2d')}x)")
    elif server.get("error") or bench.get("error"):
        parts.append(f"server: {server.get('error') or bench.get('error')}"[:300])
    pool = report["pool"]
    if "pin_s" in pool:
        parts.append(f"pool {pool['pool_gib']} GiB pinned {pool['pinned_gib']} GiB in "
                     f"{pool['pin_s']} s (torch would pin {pool['torch_pin_memory_would_pin_gib']})")
    lmc = report["lmcache_client"]
    parts.append(f"LMCache's GPU client {lmc.get('result') or lmc.get('skipped') or lmc.get('error')}")
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
