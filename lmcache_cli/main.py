"""The ``lmcache`` command: a thin Typer app; each command lives in its own module.

Exit codes everywhere: 0 ok, 1 a failure at run time (server unreachable, error reply, failed
verification), 2 bad usage (flags, config, input files). Errors are one line on stderr. Importing
this module (and running ping, lookup, pin, unpin, inspect-chunks) never imports torch.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from lmcache_cli import bench_serve as bench_serve_cmd
from lmcache_cli import inspect_chunks as inspect_cmd
from lmcache_cli import lookup as lookup_cmd
from lmcache_cli import pin as pin_cmd
from lmcache_cli import ping as ping_cmd
from lmcache_cli import serve as serve_cmd
from lmcache_cli import stats as stats_cmd
from lmcache_cli import store_bench as bench_cmd
from lmcache_cli.common import EXIT_FAILURE, EXIT_USAGE, error_line
from lmcache_core import __version__
from lmcache_core.errors import ConfigError, LMCacheError

app = typer.Typer(
    name="lmcache",
    help="KV-cache server and toolkit for LLM serving beside vLLM.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("serve")(serve_cmd.serve)
app.command("ping")(ping_cmd.ping)
app.command("lookup")(lookup_cmd.lookup)
app.command("inspect-chunks")(inspect_cmd.inspect_chunks)
app.command("pin")(pin_cmd.pin)
app.command("unpin")(pin_cmd.unpin)
app.command("stats")(stats_cmd.stats)
app.command("store-bench")(bench_cmd.store_bench)
bench_app = typer.Typer(
    name="bench", help="Benchmarks of what serves beside lmcache: [bold]serve[/] drives an "
    "OpenAI-compatible endpoint under load.", no_args_is_help=True, rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]})
bench_app.command("serve")(bench_serve_cmd.serve)
app.add_typer(bench_app)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lmcache {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """KV-cache server and toolkit for LLM serving beside vLLM.

    Every command takes [bold]-c/--config[/] FILE (YAML, see configs/) and [bold]--url[/]
    (or LMCACHE_URL). Exit codes: 0 ok, 1 failure, 2 bad usage.

    Example: [cyan]lmcache serve -c configs/tiny.yaml &  lmcache ping -c configs/tiny.yaml[/]
    """


def run() -> None:
    """Entry point: the app, with lmcache's errors as one line on stderr (never a traceback)."""
    try:
        app()
    except ConfigError as exc:
        error_line(str(exc))
        sys.exit(EXIT_USAGE)
    except LMCacheError as exc:
        error_line(str(exc))
        sys.exit(EXIT_FAILURE)
