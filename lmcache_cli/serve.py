"""``lmcache serve``: run the KV-cache server in the foreground until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.panel import Panel

from lmcache_cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    ConfigOption,
    UrlOption,
    config_from,
    console,
    fail,
    human_bytes,
    user_errors,
)
from lmcache_cli.config_flags import merge, parse_sets, with_config_flags
from lmcache_core.errors import ConfigError

if TYPE_CHECKING:
    from lmcache_core.server.app import CacheServer


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


@with_config_flags
def serve(
    config: ConfigOption = None,
    url: UrlOption = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KEY=VALUE",
        help="Override any config key, e.g. --set timeouts.lock_ttl_s=60 (repeatable).",
        show_default=False)] = None,
    print_config: Annotated[bool, typer.Option(
        "--print-config", help="Print the merged config as YAML and exit.")] = False,
    log_level: Annotated[LogLevel, typer.Option(help="Log level.", case_sensitive=False)
                         ] = LogLevel.info,
    config_overrides: dict[str, Any] | None = None,
) -> None:
    """Start the KV-cache server (binds 127.0.0.1 by default); every config key has a flag.

    Stops cleanly (exit 0) on SIGINT or SIGTERM. If one of its threads dies it exits with code 1
    within a second, so that a supervisor (systemd, Kubernetes) restarts it.

    Example: [cyan]lmcache serve -c configs/llama8b.yaml --pool-size 16GiB[/]
    """
    try:
        sets = parse_sets(set_ or [])
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    cfg = config_from(config, merge(sets, config_overrides, {"server.url": url}))
    if print_config:
        import msgspec
        import yaml

        sys.stdout.write(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))
        sys.stdout.flush()
        return
    _setup_logging(log_level.value)
    from lmcache_core import __version__
    from lmcache_core.server.app import CacheServer, one_thread_per_copy

    one_thread_per_copy()
    with user_errors():
        server = CacheServer(cfg)
        bound = server.start()
    http = (f"{server.http_url}/metrics, /healthz, /readyz" if server.http_url is not None
            else "off (server.http_url)")
    quotas = _quotas(cfg.server.quota_bytes)
    tenant_quotas = _quotas({label: size for label, (_salt, size)
                             in cfg.server.tenant_quota_bytes.items()})
    console.print(Panel.fit(
        f"[bold]lmcache serve[/] {__version__}\n"
        f"url         {bound}\n"
        f"models      any model, dtype and world size, in one pool (each worker's KV shape comes "
        f"with its registration)\n"
        f"chunk size  {cfg.chunk_size} tokens\n"
        f"pool        {_pool_line(server)}, {cfg.server.eviction} eviction\n"
        + (f"quotas      {quotas}\n" if quotas else "")
        + (f"tenants     {tenant_quotas} (server.tenant_quotas, by label)\n"
           if tenant_quotas else "")
        + f"http        {http}\n"
        f"pool pages  {_pool_pages(server)}",
        title="ready", border_style="green"), highlight=False)
    _run_until_signal(server)


def _pool_line(server: CacheServer) -> str:
    """The pool's byte budget and its allocation units (slabs: what a new piece size costs
    others at most, beyond its own bytes)."""
    pool = server.pool
    slabs = f"{pool.num_slabs} slab{'s' if pool.num_slabs != 1 else ''}"
    return f"{human_bytes(pool.nbytes)} = {slabs} of {human_bytes(pool.slab_bytes)}"


def _quotas(quotas: dict[str, int]) -> str:
    """``model-a 2.0 GiB, model-b 512.0 MiB`` (models' or tenants' quotas), or "" for none."""
    from rich.markup import escape

    return ", ".join(f"{escape(name)} {human_bytes(size)}" for name, size in sorted(quotas.items()))


def _pool_pages(server: CacheServer) -> str:
    """How the pool's pages get mapped, and the process's RSS now (the populate's own end, with
    its time, is logged and in SERVER_INFO)."""
    from lmcache_core.storage.pool import process_rss_bytes

    pool = server.pool
    if pool.pinned:
        how = "pinned (resident)"
    elif pool.pin_failed:
        how = "NOT pinned: pinning failed (see the log), GPU copies are slower and synchronous"
    elif server.config.server.prefault:
        how = "populating in the background"
    else:
        how = "mapped on first write (server.prefault: false)"
    return f"{how}; RSS {human_bytes(process_rss_bytes())}"


#: After a thread died: how long a stop may take before the process is ended regardless.
_FAILED_EXIT_S = 0.9


def _run_until_signal(server: CacheServer) -> None:
    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger("lmcache").info("received %s, stopping", signal.Signals(signum).name)
        server.request_stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not server.wait(1.0):  # the main thread only waits; the server runs on its own threads
        pass
    if server.failure is None:
        server.stop()
        return
    # A thread died: exit non-zero within a second, whatever state the rest is in.
    backstop = threading.Timer(_FAILED_EXIT_S, os._exit, args=(EXIT_FAILURE,))
    backstop.daemon = True
    backstop.start()
    server.stop(drain_timeout_s=0.2)
    fail(f"the server stopped because {server.failure}", EXIT_FAILURE)


def _setup_logging(level: str) -> None:
    from rich.console import Console
    from rich.logging import RichHandler

    # A console of its own: a log line fills its console's width, and the shared console is
    # thousands of columns wide when piped (common.PIPED_WIDTH) so that tables are never cut.
    logging.basicConfig(level=level.upper(), format="%(name)s: %(message)s", datefmt="%H:%M:%S",
                        handlers=[RichHandler(console=Console(), show_path=False)])

