"""``lmcache lookup``: how much of each prompt's prefix the server holds, without locking anything.

The prompts' token ids are hashed into chunk keys exactly as the adapters do (blake3 prefix chain at
the server's chunk size), and each prompt is sent as one LOOKUP with ``lock=False``, so a lookup from
the shell never leaves locks behind. Never imports torch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
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
    print_json,
)

MAX_TOKEN = 2**32 - 1
_SHAPES = 'a list of token ids, a list of such lists, or {"prompts": [...]}'
#: Keys a tokens file object may carry beside "prompts" (store-bench --tokens-out writes them): the
#: keys' model and world size, which lookup then uses unless --model / --world-size say otherwise.
_META_KEYS = {"model", "world_size"}


TokensOption = Annotated[str, typer.Option(
    "--tokens", "-t", metavar="FILE",
    help='JSON file of token ids: [1, 2, ...], [[...], [...]] or {"prompts": [...]}; '
         "- reads stdin.", show_default=False)]
ModelOption = Annotated[str | None, typer.Option(
    "--model", "-m", help="Model name of the keys (default: the tokens file's, else the config's "
    "model.name).", show_default=False)]
WorldSizeOption = Annotated[int | None, typer.Option(
    "--world-size", "-w", min=1, help="Tensor-parallel ranks that must all hold a chunk "
    "(default: the tokens file's, else the config's world_size).", show_default=False)]


class TokenFileError(ValueError):
    """The tokens file cannot be used; the message is the one line to show."""


def load_prompts(path: str) -> list[list[int]]:
    """The prompts of a tokens file (``-`` reads stdin); TokenFileError says what is wrong."""
    return load_token_file(path)[0]


def load_token_file(path: str) -> tuple[list[list[int]], dict[str, Any]]:
    """The prompts of a tokens file and what it says of their keys (``model``, ``world_size``:
    present only when the file gives them)."""
    label = "<stdin>" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except FileNotFoundError:
        raise TokenFileError(f"{label}: no such file") from None
    except IsADirectoryError:
        raise TokenFileError(f"{label}: is a directory, not a JSON file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"{label}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenFileError(
            f"{label}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    return parse_prompts(data, label), parse_meta(data, label)


def parse_meta(data: Any, label: str = "tokens") -> dict[str, Any]:
    """``model`` and ``world_size`` of a tokens file object, checked ({} for a plain list)."""
    if not isinstance(data, dict):
        return {}
    meta = {key: data[key] for key in _META_KEYS & set(data)}
    if "model" in meta and (not isinstance(meta["model"], str) or not meta["model"]):
        raise TokenFileError(f"{label}: \"model\" must be a non-empty string, got "
                             f"{_json_type(meta['model'])}")
    size = meta.get("world_size")
    if "world_size" in meta and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise TokenFileError(f"{label}: \"world_size\" must be a positive integer, got "
                             f"{json.dumps(size)}")
    return meta


def parse_prompts(data: Any, label: str = "tokens") -> list[list[int]]:
    """Accept ``[ids]``, ``[[ids], ...]`` or ``{"prompts": [[ids], ...]}``; check every token."""
    if isinstance(data, dict):
        if "prompts" not in data or set(data) - _META_KEYS - {"prompts"} or not isinstance(
                data["prompts"], list):
            raise TokenFileError(f"{label}: expected {_SHAPES}; got an object with keys "
                                 f"{sorted(data)}")
        prompts = data["prompts"]
        if not prompts:
            raise TokenFileError(f"{label}: \"prompts\" is empty")
    elif isinstance(data, list):
        prompts = data if data and all(isinstance(p, list) for p in data) else [data]
    else:
        raise TokenFileError(f"{label}: expected {_SHAPES}; got {_json_type(data)}")
    for i, prompt in enumerate(prompts):
        where = f"prompt {i}" if len(prompts) > 1 else "prompt"
        if not isinstance(prompt, list):
            raise TokenFileError(f"{label}: {where}: expected a list of token ids, got "
                                 f"{_json_type(prompt)}")
        for j, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN:
                raise TokenFileError(
                    f"{label}: {where}, position {j}: {json.dumps(token)} is not a token id "
                    "(a non-negative 32-bit integer)")
    return prompts


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null", int: "a number", float: "a number"}.get(type(value), "a value")


def lookup(
    tokens: TokensOption,
    config: ConfigOption = None,
    url: UrlOption = None,
    model: ModelOption = None,
    world_size: WorldSizeOption = None,
    as_json: JsonOption = False,
) -> None:
    """Look up how many leading chunks of each prompt the server holds (never locks them).

    Keys name a model and a world size: from --model / --world-size, else from the tokens file
    (store-bench --tokens-out writes the ones it stored under), else from the config.

    Example: [cyan]lmcache lookup --tokens prompts.json -c configs/llama8b.yaml[/]
    """
    prompts, cfg = prompts_and_config(tokens, config, url, model, world_size)
    from lmcache_core.keys import chain_hashes
    from lmcache_core.protocol import messages as m

    rows: list[dict[str, Any]] = []
    with connect(cfg) as (client, ping):
        chunk_size = ping.chunk_size
        for i, prompt in enumerate(prompts):
            hashes = chain_hashes(prompt, chunk_size)
            hit, elapsed_ms = 0, None
            if hashes:
                request = m.LookupRequest(model_name=cfg.model.name, world_size=cfg.world_size,
                                          lookup_id=f"lmcache-cli-lookup-{os.getpid()}-{i}",
                                          chunk_hashes=hashes, lock=False)
                start = time.perf_counter()
                reply = client.request(request)
                elapsed_ms = (time.perf_counter() - start) * 1e3
                hit = reply.hit_chunks
            rows.append({"prompt": i, "tokens": len(prompt), "full_chunks": len(hashes),
                         "hit_chunks": hit, "hit_tokens": hit * chunk_size,
                         "lookup_ms": None if elapsed_ms is None else round(elapsed_ms, 3)})
    if as_json:
        print_json({"url": cfg.server.url, "model": cfg.model.name, "world_size": cfg.world_size,
                    "chunk_size": chunk_size, "prompts": rows})
        return
    _render(rows, cfg.server.url, cfg.model.name, cfg.world_size, chunk_size)


def prompts_and_config(tokens: str, config: Any, url: str | None, model: str | None,
                       world_size: int | None) -> tuple[list[list[int]], Any]:
    """The tokens file's prompts and the config their keys are named under: --model /
    --world-size, else the file's, else the config's (exit 2 for a bad file)."""
    try:
        prompts, meta = load_token_file(tokens)
    except TokenFileError as exc:
        fail(str(exc), EXIT_USAGE)
    cfg = config_from(config, {
        "server.url": url, "model.name": model if model is not None else meta.get("model"),
        "world_size": world_size if world_size is not None else meta.get("world_size")})
    return prompts, cfg


def _render(rows: list[dict[str, Any]], url: str, model: str, world_size: int,
            chunk_size: int) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(f"lookup on {url}: model {model}, world size {world_size}, "
                               f"chunk size {chunk_size}"), title_justify="left")
    for name in ("prompt", "tokens", "full chunks", "hit chunks", "hit tokens", "hit", "lookup"):
        table.add_column(name, justify="left" if name == "prompt" else "right")
    for row in rows:
        full, hit = row["full_chunks"], row["hit_chunks"]
        share = f"{100 * hit / full:.0f}%" if full else "-"
        style = "green" if full and hit == full else ("yellow" if hit else "")
        table.add_row(str(row["prompt"]), str(row["tokens"]), str(full), str(hit),
                      str(row["hit_tokens"]), share,
                      "-" if row["lookup_ms"] is None else f"{row['lookup_ms']:.2f} ms",
                      style=style)
    console.print(table)
