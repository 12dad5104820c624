"""``lmcache ping``: a health probe. Exit 0 healthy, 1 unreachable, 2 bad usage."""

from __future__ import annotations

import statistics
import time
from typing import Annotated

import typer

from lmcache_cli.common import (
    EXIT_FAILURE,
    ConfigOption,
    JsonOption,
    UrlOption,
    config_from,
    console,
    fail,
    print_json,
)
from lmcache_core.config_parse import MAX_TIMEOUT_S


def ping(
    config: ConfigOption = None,
    url: UrlOption = None,
    count: Annotated[int, typer.Option("--count", "-n", min=1, help="Round trips to time.")] = 1,
    timeout: Annotated[float | None, typer.Option(
        min=0.001, max=MAX_TIMEOUT_S, metavar="SECONDS",
        help="Seconds to wait for each answer, at most a day (default: the config's "
        "timeouts.connect_s).",
        show_default=False)] = None,
    as_json: JsonOption = False,
) -> None:
    """Check that a server answers, and how fast: exit 0 healthy, 1 unreachable, 2 bad usage.

    Example: [cyan]lmcache ping --url tcp://127.0.0.1:5555 --count 10[/]
    """
    from lmcache_core.errors import LMCacheError
    from lmcache_core.transport.client import MessageQueueClient

    cfg = config_from(config, {"server.url": url})
    wait_s = timeout if timeout is not None else cfg.timeouts.connect_s
    rtts: list[float] = []
    try:
        with MessageQueueClient(cfg.server.url, connect_timeout_s=wait_s, request_timeout_s=wait_s,
                                name="lmcache-ping") as client:
            for _ in range(count):
                start = time.perf_counter()
                reply = client.wait_until_reachable(wait_s)
                rtts.append((time.perf_counter() - start) * 1e3)
    except LMCacheError as exc:
        if as_json:
            print_json({"ok": False, "url": cfg.server.url, "error": str(exc)})
        fail(str(exc), EXIT_FAILURE)
    summary = {"ok": True, "url": cfg.server.url, "version": reply.version,
               "chunk_size": reply.chunk_size, "uptime_s": round(reply.uptime_s, 3),
               "pid": reply.pid, "count": count, "rtt_ms_min": round(min(rtts), 3),
               "rtt_ms_median": round(statistics.median(rtts), 3),
               "rtt_ms_max": round(max(rtts), 3)}
    if as_json:
        print_json(summary)
        return
    rtt = (f"{rtts[0]:.2f} ms" if count == 1 else
           f"min {min(rtts):.2f} / median {statistics.median(rtts):.2f} / max {max(rtts):.2f} ms")
    console.print(f"[green]ok[/] {cfg.server.url}: rtt {rtt}, version {reply.version}, "
                  f"chunk size {reply.chunk_size}, uptime {reply.uptime_s:.1f}s", highlight=False)
