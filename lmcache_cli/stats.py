"""``lmcache stats``: a live view of a server (rates, hit ratio, pool, tiers, workers) until Ctrl-C.

One SERVER_INFO request per refresh; rates are the differences of two successive replies' counters
over the server's own uptime between them. ``--json`` prints snapshots as JSON lines instead. Never
imports torch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from lmcache_cli.common import (
    ConfigOption,
    UrlOption,
    config_from,
    connect,
    console,
    human_age,
    human_bytes,
    print_json,
    tenant_table,
)
from lmcache_core.config_parse import MAX_TIMEOUT_S

if TYPE_CHECKING:
    from rich.console import RenderableType

    from lmcache_core.protocol.messages import ServerInfoReply

#: (rate name, counter by its flat name: ``stats.flat_all``) of every per-second rate shown and printed.
RATES = (
    ("requests", "requests"), ("errors", "errors"), ("lookups", "lookups"),
    ("lookup_hit_chunks", "lookup_hit_chunks"), ("lookup_miss_chunks", "lookup_miss_chunks"),
    ("stores", "stores"), ("stored_chunks", "stored_chunks"), ("stored_bytes", "stored_bytes"),
    ("retrieves", "retrieves"), ("retrieved_chunks", "retrieved_chunks"),
    ("retrieved_bytes", "retrieved_bytes"), ("evictions", "evictions"),
    ("disk_read_chunks", "disk_loaded_chunks"), ("disk_written_chunks", "disk_written_chunks"),
    ("remote_read_chunks", "remote_loaded_chunks"),
    ("remote_written_chunks", "remote_written_chunks"),
)


def stats(
    config: ConfigOption = None,
    url: UrlOption = None,
    interval: Annotated[float, typer.Option(
        "--interval", "-i", min=0.05, max=MAX_TIMEOUT_S,  # it is the request timeout too
        help="Seconds between refreshes.")] = 1.0,
    count: Annotated[int | None, typer.Option(
        "--count", "-n", min=1, help="Stop after N refreshes (default: until Ctrl-C; 1 with --json).",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print a snapshot as one JSON line and exit (with --count N: N lines, "
        "rates from the second on).")] = False,
) -> None:
    """Watch a server live: requests/s, lookups/s, hit ratio, store and retrieve GB/s, pool,
    tiers and workers, refreshed every second until Ctrl-C.

    Example: [cyan]lmcache stats -c configs/llama8b.yaml --interval 2[/]
    """
    cfg = config_from(config, {"server.url": url})

    refreshes = count if count is not None else (1 if as_json else None)
    timeout_s = max(cfg.timeouts.connect_s, interval)
    with connect(cfg) as (client, _ping):
        def sample() -> ServerInfoReply:
            return client.server_info(timeout_s)

        if as_json:
            _print_lines(sample, interval, refreshes)
        else:
            _watch(sample, interval, refreshes)


def _samples(sample: Any, interval: float, refreshes: int | None) -> Any:
    """``(previous or None, current)`` reply pairs, one per ``interval``, ``refreshes`` of them."""
    previous = None
    done = 0
    next_at = time.monotonic()
    while refreshes is None or done < refreshes:
        if done:
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))  # the refresh period, not a poll
        current = sample()
        yield previous, current
        previous = current
        done += 1


def _print_lines(sample: Any, interval: float, refreshes: int | None) -> None:
    for previous, current in _samples(sample, interval, refreshes):
        print_json(snapshot(current, previous))


def _watch(sample: Any, interval: float, refreshes: int | None) -> None:
    from rich.live import Live

    with Live(console=console, auto_refresh=False) as live:
        try:
            for previous, current in _samples(sample, interval, refreshes):
                live.update(render(snapshot(current, previous)), refresh=True)
        except KeyboardInterrupt:
            pass  # Ctrl-C: leave the last view on screen, exit 0


def snapshot(info: ServerInfoReply, previous: ServerInfoReply | None = None) -> dict[str, Any]:
    """Everything the view shows, as plain data: counters, derived ratios, and (given the reply
    before) per-second rates over the server's uptime between the two."""
    from lmcache_core.stats import flat_all

    s, e = info.stats, info.stats.engine
    looked_up = e.lookup_hit_chunks + e.lookup_miss_chunks
    out: dict[str, Any] = {
        "url": info.url, "version": info.version, "pid": info.pid, "uptime_s": round(info.uptime_s, 3),
        "http_url": info.http_url, "chunk_size": info.chunk_size,
        "hit_ratio": round(e.lookup_hit_chunks / looked_up, 4) if looked_up else None,
        "pool": {"bytes": info.pool_bytes, "used_bytes": e.bytes_used,
                 "allocated_bytes": e.pool_bytes_allocated, "slab_bytes": info.slab_bytes,
                 "slabs": e.pool_slabs, "free_slabs": e.pool_slabs_free, "pieces": e.chunks,
                 "lookup_locks": e.locks_held,
                 "use": round(e.pool_bytes_allocated / info.pool_bytes, 4) if info.pool_bytes else 0.0},
        "models": [{"model": row.model_name, "pieces": row.pieces, "bytes_used": row.bytes_used,
                    "layouts": list(row.layouts), "quota_bytes": row.quota_bytes,
                    "registered": row.registered} for row in info.models],
        "tenants": [{"tenant": row.tenant, "name": row.name, "pieces": row.pieces,
                     "bytes_used": row.bytes_used, "quota_bytes": row.quota_bytes}
                    for row in info.tenants],
        "pins": {"pieces": e.pinned_pieces, "bytes": e.pinned_bytes,
                 "refused": e.store_pin_refused},
        "integrity": {"failures": e.integrity_failures,
                      "verified_chunks": e.integrity_verified_chunks},
        "workers": {"registered": s.workers.registered_instances,
                    "reaped": s.workers.reaped_instances},
        "tiers": {},
        "counters": flat_all(s),  # every figure of every section, by its flat name
        "interval_s": None, "rates": None, "interval_hit_ratio": None,
    }
    if s.disk is not None:
        d = s.disk
        out["tiers"]["disk"] = {"chunks": d.chunks, "bytes": d.bytes, "queued": d.queued,
                                "dropped_writes": d.write_dropped, "corrupt": d.corrupt,
                                "errors": d.errors}
    if s.remote is not None:
        r = s.remote
        out["tiers"]["remote"] = {"up": bool(r.up), "queued": r.queued,
                                  "dropped_writes": r.write_dropped,
                                  "failed_writes": r.write_failed, "errors": r.errors,
                                  "outages": r.outages}
    elapsed = info.uptime_s - previous.uptime_s if previous is not None else 0.0
    if previous is not None and previous.pid == info.pid and elapsed > 0:
        old, new = flat_all(previous.stats), out["counters"]
        out["interval_s"] = round(elapsed, 3)
        out["rates"] = {f"{name}_per_s": round(max(0, new[field] - old[field]) / elapsed, 3)
                        for name, field in RATES}
        hits = new["lookup_hit_chunks"] - old["lookup_hit_chunks"]
        asked = hits + new["lookup_miss_chunks"] - old["lookup_miss_chunks"]
        out["interval_hit_ratio"] = round(hits / asked, 4) if asked > 0 else None
    return out


def render(snap: dict[str, Any]) -> RenderableType:
    """The live view of one snapshot."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    head = (f"lmcache stats {snap['url']} · version {snap['version']} · pid {snap['pid']} · "
            f"up {human_age(snap['uptime_s'])}")
    rates: dict[str, float] = snap["rates"] or {}
    c = snap["counters"]

    def per_s(name: str, scale: float = 1.0, unit: str = "/s", digits: int = 1) -> str:
        value = rates.get(f"{name}_per_s")
        return "-" if value is None else f"{value / scale:,.{digits}f}{unit}"

    traffic = Table()
    for name, justify in (("", "left"), ("now", "right"), ("since start", "right")):
        traffic.add_column(name, justify=justify)  # type: ignore[arg-type]
    traffic.add_row("requests", per_s("requests"), f"{c['requests']:,}")
    traffic.add_row("errors", per_s("errors"), f"{c['errors']:,}",
                    style="red" if rates.get("errors_per_s") else "")
    traffic.add_row("lookups", per_s("lookups"), f"{c['lookups']:,}")
    traffic.add_row("  hit chunks", per_s("lookup_hit_chunks"),
                    f"{c['lookup_hit_chunks']:,} of {c['lookup_hit_chunks'] + c['lookup_miss_chunks']:,}")
    traffic.add_row("  hit ratio", _percent(snap["interval_hit_ratio"]), _percent(snap["hit_ratio"]))
    traffic.add_row("stores", per_s("stores"), f"{c['stores']:,}")
    traffic.add_row("  stored",
                    f"{per_s('stored_bytes', 1e9, ' GB/s', 2)}, {per_s('stored_chunks', unit=' chunks/s')}",
                    f"{human_bytes(c['stored_bytes'])}, {c['stored_chunks']:,} chunks")
    traffic.add_row("retrieves", per_s("retrieves"), f"{c['retrieves']:,}")
    traffic.add_row("  retrieved",
                    f"{per_s('retrieved_bytes', 1e9, ' GB/s', 2)}, "
                    f"{per_s('retrieved_chunks', unit=' chunks/s')}",
                    f"{human_bytes(c['retrieved_bytes'])}, {c['retrieved_chunks']:,} chunks")
    traffic.add_row("evictions", per_s("evictions"), f"{c['evictions']:,}")

    state = Table.grid(padding=(0, 2))
    state.add_column(style="bold")
    state.add_column()
    pool = snap["pool"]
    state.add_row("pool", f"{human_bytes(pool['allocated_bytes'])} of {human_bytes(pool['bytes'])} "
                  f"allocated ({100 * pool['use']:.1f}%), {human_bytes(pool['used_bytes'])} in "
                  f"{pool['pieces']:,} pieces, {pool['free_slabs']:,}/{pool['slabs']:,} slabs of "
                  f"{human_bytes(pool['slab_bytes'])} free, {pool['lookup_locks']:,} lookup locks")
    workers = snap["workers"]
    state.add_row("workers", f"{workers['registered']} registered, {workers['reaped']} reaped")
    pins = snap["pins"]
    state.add_row("pins", f"{pins['pieces']:,} pieces pinned ({human_bytes(pins['bytes'])}), "
                  f"{pins['refused']:,} pin(s) refused (server.max_pinned)")
    integrity = snap["integrity"]
    state.add_row("integrity", f"{integrity['failures']:,} corrupt piece(s) dropped, "
                  f"{integrity['verified_chunks']:,} checked intact",
                  style="bold red" if integrity["failures"] else "")
    if c["store_skipped_quota"]:
        state.add_row("quotas", f"{c['store_skipped_quota']:,} piece(s) not stored: their model or "
                      "tenant was at its quota", style="yellow")
    models = _models_table(snap["models"], pool["bytes"])
    tenants = tenant_table(snap["tenants"], pool["bytes"])
    tiers = snap["tiers"]
    if "disk" in tiers:
        d = tiers["disk"]
        state.add_row("disk", f"{d['chunks']:,} chunks, {human_bytes(d['bytes'])}, read "
                      f"{per_s('disk_read_chunks')}, written {per_s('disk_written_chunks')}, queued "
                      f"{d['queued']}, dropped {d['dropped_writes']}, errors {d['errors']}")
    if "remote" in tiers:
        r = tiers["remote"]
        up = "[green]up[/]" if r["up"] else "[bold red]DOWN[/]"
        state.add_row("remote", f"{up}, read {per_s('remote_read_chunks')}, written "
                      f"{per_s('remote_written_chunks')}, queued {r['queued']}, dropped "
                      f"{r['dropped_writes']}, errors {r['errors']}, outages {r['outages']}")
    if not tiers:
        state.add_row("tiers", "memory only")
    state.add_row("metrics", escape(f"{snap['http_url']}/metrics") if snap["http_url"] else "off")
    footer = Text("rates over the last interval; Ctrl-C to quit" if snap["rates"] is not None
                  else "rates from the next refresh on; Ctrl-C to quit", style="dim")
    parts: list[RenderableType] = [Text(head, style="bold"), traffic, state]
    parts += [table for table in (models, tenants) if table is not None]
    return Group(*parts, footer)


def _models_table(models: list[dict[str, Any]], pool_bytes: int) -> RenderableType | None:
    """Each model's share of the pool (None when the server knows no model yet)."""
    from rich.markup import escape
    from rich.table import Table

    if not models:
        return None
    table = Table()
    for name, justify in (("model", "left"), ("pieces", "right"), ("bytes", "right"),
                          ("share", "right"), ("quota", "right"), ("workers", "right"),
                          ("layouts", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in models:
        quota = row["quota_bytes"]
        share = f"{100 * row['bytes_used'] / pool_bytes:.1f}%" if pool_bytes else "-"
        table.add_row(escape(row["model"]), f"{row['pieces']:,}", human_bytes(row["bytes_used"]),
                      share, "-" if quota is None else human_bytes(quota), str(row["registered"]),
                      escape(", ".join(row["layouts"])) or "-")
    return table


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}%"
