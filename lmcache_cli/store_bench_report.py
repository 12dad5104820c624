"""``lmcache store-bench``'s report: the figures (GB/s, latency percentiles, totals) computed from
the workers' results, and the table that shows them. ``lmcache_cli.store_bench`` runs the workers
and hands their results here.
"""

from __future__ import annotations

from typing import Any

from lmcache_cli.bench_worker import WorkerSpec
from lmcache_cli.common import console, err_console, human_bytes, percentile
from lmcache_core.config import LMCacheConfig

GB = 1e9


# ---------------------------------------------------------------------- figures


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
            "p50_ms": _ms(percentile(ops, 0.5)), "p99_ms": _ms(percentile(ops, 0.99)), "ops": len(ops)}


def build_report(cfg: LMCacheConfig, specs: list[WorkerSpec], results: dict[int, dict[str, Any]],
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
        "lookup_p50_ms": _ms(percentile(lookup_ops, 0.5)), "lookup_p99_ms": _ms(percentile(lookup_ops, 0.99)),
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
            out[f"{phase}_p50_ms"] = _ms(percentile(ops(phase), 0.5))
            out[f"{phase}_p99_ms"] = _ms(percentile(ops(phase), 0.99))
    lookups = [t for w in done for t in results[w["worker"]]["lookup_ops"]]
    out.update(
        lookup_p50_ms=_ms(percentile(lookups, 0.5)), lookup_p99_ms=_ms(percentile(lookups, 0.99)),
        store_vs_raw=_ratio(out["store_gbps"], out["raw_gather_gbps"]),
        retrieve_vs_raw=_ratio(out["retrieve_gbps"], out["raw_scatter_gbps"]),
        verified_bytes=sum(w["verified_bytes"] for w in done),
        mismatched_bytes=sum(w["mismatched_bytes"] for w in done))
    return out


# ---------------------------------------------------------------------- rendering


def render(report: dict[str, Any]) -> None:
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

