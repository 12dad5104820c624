"""What every command shares: the -c/--config and --url options, config loading, user errors.

User errors (bad config, unreachable server, bad input file) print one line on stderr and exit with
a code: 2 for bad usage (flags, config, input files), 1 for a failure at run time (server unreachable,
an error reply, a failed check). They never show a traceback. Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console

from lmcache_core.config import URL_ENV, LMCacheConfig, load_config
from lmcache_core.errors import ConfigError, LMCacheError

if TYPE_CHECKING:
    from rich.table import Table

    from lmcache_core.protocol.messages import PingReply
    from lmcache_core.transport.client import MessageQueueClient

#: The width of output that goes to a file or a pipe: wide enough that no table cell is cut.
PIPED_WIDTH = 4096


def _console(stderr: bool = False) -> Console:
    """A console that renders at the terminal's width on a terminal, but at ``PIPED_WIDTH`` into
    a file, a pipe or a CI log, where rich would fit tables into 80 columns and cut their cells
    ("meta-llama/…"); tables take only the width they need, so nothing is padded. ``COLUMNS``,
    when set, wins either way."""
    stream = sys.stderr if stderr else sys.stdout
    piped = not (stream.isatty() or os.environ.get("COLUMNS"))
    return Console(stderr=stderr, width=PIPED_WIDTH if piped else None)


console = _console()
err_console = _console(stderr=True)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

ConfigOption = Annotated[Path | None, typer.Option(
    "--config", "-c", help="YAML config file (see configs/).", show_default=False)]
UrlOption = Annotated[str | None, typer.Option(
    "--url", envvar=URL_ENV, help="Server url, e.g. tcp://127.0.0.1:5555 or ipc:///run/lmcache.sock "
    f"(default: the config's server.url; env {URL_ENV}).", show_default=False)]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]


def error_line(message: str) -> None:
    """One line on stderr, prefixed ``error:`` (the message is printed as is, never as markup)."""
    from rich.text import Text

    lines = str(message).strip().splitlines()
    err_console.print(Text.assemble(("error: ", "bold red"), lines[0] if lines else "unknown error"),
                      soft_wrap=True)


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Print one line on stderr and exit with ``code``."""
    error_line(message)
    raise typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn lmcache's own errors into one line and an exit code (ConfigError 2, the rest 1)."""
    try:
        yield
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    except LMCacheError as exc:
        fail(str(exc), EXIT_FAILURE)


def config_from(path: Path | None, overrides: Mapping[str, Any] | None = None) -> LMCacheConfig:
    """Load the config or exit 2 with one line naming the file and key."""
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)


@contextmanager
def connect(cfg: LMCacheConfig, timeout_s: float | None = None
            ) -> Iterator[tuple[MessageQueueClient, PingReply]]:
    """A client of the config's server and its first ping's reply; exit 1 naming the url if no
    server answers within the connect timeout. Errors inside the block exit as ``user_errors``."""
    from lmcache_core.transport.client import MessageQueueClient

    wait_s = timeout_s if timeout_s is not None else cfg.timeouts.connect_s
    with user_errors(), MessageQueueClient(
            cfg.server.url, connect_timeout_s=wait_s, request_timeout_s=cfg.timeouts.request_s,
            name="lmcache-cli") as client:
        yield client, client.wait_until_reachable(wait_s)


def print_json(data: Any) -> None:
    """JSON on stdout, one line, for scripts; bytes (chunk hashes) as hex strings."""
    import msgspec

    sys.stdout.write(msgspec.json.encode(_hex_bytes(data)).decode() + "\n")
    sys.stdout.flush()


def _hex_bytes(data: Any) -> Any:
    import msgspec

    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data).hex()
    if isinstance(data, msgspec.Struct):
        data = msgspec.structs.asdict(data)
    if isinstance(data, dict):
        return {k: _hex_bytes(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_hex_bytes(v) for v in data]
    return data


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0 to 1) of ``values``, interpolated between the two nearest (numpy's
    default, without numpy); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def human_bytes(nbytes: float) -> str:
    """``1.5 GiB``, ``64.0 KiB``, ``512 B``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h10m``, ``4d03h``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def tenant_table(rows: Sequence[Mapping[str, Any]], pool_bytes: int,
                 title: str | None = None) -> Table | None:
    """Each cache_salt tenant's share of the pool (rows as ``TenantStats`` fields: ``name``, its
    label in server.tenant_quotas; ``tenant``, its tag): pieces, bytes, share, quota and how full
    it is. None without rows (no store named a tenant, none configured)."""
    from rich.markup import escape
    from rich.table import Table

    if not rows:
        return None
    table = Table(title=title, title_justify="left")
    for name, justify in (("tenant", "left"), ("tag", "left"), ("pieces", "right"),
                          ("bytes", "right"), ("share", "right"), ("quota", "right"),
                          ("of quota", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        used, quota = row["bytes_used"], row["quota_bytes"]
        table.add_row(escape(row["name"]) or "-", row["tenant"], f"{row['pieces']:,}",
                      human_bytes(used), f"{100 * used / pool_bytes:.1f}%" if pool_bytes else "-",
                      "-" if quota is None else human_bytes(quota),
                      f"{100 * used / quota:.0f}%" if quota else "-")
    return table


def group_description(layout: str) -> str:
    """What a hybrid model's pieces of this layout fingerprint are: their KV-cache group and what
    they hold ("1/3 sliding: last 48 tokens", "0/3 full", "1/2 mamba: state at the end (TP=2)",
    "1/2 local: attention chunks of 8192"); "" for a single-group model's."""
    from lmcache_core.keys import layout_group

    group = layout_group(layout)
    if group is None:
        return ""
    where = f"{group.position}/{group.groups}"
    if group.state_world:
        return f"{where} mamba: state at the end (TP={group.state_world})"
    if group.local_tokens:
        return f"{where} local: attention chunks of {group.local_tokens}"
    return f"{where} sliding: last {group.piece_tokens} tokens" if group.piece_tokens else \
        f"{where} full"
