"""``lmcache pin`` / ``lmcache unpin``: keep prompts' cached prefixes from eviction, by hand.

The tokens file and the model / world-size handling are ``lmcache lookup``'s: each prompt's token
ids are hashed into chunk keys as the adapters do, and each prompt is sent as one PIN (UNPIN) of the
leading chunks every rank holds. Pins are bounded by the server's ``server.max_pinned``: a pin past
it is refused with the error ``pin_limit`` (exit 1; that prompt pins nothing, earlier ones stay
pinned). Never imports torch.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lmcache_cli.common import (
    ConfigOption,
    JsonOption,
    UrlOption,
    connect,
    console,
    fail,
    print_json,
)
from lmcache_cli.lookup import ModelOption, TokensOption, WorldSizeOption, prompts_and_config
from lmcache_core.errors import LMCacheError
from lmcache_core.protocol.messages import MAX_TTL_S, MIN_TTL_S


def pin(
    tokens: TokensOption,
    ttl: Annotated[float | None, typer.Option(
        "--ttl", min=MIN_TTL_S, max=MAX_TTL_S, metavar="SECONDS",
        help="The pin ends after this many seconds (default: until lmcache unpin).",
        show_default=False)] = None,
    config: ConfigOption = None,
    url: UrlOption = None,
    model: ModelOption = None,
    world_size: WorldSizeOption = None,
    as_json: JsonOption = False,
) -> None:
    """Pin the cached prefix of each prompt: its leading chunks the server holds are not evicted
    until --ttl passes or [bold]lmcache unpin[/]. Pins are bounded by the server's
    server.max_pinned: past it the pin is refused (error pin_limit, exit 1).

    Example: [cyan]lmcache pin --tokens system_prompt.json --ttl 3600 -c configs/llama8b.yaml[/]
    """
    _run("pin", tokens, ttl, config, url, model, world_size, as_json)


def unpin(
    tokens: TokensOption,
    config: ConfigOption = None,
    url: UrlOption = None,
    model: ModelOption = None,
    world_size: WorldSizeOption = None,
    as_json: JsonOption = False,
) -> None:
    """Unpin the cached prefix of each prompt (pinned by [bold]lmcache pin[/] or by stores with
    the lmcache.pin hint): its chunks are evicted as any others again.

    Example: [cyan]lmcache unpin --tokens system_prompt.json -c configs/llama8b.yaml[/]
    """
    _run("unpin", tokens, None, config, url, model, world_size, as_json)


def _run(what: str, tokens: str, ttl: float | None, config: Any, url: str | None,
         model: str | None, world_size: int | None, as_json: bool) -> None:
    prompts, cfg = prompts_and_config(tokens, config, url, model, world_size)
    from lmcache_core.keys import chain_hashes
    from lmcache_core.protocol import pin_messages as m

    rows: list[dict[str, Any]] = []
    with connect(cfg) as (client, ping):
        chunk_size = ping.chunk_size
        for i, prompt in enumerate(prompts):
            hashes = chain_hashes(prompt, chunk_size)
            pieces = 0
            if hashes:
                request = m.PinRequest(model_name=cfg.model.name, world_size=cfg.world_size,
                                       chunk_hashes=hashes, ttl_s=ttl)
                try:
                    reply: Any = client.pin(request) if what == "pin" else client.unpin(request)
                except LMCacheError as exc:
                    done = f" (prompts 0-{i - 1} were {what}ned)" if i else ""
                    fail(f"{getattr(exc.code, 'value', exc.code)}: {exc}{done}")
                pieces = reply.pinned if what == "pin" else reply.unpinned
            rows.append({"prompt": i, "tokens": len(prompt), "full_chunks": len(hashes),
                         f"{what}ned_pieces": pieces})
    if as_json:
        print_json({"url": cfg.server.url, "model": cfg.model.name, "world_size": cfg.world_size,
                    "chunk_size": chunk_size, "ttl_s": ttl, "prompts": rows})
        return
    _render(what, rows, cfg.server.url, cfg.model.name, cfg.world_size, ttl)


def _render(what: str, rows: list[dict[str, Any]], url: str, model: str, world_size: int,
            ttl: float | None) -> None:
    from rich.markup import escape
    from rich.table import Table

    until = "" if what == "unpin" else (f", for {ttl:g}s" if ttl else ", until unpinned")
    table = Table(title=escape(f"{what} on {url}: model {model}, world size {world_size}{until}"),
                  title_justify="left")
    for name in ("prompt", "tokens", "full chunks", f"{what}ned pieces"):
        table.add_column(name, justify="left" if name == "prompt" else "right")
    for row in rows:
        table.add_row(str(row["prompt"]), str(row["tokens"]), str(row["full_chunks"]),
                      str(row[f"{what}ned_pieces"]))
    console.print(table)
