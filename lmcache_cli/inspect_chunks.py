"""``lmcache inspect-chunks``: the chunks a server holds, with a footer of pool use and hit rate.

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
        "--sort", "-s", help="age: newest first; hits, size: most first; key: by model, hash, rank.",
        case_sensitive=False)] = SortOrder.age,
    as_json: JsonOption = False,
) -> None:
    """List the chunks the server holds: key, model, rank, tier, bytes, locks, hits, age.

    Example: [cyan]lmcache inspect-chunks --sort hits --limit 20 --model meta-llama/Llama-3.1-8B[/]
    """
    cfg = config_from(config, {"server.url": url})
    from lmcache_core.protocol import messages as m
    from lmcache_core.protocol.ops import RequestType

    with connect(cfg) as (client, _ping):
        listing = client.call(RequestType.LIST_CHUNKS, m.ListChunksRequest(
            model_name=model, limit=limit, sort=sort.value), m.ChunkListReply)
        info = client.call(RequestType.SERVER_INFO, m.NoArgs(), m.ServerInfoReply)
    stats = info.stats
    looked_up = stats.lookup_hit_chunks + stats.lookup_miss_chunks
    summary: dict[str, Any] = {
        "shown": len(listing.chunks),
        "total": listing.total,
        "bytes_shown": sum(c.nbytes for c in listing.chunks),
        "chunks_in_pool": stats.chunks,
        "bytes_used": stats.bytes_used,
        "pool_bytes": info.pool_bytes,
        "slots_used": stats.slots_used,
        "slots_total": stats.slots_total,
        "pool_use": round(stats.slots_used / stats.slots_total, 4) if stats.slots_total else 0.0,
        "lookup_hit_chunks": stats.lookup_hit_chunks,
        "lookup_miss_chunks": stats.lookup_miss_chunks,
        "hit_rate": round(stats.lookup_hit_chunks / looked_up, 4) if looked_up else None,
        "locks_held": stats.locks_held,
        "evictions": stats.evictions,
    }
    if as_json:
        import msgspec

        print_json({"url": info.url, "model": model, "sort": sort.value, "limit": limit,
                    "chunks": [msgspec.structs.asdict(c) for c in listing.chunks],
                    "summary": summary})
        return
    _render(listing.chunks, info, summary, model)


def _render(chunks: list[Any], info: Any, summary: dict[str, Any], model: str | None) -> None:
    from rich.markup import escape
    from rich.table import Table

    title = escape(f"chunks on {info.url}" + (f" (model {model})" if model else ""))
    table = Table(title=title, title_justify="left", show_footer=False)
    for name, justify in (("key", "left"), ("model", "left"), ("rank", "right"),
                          ("tier", "left"), ("bytes", "right"), ("locks", "right"),
                          ("hits", "right"), ("age", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in chunks:
        table.add_row(c.chunk_hash[:6].hex(), escape(c.model_name), f"{c.kv_rank}/{c.world_size}", c.tier,
                      human_bytes(c.nbytes), str(c.locks) if c.locks else "-", str(c.hits),
                      human_age(c.age_s), style="bold" if c.locks else "")
    if chunks:
        console.print(table)
    else:
        console.print(f"[dim]{title}: no chunks[/]", highlight=False)
    s = summary
    hit_rate = "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
    console.print(
        f"{s['shown']} of {s['total']} chunk(s) shown, {human_bytes(s['bytes_shown'])} · "
        f"pool {s['slots_used']}/{s['slots_total']} slots ({100 * s['pool_use']:.1f}%), "
        f"{human_bytes(s['bytes_used'])} of {human_bytes(s['pool_bytes'])} · "
        f"hit rate {hit_rate} ({s['lookup_hit_chunks']} of "
        f"{s['lookup_hit_chunks'] + s['lookup_miss_chunks']} chunks looked up) · "
        f"{s['locks_held']} locked", highlight=False)
