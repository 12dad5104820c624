"""``lmcache inspect-chunks``: the chunk pieces a server holds (a piece: KV heads ``lo-hi`` of one
chunk of one model in one layout), each model's share of the pool, each cache_salt tenant's (when
there are any), and a footer of pool use and hit rate.

One LIST_CHUNKS and one SERVER_INFO request; never imports torch.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

import typer

from lmcache_cli.common import (
    ConfigOption,
    JsonOption,
    UrlOption,
    config_from,
    connect,
    console,
    human_age,
    human_bytes,
    print_json,
    tenant_table,
)


class SortOrder(str, Enum):
    age = "age"
    hits = "hits"
    size = "size"
    key = "key"


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
    as_json: JsonOption = False,
) -> None:
    """List the chunk pieces the server holds: hash, model, layout, heads, tier, size, locks,
    hits, age, retention (pinned, TTL left, priority); then each model's share of the pool.

    Example: [cyan]lmcache inspect-chunks --sort hits --limit 20 --model meta-llama/Llama-3.1-8B[/]
    """
    cfg = config_from(config, {"server.url": url})
    from lmcache_core.protocol import messages as m

    with connect(cfg) as (client, _ping):
        listing = client.request(m.ListChunksRequest(model_name=model, limit=limit,
                                                     sort=sort.value))
        info = client.server_info()
    stats = info.stats
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
    }
    if as_json:
        import msgspec

        print_json({"url": info.url, "model": model, "sort": sort.value, "limit": limit,
                    "chunks": [msgspec.structs.asdict(c) for c in listing.chunks],
                    "models": [msgspec.structs.asdict(row) for row in _models(info, model)],
                    "tenants": [msgspec.structs.asdict(row) for row in info.tenants],
                    "summary": summary})
        return
    _render(listing.chunks, info, summary, model)


def _models(info: Any, model: str | None) -> list[Any]:
    """SERVER_INFO's per-model rows (only ``model``'s when one is asked for)."""
    return [row for row in info.models if model is None or row.model_name == model]


def _render(chunks: list[Any], info: Any, summary: dict[str, Any], model: str | None) -> None:
    import msgspec
    from rich.markup import escape
    from rich.table import Table

    title = escape(f"chunks on {info.url}" + (f" (model {model})" if model else ""))
    table = Table(title=title, title_justify="left", show_footer=False)
    for name, justify in (("hash", "left"), ("model", "left"), ("layout", "left"),
                          ("heads", "right"), ("tier", "left"), ("size", "right"),
                          ("locks", "right"), ("hits", "right"), ("age", "right"),
                          ("pin", "left"), ("ttl", "right"), ("prio", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in chunks:
        table.add_row(c.chunk_hash[:6].hex(), escape(c.model_name), escape(c.layout),
                      f"{c.head_lo}-{c.head_hi}", c.tier, human_bytes(c.nbytes),
                      str(c.locks) if c.locks else "-", str(c.hits), human_age(c.age_s),
                      *_retention(c), style="bold" if c.locks or c.pinned else "")
    if chunks:
        console.print(table)
    else:
        console.print(f"[dim]{title}: no chunks[/]", highlight=False)
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
