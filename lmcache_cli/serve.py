"""``lmcache serve``: run the KV-cache server in the foreground until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Annotated

import typer
from rich.panel import Panel

from lmcache_cli.common import EXIT_FAILURE, ConfigOption, UrlOption, config_from, console, fail


def serve(
    config: ConfigOption = None,
    url: UrlOption = None,
    chunk_size: Annotated[int | None, typer.Option(help="Tokens per chunk.",
                                                   show_default=False)] = None,
    pool_size: Annotated[str | None, typer.Option(help="Memory pool size, e.g. 4GiB.",
                                                  show_default=False)] = None,
    workers: Annotated[int | None, typer.Option(help="Copy threads for store/retrieve.",
                                                show_default=False)] = None,
    print_config: Annotated[bool, typer.Option(
        "--print-config", help="Print the merged config as YAML and exit.")] = False,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Start the KV-cache server (binds 127.0.0.1 by default).

    Example: lmcache serve -c configs/llama8b.yaml
    """
    cfg = config_from(config, {"server.url": url, "chunk_size": chunk_size,
                               "server.pool_size": pool_size, "server.workers": workers})
    if print_config:
        import msgspec
        import yaml

        console.print(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False), highlight=False)
        return
    _setup_logging(log_level)
    from lmcache_core import __version__
    from lmcache_core.errors import LMCacheError
    from lmcache_core.server.app import CacheServer

    try:
        server = CacheServer(cfg)
        bound = server.start()
    except LMCacheError as exc:
        fail(str(exc), EXIT_FAILURE)
    slots = server.pool.num_slots
    console.print(Panel.fit(
        f"[bold]lmcache serve[/] {__version__}\n"
        f"url         {bound}\nmodel       {cfg.model.name} (world size {cfg.world_size})\n"
        f"chunk size  {cfg.chunk_size} tokens = {_mib(cfg.chunk_bytes)}\n"
        f"pool        {_mib(server.pool.nbytes)} = {slots} chunks, {cfg.server.eviction} eviction",
        title="ready", border_style="green"), highlight=False)
    _run_until_signal(server)


def _run_until_signal(server: object) -> None:
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger("lmcache").info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop.wait(0.5):  # the main thread only waits for a signal; the server runs on its own
        pass
    server.stop()  # type: ignore[attr-defined]


def _setup_logging(level: str) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=level.upper(), format="%(name)s: %(message)s", datefmt="%H:%M:%S",
                        handlers=[RichHandler(console=console, show_path=False)])


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
