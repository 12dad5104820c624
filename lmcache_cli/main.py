"""The ``lmcache`` command: a thin Typer app; each command lives in its own module."""

from __future__ import annotations

from typing import Annotated

import typer

from lmcache_cli import ping as ping_cmd
from lmcache_cli import serve as serve_cmd
from lmcache_core import __version__

app = typer.Typer(
    name="lmcache",
    help="KV-cache server and toolkit for LLM serving beside vLLM.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
app.command("serve")(serve_cmd.serve)
app.command("ping")(ping_cmd.ping)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lmcache {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """KV-cache server and toolkit for LLM serving beside vLLM."""


def run() -> None:
    app()
