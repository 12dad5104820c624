"""``lmcache lookup``: how much of each prompt's prefix the server holds, in memory, on disk and in
Redis, without loading or locking anything.

The prompts' token ids are hashed into chunk keys exactly as the adapters do (blake3 prefix chain at
the server's chunk size), and each prompt is sent as one PEEK: the server counts the prefix its
tiers hold together and says which tier each chunk is in, and loads, locks and touches nothing, so
a look from the shell leaves the cache as it was. The keys' layout fingerprint is ``--layout``'s,
else the config's model shape (``model.num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype``,
``use_mla``), which the server tries beside the layouts of its registered workers and resident
pieces: after a restart nothing is registered or resident, yet the disk and Redis hold that
layout. A hybrid model (its workers registered KV-cache groups) is counted as its lookups count it:
a chunk when every group can be restored at its end. ``--salt`` / ``--lora`` seed the chain as
the vLLM connector seeds a salted (LoRA) request's; ``--explain`` names why a prompt misses
(``lookup_explain``). Never imports torch.
"""

from __future__ import annotations

import json
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
    group_description,
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
LayoutOption = Annotated[str | None, typer.Option(
    "--layout", "-l", metavar="FINGERPRINT",
    help="Count only in this KV layout fingerprint: DTYPE:LAYERSxHEADSxHEAD_DIM (HEADS: KV heads of "
    "all ranks), or DTYPE:LAYERSxmlaSIZE for MLA, e.g. bfloat16:32x8x128; a CPU engine's adds "
    "bBLOCK_SIZE (its block order), e.g. float32:32x8x128b128 (default: the config's "
    "model shape, tried beside the layouts the server's workers registered).", show_default=False)]
WorldSizeOption = Annotated[int | None, typer.Option(
    "--world-size", "-w", min=1, help="Tensor-parallel ranks that must all hold a chunk "
    "(default: the tokens file's, else the config's world_size).", show_default=False)]
ExplainOption = Annotated[bool, typer.Option(
    "--explain", help="For each prompt that is not a full hit, name the nearest mismatch: the "
    "chunks held under another model name, layout, world size, chunk size, hash mode or tenant, "
    "or not stored (loads, locks and touches nothing).")]
SaltOption = Annotated[str | None, typer.Option(
    "--salt", metavar="SALT", help="Look up as the tenant of this cache_salt: the chunk hashes "
    "are chained from the salt, as the vLLM connector hashes a salted request's.",
    show_default=False)]
LoraOption = Annotated[str | None, typer.Option(
    "--lora", metavar="NAME#ID", help="Look up as requests of this LoRA adapter (its name and "
    "integer id, as vLLM's LoRARequest): the vLLM connector seeds their chain with it too.",
    show_default=False)]


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
    layout: LayoutOption = None,
    explain: ExplainOption = False,
    salt: SaltOption = None,
    lora: LoraOption = None,
    as_json: JsonOption = False,
) -> None:
    """Look up how many leading chunks of each prompt the server holds, and how many of them are
    in memory, on disk and in Redis (it loads and locks nothing); with --explain, why a prompt
    misses (the nearest mismatch, in one line).

    Keys name a model and a world size: from --model / --world-size, else from the tokens file
    (store-bench --tokens-out writes the ones it stored under), else from the config; and a
    layout: --layout's, else the config's model shape.

    Example: [cyan]lmcache lookup --tokens prompts.json -c configs/llama8b.yaml[/]

    Example: [cyan]lmcache lookup -t prompts.json --explain --salt tenant-a --json[/]
    """
    from lmcache_cli import lookup_explain as ex

    parts = ex.seed_parts(salt, lora)
    prompts, cfg = prompts_and_config(tokens, config, url, model, world_size)
    request_layout, hint = layouts_to_send(cfg, layout)
    from lmcache_core.keys import chain_hashes, salted_prefix
    from lmcache_core.protocol import messages as m
    from lmcache_core.protocol import ops

    seed = salted_prefix(parts)
    rows: list[dict[str, Any]] = []
    tiers: list[str] = []
    with connect(cfg) as (client, ping):
        chunk_size = ping.chunk_size
        for i, prompt in enumerate(prompts):
            hashes = chain_hashes(prompt, chunk_size, seed)
            reply, elapsed_ms = None, None
            if hashes:
                request = m.PeekRequest(model_name=cfg.model.name, world_size=cfg.world_size,
                                        chunk_hashes=hashes, layout=request_layout,
                                        hint_layout=hint)
                start = time.perf_counter()
                reply = client.call(ops.PEEK, request)
                elapsed_ms = (time.perf_counter() - start) * 1e3
                tiers = reply.tiers
            row = _row(i, prompt, len(hashes), chunk_size, reply, elapsed_ms)
            if explain:
                asked = ex.Asked(cfg.model.name, cfg.world_size,
                                 row["layout"] or request_layout or hint or "",
                                 request_layout is not None, chunk_size, salt, lora)
                row["explain"] = ex.explain_prompt(client, prompt, row, asked, seed,
                                                   (request_layout, hint))
            rows.append(row)
    if as_json:
        groups = next((row["groups"] for row in rows if row["groups"] is not None), None)
        print_json({"url": cfg.server.url, "model": cfg.model.name, "world_size": cfg.world_size,
                    "chunk_size": chunk_size, "layout": request_layout or hint, "tiers": tiers,
                    **({"groups": groups} if groups is not None else {}), "prompts": rows})
        return
    _render(rows, cfg.server.url, cfg.model.name, cfg.world_size, chunk_size, tiers)
    if explain:
        ex.render(rows)


def layouts_to_send(cfg: Any, layout: str | None) -> tuple[str | None, str | None]:
    """``(layout, hint_layout)`` of the requests: --layout's (checked: exit 2 for one that is no
    fingerprint) as the only layout, else the config's model shape as a hint."""
    from lmcache_core.keys import layout_heads, layout_key

    if layout is not None:
        try:
            layout_heads(layout)
        except ValueError:
            fail(f"--layout {layout[:80]!r} is not a KV layout fingerprint: DTYPE:LAYERSxHEADSxHEAD_DIM "
                 "or DTYPE:LAYERSxmlaSIZE, e.g. bfloat16:32x8x128 (a CPU engine's: "
                 "float32:32x8x128b128)", EXIT_USAGE)
        return layout, None
    shape = cfg.model
    return None, layout_key(shape.dtype, shape.num_layers, shape.num_kv_heads, shape.head_dim,
                            shape.use_mla)


def _row(i: int, prompt: list[int], full: int, chunk_size: int, reply: Any,
         elapsed_ms: float | None) -> dict[str, Any]:
    """One prompt's result (a PeekReply, or None for a prompt without a full chunk)."""
    hit = reply.hit_chunks if reply is not None else 0
    return {"prompt": i, "tokens": len(prompt), "full_chunks": full, "hit_chunks": hit,
            "hit_tokens": hit * chunk_size,
            "memory_chunks": reply.memory_chunks if reply is not None else 0,
            "disk_chunks": reply.disk_chunks if reply is not None else 0,
            "remote_chunks": reply.remote_chunks if reply is not None else 0,
            "remote": reply.remote if reply is not None else "",
            "layout": reply.layout if reply is not None else None,
            "groups": reply.groups if reply is not None else None,
            "lookup_ms": None if elapsed_ms is None else round(elapsed_ms, 3)}


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


#: What a prompt's Redis state means, under the table (PeekReply.remote).
_REMOTE_NOTES = {
    "down": "Redis is down: its chunks were not counted",
    "timeout": "Redis did not answer within the lookup budget: its chunks were not counted",
    "cut": "the prefix needs more Redis probes than one lookup makes: it may go on past the count",
}


def _render(rows: list[dict[str, Any]], url: str, model: str, world_size: int,
            chunk_size: int, tiers: list[str]) -> None:
    from rich.markup import escape
    from rich.table import Table

    layouts = sorted({row["layout"] for row in rows if row["layout"]})
    groups = next((row["groups"] for row in rows if row["groups"] is not None), None)
    shape = (f"layout {', '.join(layouts) or '-'}" if groups is None
             else f"hybrid, {len(groups) or 'incomplete'} KV-cache groups")
    table = Table(title=escape(f"lookup on {url}: model {model}, world size {world_size}, "
                               f"chunk size {chunk_size}, {shape}"), title_justify="left")
    tier_columns = [("memory_chunks", "in memory")] + [
        (field, name) for tier, field, name in (("disk", "disk_chunks", "on disk"),
                                                ("remote", "remote_chunks", "in Redis"))
        if tier in tiers]
    for name in ("prompt", "tokens", "full chunks", "hit chunks",
                 *(name for _, name in tier_columns), "hit tokens", "hit", "lookup"):
        table.add_column(name, justify="left" if name == "prompt" else "right")
    for row in rows:
        full, hit = row["full_chunks"], row["hit_chunks"]
        share = f"{100 * hit / full:.0f}%" if full else "-"
        style = "green" if full and hit == full else ("yellow" if hit else "")
        table.add_row(str(row["prompt"]), str(row["tokens"]), str(full), str(hit),
                      *(str(row[field]) for field, _ in tier_columns),
                      str(row["hit_tokens"]), share,
                      "-" if row["lookup_ms"] is None else f"{row['lookup_ms']:.2f} ms",
                      style=style)
    console.print(table)
    if groups:
        named = ", ".join(f"{layout} ({group_description(layout)})" for layout in groups)
        console.print(escape(f"a chunk counts when every KV-cache group can be restored at its end "
                             f"(as the model's lookups count): {named}"), highlight=False)
    elif groups is not None:
        console.print("[yellow]the model's registered workers do not cover every KV-cache group: "
                      "nothing can be restored (its lookups miss too)[/]", highlight=False)
    for state, note in _REMOTE_NOTES.items():
        hit_by = [str(row["prompt"]) for row in rows if row["remote"] == state]
        if hit_by:
            console.print(f"[yellow]prompt {', '.join(hit_by)}: {note}[/]", highlight=False)
