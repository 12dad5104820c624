"""``lmcache store-bench``: store, look up, retrieve and verify KV chunks against a live server.

The parent process never imports torch unless it must ask torch how many GPUs there are (only when
``--gpus`` is not given and the machine has NVIDIA device files). It checks the server and the
sizes, spawns one worker per GPU (or CPU worker) running :mod:`lmcache_cli.bench_worker`, shows a
progress bar from their reports, and renders a table per worker and in total
(``lmcache_cli.store_bench_report``). Worker ``i`` uses ``kv_rank = i`` and ``world_size = number
of workers``, with its share of the KV heads, like one tensor-parallel rank of vLLM.
"""

from __future__ import annotations

import contextlib
import glob
import json
import multiprocessing
import os
import queue as queue_mod
import secrets
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from lmcache_cli.bench_worker import SEGMENT_PREFIX, WorkerSpec, round_tokens, worker_main
from lmcache_cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    ConfigOption,
    JsonOption,
    UrlOption,
    config_from,
    connect,
    console,
    err_console,
    fail,
    human_bytes,
    print_json,
)
from lmcache_cli.store_bench_report import GB as GB
from lmcache_cli.store_bench_report import build_report, render
from lmcache_core.config import LMCacheConfig

# Bounds of the count options: beyond them a worker fails inside torch (a seed times 1009 must fit
# a 64-bit seed, a thread count a C long) or the machine drowns in processes.
MAX_CPU_WORKERS, MAX_THREADS, MAX_SEED = 256, 1024, 2**53

def _cuda_devices() -> int:
    """Visible CUDA devices; 0 without NVIDIA device files (then torch is not even imported)."""
    if not glob.glob("/dev/nvidia[0-9]*") or os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return 0
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def parse_devices(gpus: str | None, cpu_workers: int) -> tuple[list[int | None], str | None]:
    """The device of each worker (None = CPU) and a note to show; exits 2 on a bad ``--gpus``."""
    if gpus is None:
        count = _cuda_devices()
        if count == 0:
            return [None] * cpu_workers, "no CUDA device found: running on CPU (as --gpus cpu)"
        return list(range(count)), None
    text = gpus.strip().lower()
    if text == "cpu":
        return [None] * cpu_workers, None
    count = _cuda_devices()
    if text == "all":
        if count == 0:
            fail("--gpus all: no CUDA device is visible (use --gpus cpu)", EXIT_USAGE)
        return list(range(count)), None
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        fail(f"--gpus {gpus!r}: expected GPU indices like 0,1, or all, or cpu", EXIT_USAGE)
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        fail(f"--gpus {gpus!r}: each GPU index must be non-negative and listed once", EXIT_USAGE)
    missing = [i for i in ids if i >= count]
    if missing:
        fail(f"--gpus {gpus}: GPU {missing[0]} is not visible ({count} CUDA device(s); use --gpus cpu "
             "on a machine without CUDA)", EXIT_USAGE)
    return list(ids), None


def store_bench(
    gpus: Annotated[str | None, typer.Option(
        "--gpus", "-g", metavar="LIST",
        help="GPU indices (0,1), all, or cpu. One worker process per GPU. Default: all GPUs, or "
             "cpu on a machine without CUDA.", show_default=False)] = None,
    cpu_workers: Annotated[int, typer.Option(
        "--cpu-workers", min=1, max=MAX_CPU_WORKERS,
        help="Worker processes with --gpus cpu.")] = 1,
    chunks: Annotated[int, typer.Option("--chunks", "-n", min=1,
                                        help="Chunks each worker stores per round.")] = 16,
    rounds: Annotated[int, typer.Option("--rounds", "-r", min=1, help="Timed rounds.")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", min=0,
                                        help="Untimed rounds first (page faults, caches).")] = 1,
    batch: Annotated[int, typer.Option("--batch", min=1,
                                       help="Chunks per store/retrieve request.")] = 1,
    lookups: Annotated[int, typer.Option("--lookups", min=1,
                                         help="Lookups per round (the first one locks).")] = 10,
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, max=MAX_THREADS,
        help="Torch threads in each worker (default: torch's default).",
        show_default=False)] = None,
    block_size: Annotated[int, typer.Option("--block-size", min=1,
                                            help="vLLM block size (tokens per KV block).")] = 16,
    seed: Annotated[int | None, typer.Option(
        min=0, max=MAX_SEED,
        help="Seed of the token ids and data (default: random, so chunks are new to the server).",
        show_default=False)] = None,
    tokens_out: Annotated[Path | None, typer.Option(
        "--tokens-out", metavar="FILE",
        help='Write the stored prompts as {"prompts": [...], "model": ..., "world_size": ...} for '
             "lmcache lookup --tokens (which then looks them up under that model and world size).",
        show_default=False)] = None,
    config: ConfigOption = None,
    url: UrlOption = None,
    as_json: JsonOption = False,
) -> None:
    """Benchmark store and retrieve against a running server, verifying every byte.

    Each worker registers a KV cache shaped from the config (layers, KV heads / workers, head dim,
    dtype), stores --chunks chunks, looks them up, retrieves them into cleared blocks and compares
    them; it also times plain torch gather/scatter of the same blocks, the floor the server's copies
    are compared with. Exit 1 when any byte differs or a worker fails.

    Example: [cyan]lmcache store-bench -c configs/llama8b.yaml --gpus 0,1 --chunks 32[/]
    """
    cfg = config_from(config, {"server.url": url})
    devices, note = parse_devices(gpus, cpu_workers)
    if seed is None:
        seed = secrets.randbelow(2**31)
    with connect(cfg) as (client, ping):
        info = client.server_info()
    specs = _specs(cfg, devices, ping.chunk_size, block_size, chunks, rounds, warmup, batch,
                   lookups, seed, threads)
    _check_fits(specs, info)
    if tokens_out is not None:
        _write_tokens(tokens_out, specs[0], len(specs))
    if note and not as_json:  # once the checks passed, so a usage error stays one line
        err_console.print(note, highlight=False)
    if not as_json:
        console.print(_header(cfg, specs), highlight=False)
    started = time.perf_counter()
    results, errors = _run_workers(specs, show_progress=not as_json)
    report = build_report(cfg, specs, results, errors, time.perf_counter() - started)
    if as_json:
        print_json(report)
    else:
        render(report)
    if errors:
        for index, line in sorted(errors.items()):
            err_console.print(f"[bold red]error:[/] worker {index}: ", end="", highlight=False)
            err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    if not report["ok"]:
        raise typer.Exit(EXIT_FAILURE)


def _specs(cfg: LMCacheConfig, devices: list[int | None], chunk_size: int, block_size: int,
           chunks: int, rounds: int, warmup: int, batch: int, lookups: int,
           seed: int, threads: int | None = None) -> list[WorkerSpec]:
    if chunk_size % block_size:
        fail(f"--block-size {block_size} does not divide the server's chunk size {chunk_size}",
             EXIT_USAGE)
    world = len(devices)
    heads = max(1, cfg.model.num_kv_heads // world)
    return [WorkerSpec(
        index=i, gpu=gpu, url=cfg.server.url, model_name=cfg.model.name, world_size=world,
        kv_rank=i, num_layers=cfg.model.num_layers, num_kv_heads=heads,
        head_dim=cfg.model.head_dim, dtype=cfg.model.dtype, use_mla=cfg.model.use_mla,
        chunk_size=chunk_size, block_size=block_size, chunks=chunks, rounds=rounds,
        warmup=warmup, batch=min(batch, chunks), lookups=lookups, seed=seed,
        connect_timeout_s=cfg.timeouts.connect_s, request_timeout_s=cfg.timeouts.request_s,
        threads=threads) for i, gpu in enumerate(devices)]


def _check_fits(specs: list[WorkerSpec], info: Any) -> None:
    """Each worker stores one piece per chunk (its share of the heads): a piece must fit in the
    server's pool, and one round of every worker's pieces too (an estimate: the pool's byte
    budget over the piece size, before any unit's rounding)."""
    spec = specs[0]
    if spec.chunk_bytes > info.pool_bytes:
        fail(f"a chunk of this model is {spec.chunk_bytes} bytes per worker but the server at "
             f"{info.url} holds pieces of at most {info.pool_bytes} bytes (its pool size): split "
             f"the heads over more workers (--gpus, --cpu-workers) or raise its server.pool_size",
             EXIT_USAGE)
    need = spec.chunks * len(specs)
    capacity = info.pool_bytes // spec.chunk_bytes
    if need > capacity:
        fail(f"{len(specs)} worker(s) x {spec.chunks} chunks = {need} chunks of {spec.chunk_bytes} "
             f"bytes, but the server's pool ({info.pool_bytes} bytes) holds about {capacity}: "
             "lower --chunks", EXIT_USAGE)


def _write_tokens(path: Path, spec: WorkerSpec, world_size: int) -> None:
    """The stored prompts, and the model and world size their keys carry (the workers' count, not
    necessarily the config's): ``lmcache lookup --tokens`` uses both."""
    prompts = [round_tokens(spec.seed, r, spec.chunks * spec.chunk_size)
               for r in range(spec.warmup + spec.rounds)]
    data = {"prompts": prompts, "model": spec.model_name, "world_size": world_size}
    try:
        path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    except OSError as exc:
        fail(f"--tokens-out {path}: cannot write: {exc.strerror}", EXIT_USAGE)


def _header(cfg: LMCacheConfig, specs: list[WorkerSpec]) -> str:
    s = specs[0]
    where = "CPU (shared memory)" if s.gpu is None else "GPU " + ",".join(str(x.gpu) for x in specs)
    shape = (f"{s.num_layers} layers x {s.head_dim} dim (MLA)" if s.use_mla else
             f"{s.num_layers} layers x {s.num_kv_heads} KV heads x {s.head_dim} dim")
    world = f"world size {len(specs)} (one rank per worker"
    world += (f"; the config says {cfg.world_size})" if cfg.world_size != len(specs) else ")")
    return (f"[bold]store-bench[/] {cfg.server.url}: {len(specs)} worker(s) on {where}, {world}, "
            f"model {cfg.model.name} ({shape}, {s.dtype}), chunk {s.chunk_size} tokens = "
            f"{human_bytes(s.chunk_bytes)}, {s.chunks} chunks x {s.rounds} round(s) "
            f"(+{s.warmup} warm-up), {s.batch} chunk(s) per request, seed {s.seed}")


# ---------------------------------------------------------------------- running the workers


def _run_workers(specs: list[WorkerSpec], show_progress: bool
                 ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    barrier = ctx.Barrier(len(specs))
    procs = [ctx.Process(target=worker_main, args=(spec, events, barrier), daemon=True,
                         name=f"lmcache-bench-{spec.index}") for spec in specs]
    results: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    per_round = 4 * specs[0].chunks  # store, retrieve, raw gather, raw scatter
    total = per_round * (specs[0].warmup + specs[0].rounds)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("chunk copies"), TimeElapsedColumn(), console=err_console,
                        transient=True, disable=not show_progress)
    try:
        with progress:
            tasks = {s.index: progress.add_task(f"worker {s.index} ({s.device})", total=total)
                     for s in specs}
            for proc in procs:
                proc.start()
            while len(results) + len(errors) < len(specs):
                try:
                    kind, index, payload = events.get(timeout=0.25)
                except queue_mod.Empty:
                    _check_alive(procs, results, errors, barrier)
                    continue
                if kind == "progress":
                    progress.advance(tasks[index], payload)
                elif kind == "result":
                    results[index] = payload
                    progress.update(tasks[index], completed=total)
                else:
                    errors[index] = payload
                    barrier.abort()
        for proc in procs:
            proc.join(10)
    except KeyboardInterrupt:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(5)
        err_console.print("interrupted", highlight=False)
        raise typer.Exit(130) from None
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        _unlink_worker_segments(procs)
    return results, errors


def _unlink_worker_segments(procs: list[Any]) -> None:
    """Remove the shared-memory KV caches of workers that could not clean up (killed, crashed)."""
    for proc in procs:
        if proc.pid is None:
            continue
        for path in glob.glob(f"/dev/shm/{SEGMENT_PREFIX}-{proc.pid}-*"):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _check_alive(procs: list[Any], results: dict[int, Any], errors: dict[int, str],
                 barrier: Any) -> None:
    for index, proc in enumerate(procs):
        if index in results or index in errors or proc.is_alive() or proc.exitcode is None:
            continue
        time.sleep(0.2)  # let a last report that was on its way arrive first
        if index not in results and index not in errors:
            errors[index] = f"the worker process exited with code {proc.exitcode} without a result"
            barrier.abort()
