"""What every command shares: the -c/--config and --url options, config loading, user errors.

User errors (bad config, unreachable server, bad input file) print one line on stderr and exit with
a code; they never show a traceback. Nothing here imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from lmcache_core.config import URL_ENV, LMCacheConfig, load_config
from lmcache_core.errors import ConfigError

console = Console()
err_console = Console(stderr=True)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

ConfigOption = Annotated[Path | None, typer.Option(
    "--config", "-c", help="YAML config file (see configs/).", show_default=False)]
UrlOption = Annotated[str | None, typer.Option(
    "--url", envvar=URL_ENV, help="Server url, e.g. tcp://127.0.0.1:5555 or ipc:///run/lmcache.sock.",
    show_default=False)]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Print one line on stderr and exit."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def config_from(path: Path | None, overrides: Mapping[str, Any] | None = None) -> LMCacheConfig:
    """Load the config or exit 2 with one line naming the file and key."""
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)


def print_json(data: Any) -> None:
    """JSON on stdout (bytes as hex), for scripts."""
    import msgspec

    def enc_hook(obj: Any) -> Any:
        if isinstance(obj, bytes):
            return obj.hex()
        raise NotImplementedError(type(obj))

    sys.stdout.write(msgspec.json.encode(data, enc_hook=enc_hook).decode() + "\n")
