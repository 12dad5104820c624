"""``lmcache inspect-chunks``: the chunk pieces a server holds (a piece: KV heads ``lo-hi`` of one
chunk of one model in one layout) in memory and on disk (from the disk tier's index, with a tier
column), each tier's total (for Redis, a count of keys by pattern: SCAN within a time budget, never
KEYS, said when cut short), each model's share of the pool, each cache_salt tenant's (when there
are any), and a footer of pool use and hit rate.

One LIST_CHUNKS and one SERVER_INFO request; never imports torch.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

import typer

from lmcache_cli.common import (
    EXIT_USAGE,
    ConfigOption,
    JsonOption,
    UrlOption,
    config_from,
    connect,
    console,
    fail,
    group_description,
    human_age,
    human_bytes,
    print_json,
    tenant_table,
)
from lmcache_core.protocol.messages import MAX_COUNT_BUDGET_MS, MAX_MATCH_CHARS, MAX_MATCH_STARS


class SortOrder(str, Enum):
    age = "age"
    hits = "hits"
    size = "size"
    key = "key"


class Tier(str, Enum):
    memory = "memory"
    disk = "disk"
    remote = "remote"


def inspect_chunks(
    config: ConfigOption = None,
    url: UrlOption = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Only chunks of this model name.", show_default=False)] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=0, help="Rows to show at most.")] = 50,
    sort: Annotated[SortOrder, typer.Option(
        "--sort", "-s", help="age: newest first; hits, size: most first; key: by model, layout, "
        "hash, heads.",
        case_sensitive=False)] = SortOrder.age,
    tiers: Annotated[list[Tier] | None, typer.Option(
        "--tier", help="Tiers to list (repeat for several; default: all the server has): "
        "memory, disk (its index), remote (Redis keys are counted, not listed).",
        case_sensitive=False, show_default=False)] = None,
    redis_match: Annotated[str | None, typer.Option(
        "--redis-match", metavar="GLOB", help="Redis keys to count, after the server's key prefix "
        "(<prefix>:v2:), as MODEL:LAYOUT:HEAD_LO-HEAD_HI:HASH_HEX, e.g. 'tiny:float16:2x4x32:*' "
        "(default: "
        f"--model's keys, else all; at most {MAX_MATCH_CHARS} characters and "
        f"{MAX_MATCH_STARS} '*').", show_default=False)] = None,
    redis_budget_ms: Annotated[int, typer.Option(
        "--redis-budget-ms", min=1, max=MAX_COUNT_BUDGET_MS,
        help="How long the Redis count may take; past it the count is cut short (and says so)."
    )] = 250,
    as_json: JsonOption = False,
) -> None:
    """List the chunk pieces the server holds in memory and on disk: hash, model, layout, heads,
    tier, size, locks, hits, age, retention (pinned, TTL left, priority); each tier's total
    (Redis: keys counted by SCAN within --redis-budget-ms); then each model's share of the pool.

    Example: [cyan]lmcache inspect-chunks --sort hits --limit 20 --model meta-llama/Llama-3.1-8B[/]

    Example: [cyan]lmcache inspect-chunks --tier disk --tier remote --redis-match 'tiny:*'[/]
    """
    cfg = config_from(config, {"server.url": url})
    request = _request(model, limit, sort, tiers, redis_match, redis_budget_ms)

    with connect(cfg) as (client, _ping):
        listing = client.request(request)
        info = client.server_info()
    import msgspec

    stats = info.stats.engine
    looked_up = stats.lookup_hit_chunks + stats.lookup_miss_chunks
    summary: dict[str, Any] = {
        "shown": len(listing.chunks),
        "total": listing.total,
        "bytes_shown": sum(c.nbytes for c in listing.chunks),
        "pieces_in_pool": stats.chunks,
        "bytes_used": stats.bytes_used,
        "pool_bytes": info.pool_bytes,
        "pool_bytes_allocated": stats.pool_bytes_allocated,
        "pool_use": round(stats.pool_bytes_allocated / info.pool_bytes, 4) if info.pool_bytes else 0.0,
        "slab_bytes": info.slab_bytes,
        "slabs": stats.pool_slabs,
        "slabs_free": stats.pool_slabs_free,
        "lookup_hit_chunks": stats.lookup_hit_chunks,
        "lookup_miss_chunks": stats.lookup_miss_chunks,
        "hit_rate": round(stats.lookup_hit_chunks / looked_up, 4) if looked_up else None,
        "locks_held": stats.locks_held,
        "evictions": stats.evictions,
        "pinned_pieces": stats.pinned_pieces,
        "pinned_bytes": stats.pinned_bytes,
        "tiers": [msgspec.structs.asdict(total) for total in listing.tiers],
    }
    if as_json:
        print_json({"url": info.url, "model": model, "sort": sort.value, "limit": limit,
                    "chunks": [msgspec.structs.asdict(c) for c in listing.chunks],
                    "models": [msgspec.structs.asdict(row) for row in _models(info, model)],
                    "tenants": [msgspec.structs.asdict(row) for row in info.tenants],
                    "summary": summary})
        return
    _render(listing.chunks, info, summary, model)


def _request(model: str | None, limit: int, sort: SortOrder, tiers: list[Tier] | None,
             redis_match: str | None, budget_ms: int) -> Any:
    """The LIST_CHUNKS request (every tier unless --tier says which); exit 2 for a Redis pattern
    the server would refuse."""
    from lmcache_core.protocol import messages as m

    if redis_match is not None and not 0 < len(redis_match) <= MAX_MATCH_CHARS:
        fail(f"--redis-match must be 1 to {MAX_MATCH_CHARS} characters, got {len(redis_match)}",
             EXIT_USAGE)
    names: list[Any] = [t.value for t in Tier if not tiers or t in tiers]  # m.TierName values
    try:
        return m.ListChunksRequest(model_name=model, limit=limit, sort=sort.value, tiers=names,
                                   remote_match=redis_match, remote_budget_ms=budget_ms)
    except ValueError as exc:
        fail(f"--redis-match: {exc}".replace("remote_match ", ""), EXIT_USAGE)


def _models(info: Any, model: str | None) -> list[Any]:
    """SERVER_INFO's per-model rows (only ``model``'s when one is asked for)."""
    return [row for row in info.models if model is None or row.model_name == model]


def _render(chunks: list[Any], info: Any, summary: dict[str, Any], model: str | None) -> None:
    import msgspec
    from rich.markup import escape
    from rich.table import Table

    title = escape(f"chunks on {info.url}" + (f" (model {model})" if model else ""))
    table = Table(title=title, title_justify="left", show_footer=False)
    grouped = any(group_description(c.layout) for c in chunks)  # a hybrid model's pieces are listed
    for name, justify in (("hash", "left"), ("model", "left"), ("layout", "left"),
                          *((("group", "left"),) if grouped else ()),
                          ("heads", "right"), ("tier", "left"), ("size", "right"),
                          ("locks", "right"), ("hits", "right"), ("age", "right"),
                          ("pin", "left"), ("ttl", "right"), ("prio", "right")):
        table.add_column(name, justify=justify)
    for c in chunks:
        table.add_row(c.chunk_hash[:6].hex(), escape(c.model_name), escape(c.layout),
                      *((group_description(c.layout) or "-",) if grouped else ()),
                      f"{c.head_lo}-{c.head_hi}", c.tier, human_bytes(c.nbytes),
                      str(c.locks) if c.locks else "-", str(c.hits), human_age(c.age_s),
                      *_retention(c), style="bold" if c.locks or c.pinned else "")
    if chunks:
        console.print(table)
    else:
        where = " or ".join(t["tier"] for t in summary["tiers"] if t["tier"] != "remote")
        console.print(f"[dim]{title}: no chunks{' in ' + where if where else ''}[/]",
                      highlight=False)
    if summary["tiers"]:
        console.print("tiers: " + " · ".join(_tier_total(t) for t in summary["tiers"]),
                      highlight=False)
    _render_models(_models(info, model), info.pool_bytes)
    tenants = tenant_table([msgspec.structs.asdict(row) for row in info.tenants], info.pool_bytes,
                           title="tenants (cache_salt)")  # never a salt: labels and tags
    if tenants is not None:
        console.print(tenants)
    s = summary
    hit_rate = "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
    console.print(
        f"{s['shown']} of {s['total']} piece(s) shown, {human_bytes(s['bytes_shown'])} · "
        f"pool {human_bytes(s['pool_bytes_allocated'])} of {human_bytes(s['pool_bytes'])} "
        f"allocated ({100 * s['pool_use']:.1f}%), {human_bytes(s['bytes_used'])} in "
        f"{s['pieces_in_pool']} piece(s), {s['slabs_free']}/{s['slabs']} slabs free · "
        f"hit rate {hit_rate} ({s['lookup_hit_chunks']} of "
        f"{s['lookup_hit_chunks'] + s['lookup_miss_chunks']} chunks looked up) · "
        f"{s['locks_held']} locked · {s['pinned_pieces']} pinned "
        f"({human_bytes(s['pinned_bytes'])})", highlight=False)


def _tier_total(total: dict[str, Any]) -> str:
    """``memory 4 piece(s), 64.0 KiB``; for Redis ``Redis 12 key(s) (lmcache:v2:*)``, with
    ``at least`` and why when the count was cut short or failed."""
    from rich.markup import escape

    if total["tier"] != "remote":
        return f"{total['tier']} {total['pieces']} piece(s), {human_bytes(total['nbytes'] or 0)}"
    text = f"Redis {'' if total['complete'] else 'at least '}{total['pieces']} key(s)"
    if total["pattern"]:
        text += f" ({escape(total['pattern'])})"
    if total["error"]:
        return text + f" [yellow]not counted to the end: {escape(total['error'])}[/]"
    if not total["complete"]:
        return text + " [yellow]count cut short at its budget (--redis-budget-ms)[/]"
    return text


def _retention(c: Any) -> tuple[str, str, str]:
    """The pin, TTL-left and priority cells of a piece ("-" where it has none)."""
    ttl = c.expires_in_s
    return ("pinned" if c.pinned else "-",
            "-" if ttl is None else ("expired" if ttl <= 0 else human_age(ttl)),
            str(c.priority) if c.priority else "-")


def _render_models(models: list[Any], pool_bytes: int) -> None:
    """Each model's share of the pool: pieces, bytes, quota, registered workers, layouts."""
    from rich.markup import escape
    from rich.table import Table

    if not models:
        return
    table = Table(title="models", title_justify="left")
    for name, justify in (("model", "left"), ("pieces", "right"), ("size", "right"),
                          ("share", "right"), ("quota", "right"), ("workers", "right"),
                          ("layouts", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in models:
        share = f"{100 * row.bytes_used / pool_bytes:.1f}%" if pool_bytes else "-"
        quota = "-" if row.quota_bytes is None else human_bytes(row.quota_bytes)
        table.add_row(escape(row.model_name), str(row.pieces), human_bytes(row.bytes_used), share,
                      quota, str(row.registered), escape(", ".join(row.layouts)) or "-")
    console.print(table)
    _render_groups(models)


def _render_groups(models: list[Any]) -> None:
    """The KV-cache groups hybrid models' workers registered (none: no table)."""
    from rich.markup import escape
    from rich.table import Table

    rows = [(row.model_name, g) for row in models for g in row.groups]
    if not rows:
        return
    table = Table(title="KV-cache groups (hybrid models)", title_justify="left")
    for name, justify in (("model", "left"), ("group", "right"), ("kind", "left"),
                          ("block", "right"), ("window", "right"), ("layout", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for model, g in rows:
        table.add_row(escape(model), f"{g.index}/{g.count}", g.kind, str(g.block_size),
                      str(g.window_tokens) if g.window_tokens else "-", escape(g.layout))
    console.print(table)
