"""``lmcache store-bench``: store, look up, retrieve and verify KV chunks against a live server.

The parent process never imports torch unless it must ask torch how many GPUs there are (only when
``--gpus`` is not given and the machine has NVIDIA device files). It checks the server and the
sizes, spawns one worker per GPU (or CPU worker) running :mod:`lmcache_cli.bench_worker`, shows a
progress bar from their reports, and renders a table per worker and in total. Worker ``i`` uses
``kv_rank = i`` and ``world_size = number of workers``, with its share of the KV heads, like one
tensor-parallel rank of vLLM.
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
from lmcache_core.config import LMCacheConfig

GB = 1e9


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
        "--cpu-workers", min=1, help="Worker processes with --gpus cpu.")] = 1,
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
        "--threads", min=1, help="Torch threads in each worker (default: torch's default).",
        show_default=False)] = None,
    block_size: Annotated[int, typer.Option("--block-size", min=1,
                                            help="vLLM block size (tokens per KV block).")] = 16,
    seed: Annotated[int | None, typer.Option(
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
    from lmcache_core.protocol import messages as m
    from lmcache_core.protocol.ops import RequestType

    with connect(cfg) as (client, ping):
        info = client.call(RequestType.SERVER_INFO, m.NoArgs(), m.ServerInfoReply)
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
    report = _report(cfg, specs, results, errors, time.perf_counter() - started)
    if as_json:
        print_json(report)
    else:
        _render(report)
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
    """Each worker stores one piece per chunk (its share of the heads): a piece must fit in one of
    the server's slabs, and one round of every worker's pieces in its pool (an estimate: the
    pool's byte budget over the piece size, before any slab's rounding)."""
    spec = specs[0]
    if spec.chunk_bytes > info.slab_bytes:
        fail(f"a chunk of this model is {spec.chunk_bytes} bytes per worker but the server at "
             f"{info.url} holds pieces of at most {info.slab_bytes} bytes (its slab size): split "
             f"the heads over more workers (--gpus, --cpu-workers) or raise its server.slab_size",
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


# ---------------------------------------------------------------------- figures


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 3)


def _rate(nbytes: float, seconds: float) -> float | None:
    return round(nbytes / seconds / GB, 3) if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _phase_figures(phase: str, per_round: list[dict[str, list[float]]], nbytes_round: int
                   ) -> dict[str, Any]:
    """GB/s over the time spent in the phase's ops, and their p50/p99 latency."""
    ops = [t for rnd in per_round for t in rnd[phase]]
    return {"gbps": _rate(nbytes_round * len(per_round), sum(ops)),
            "p50_ms": _ms(_pct(ops, 0.5)), "p99_ms": _ms(_pct(ops, 0.99)), "ops": len(ops)}


def _report(cfg: LMCacheConfig, specs: list[WorkerSpec], results: dict[int, dict[str, Any]],
            errors: dict[int, str], wall_s: float) -> dict[str, Any]:
    s = specs[0]
    round_bytes = s.chunks * s.chunk_bytes
    workers = []
    for spec in specs:
        res = results.get(spec.index)
        if res is None:
            workers.append({"worker": spec.index, "device": spec.device, "kv_rank": spec.kv_rank,
                            "ok": False, "error": errors.get(spec.index, "no result")})
            continue
        workers.append(_worker_figures(spec, res, round_bytes))
    total = _total_figures(workers, results)
    ok = not errors and all(w["ok"] for w in workers)
    return {
        "ok": ok, "url": cfg.server.url, "model": cfg.model.name, "world_size": len(specs),
        "chunk_size": s.chunk_size, "chunk_bytes": s.chunk_bytes, "block_size": s.block_size,
        "chunks": s.chunks, "rounds": s.rounds, "warmup": s.warmup, "batch": s.batch,
        "seed": s.seed, "dtype": s.dtype, "wall_s": round(wall_s, 3),
        "workers": workers, "total": total,
    }


def _worker_figures(spec: WorkerSpec, res: dict[str, Any], round_bytes: int) -> dict[str, Any]:
    rounds = res["rounds"]
    fig = {name: _phase_figures(name, rounds, round_bytes)
           for name in ("store", "retrieve", "gather", "scatter")}
    lookup_ops = res["lookup_ops"]
    problems = list(res["problems"])
    if not res["lookup_hits_ok"]:
        problems.append(f"a lookup found only {res['lookup_hits_min']} of {spec.chunks} chunks")
    ok = res["mismatched_bytes"] == 0 and not problems
    return {
        "worker": spec.index, "device": spec.device, "kv_rank": spec.kv_rank, "ok": ok,
        "torch_threads": res["torch_threads"],
        "store_gbps": fig["store"]["gbps"], "store_p50_ms": fig["store"]["p50_ms"],
        "store_p99_ms": fig["store"]["p99_ms"],
        "retrieve_gbps": fig["retrieve"]["gbps"], "retrieve_p50_ms": fig["retrieve"]["p50_ms"],
        "retrieve_p99_ms": fig["retrieve"]["p99_ms"],
        "lookup_p50_ms": _ms(_pct(lookup_ops, 0.5)), "lookup_p99_ms": _ms(_pct(lookup_ops, 0.99)),
        "raw_gather_gbps": fig["gather"]["gbps"], "raw_scatter_gbps": fig["scatter"]["gbps"],
        "store_vs_raw": _ratio(fig["store"]["gbps"], fig["gather"]["gbps"]),
        "retrieve_vs_raw": _ratio(fig["retrieve"]["gbps"], fig["scatter"]["gbps"]),
        "verified_bytes": res["verified_bytes"], "mismatched_bytes": res["mismatched_bytes"],
        "already_present": res["already_present"], "problems": problems,
    }


def _total_figures(workers: list[dict[str, Any]], results: dict[int, dict[str, Any]]
                   ) -> dict[str, Any]:
    """All workers together: the sum of their rates (they run side by side), the latency
    percentiles over all their ops."""
    done = [w for w in workers if "store_gbps" in w]
    if not done:
        return {}

    def rate_sum(key: str) -> float | None:
        values = [w[key] for w in done]
        return None if None in values else round(sum(values), 3)

    def ops(phase: str) -> list[float]:
        return [t for w in done for rnd in results[w["worker"]]["rounds"] for t in rnd[phase]]

    out: dict[str, Any] = {"workers": len(done)}
    for phase, rate_key in (("store", "store_gbps"), ("retrieve", "retrieve_gbps"),
                            ("gather", "raw_gather_gbps"), ("scatter", "raw_scatter_gbps")):
        out[rate_key] = rate_sum(rate_key)
        if phase in ("store", "retrieve"):
            out[f"{phase}_p50_ms"] = _ms(_pct(ops(phase), 0.5))
            out[f"{phase}_p99_ms"] = _ms(_pct(ops(phase), 0.99))
    lookups = [t for w in done for t in results[w["worker"]]["lookup_ops"]]
    out.update(
        lookup_p50_ms=_ms(_pct(lookups, 0.5)), lookup_p99_ms=_ms(_pct(lookups, 0.99)),
        store_vs_raw=_ratio(out["store_gbps"], out["raw_gather_gbps"]),
        retrieve_vs_raw=_ratio(out["retrieve_gbps"], out["raw_scatter_gbps"]),
        verified_bytes=sum(w["verified_bytes"] for w in done),
        mismatched_bytes=sum(w["mismatched_bytes"] for w in done))
    return out


# ---------------------------------------------------------------------- rendering


def _render(report: dict[str, Any]) -> None:
    from rich.table import Table

    workers = report["workers"]
    total = report["total"]
    columns = [(f"worker {w['worker']} ({w['device']})", w) for w in workers]
    if len(workers) > 1 and total:
        columns.append(("total", total))
    table = Table(title=f"{report['chunks']} chunks x {report['rounds']} round(s) per worker; "
                        "GB/s = 1e9 bytes per second spent in the ops"
                        + ("; total = sum of workers" if len(columns) > len(workers) else ""),
                  title_justify="left")
    table.add_column("")
    for name, _ in columns:
        table.add_column(name, justify="right")

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    def pair(d: dict[str, Any], a: str, b: str) -> str:
        return f"{num(d.get(a), '.2f')} / {num(d.get(b), '.2f')}"

    rows: list[tuple[str, Any]] = [
        ("store GB/s", lambda d: num(d.get("store_gbps"), ".2f")),
        ("  p50 / p99 ms per op", lambda d: pair(d, "store_p50_ms", "store_p99_ms")),
        ("  raw gather GB/s", lambda d: num(d.get("raw_gather_gbps"), ".2f")),
        ("  store / raw", lambda d: num(d.get("store_vs_raw"), ".2f")),
        ("retrieve GB/s", lambda d: num(d.get("retrieve_gbps"), ".2f")),
        ("  p50 / p99 ms per op", lambda d: pair(d, "retrieve_p50_ms", "retrieve_p99_ms")),
        ("  raw scatter GB/s", lambda d: num(d.get("raw_scatter_gbps"), ".2f")),
        ("  retrieve / raw", lambda d: num(d.get("retrieve_vs_raw"), ".2f")),
        ("lookup p50 / p99 ms", lambda d: pair(d, "lookup_p50_ms", "lookup_p99_ms")),
        ("verified", _verified_cell),
    ]
    for label, cell in rows:
        table.add_row(label, *[cell(d) for _, d in columns])
    console.print(table)
    threads = sorted({w["torch_threads"] for w in workers if "torch_threads" in w})
    verdict = "[green]ok[/]: every byte matched" if report["ok"] else "[red]FAILED[/]"
    console.print(f"{verdict} · wall {report['wall_s']:.1f}s · worker torch threads "
                  f"{','.join(map(str, threads)) or '-'} · seed {report['seed']}", highlight=False)
    for w in workers:
        for problem in w.get("problems", []):
            err_console.print(f"worker {w['worker']}: {problem}", markup=False, highlight=False)
        if w.get("already_present"):
            err_console.print(f"worker {w['worker']}: {w['already_present']} chunk(s) were already "
                              "on the server (store timed without copying); use a new --seed",
                              markup=False, highlight=False)


def _verified_cell(d: dict[str, Any]) -> str:
    if "error" in d:
        return "[red]error[/]"
    if "verified_bytes" not in d:
        return "-"
    bad = d["mismatched_bytes"]
    size = human_bytes(d["verified_bytes"])
    ok = bad == 0 and d.get("ok", True)
    return f"[green]{size}[/]" if ok else f"[red]{bad} B differ[/]" if bad else "[red]problems[/]"

