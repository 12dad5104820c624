"""Run ``lmcache serve`` with its requests and copies timestamped into a trace file.

Usage: python scripts/bench/server_trace.py TRACE_FILE serve -c CONFIG.yaml [more lmcache options]

A measuring tool beside ``scripts/bench/profile_hit.py --server-trace`` (which starts the server through
it and merges the trace into a hit's timeline): each line of TRACE_FILE is ``EVENT START END
THREAD CPU QUEUED DETAIL``, times in seconds of ``time.perf_counter``, which on Linux is
CLOCK_MONOTONIC and so the same clock in every process of the machine. Events:

- ``dispatch``: the loop thread took one request off the socket and answered or queued it (a lookup
  is answered there); DETAIL is the request's bytes;
- ``lookup``, ``store``, ``retrieve``: a handler ran (on the loop or a copy worker); DETAIL is the
  request's chunks;
- ``scatter``: one copy of a retrieve's chunks into a worker's blocks (chunk by chunk under a
  load deadline, else all at once); DETAIL is the chunks copied;
- ``send``: the loop thread sent a reply.

After THREAD come two times in ms: CPU, the thread's CPU time during the event
(``time.thread_time``; a copy stalled on memory counts as CPU), and QUEUED, its time runnable but
waiting for a core (the kernel's ``/proc/thread-self/schedstat``). Wall time beyond both is time
blocked (on the GIL, a lock). The wrappers cost tens of microseconds each (two file reads).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

ROOT = Path(__file__).resolve().parents[2]


def _run_delay_ns() -> float:
    """This thread's time so far waiting for a core while runnable (the kernel's schedstat); NaN
    where the kernel does not keep it, so the trace says "queued nan", never a false 0."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return float(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return math.nan


class LineSink(Protocol):
    """Where trace lines go: a file, or anything with its ``write``."""

    def write(self, line: str, /) -> object: ...


def timed(log: LineSink, event: str, function: Callable[..., Any],
          detail: Callable[..., object]) -> Callable[..., Any]:
    """``function`` writing one trace line a call: ``detail(result, *args)`` is its DETAIL (the
    result None when the call raised; the line is written either way)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        delay = _run_delay_ns()
        start, cpu = time.perf_counter(), time.thread_time()
        result = None
        try:
            result = function(*args, **kwargs)
            return result
        finally:
            end, cpu = time.perf_counter(), time.thread_time() - cpu
            try:
                words = detail(result, *args)
            except Exception as exc:  # a traced API that changed: the trace says so, the call stands
                words = f"detail-error={type(exc).__name__}"
            log.write(f"{event} {start:.6f} {end:.6f} {threading.get_ident()} {cpu * 1e3:.3f} "
                      f"{(_run_delay_ns() - delay) / 1e6:.3f} {words}\n")
    return wrapper


def install(log: TextIO) -> None:
    """Wrap the server's handlers and its loop's receive and send (before the server is built:
    the routes bind the handlers when it is)."""
    from lmcache_core.server.handlers import CacheHandlers
    from lmcache_core.transport.server import MessageQueueServer

    def chunks(_result: Any, _self: Any, request: Any, *_: Any) -> int:
        return len(getattr(request, "chunk_hashes", ()))

    for name in ("lookup", "store", "retrieve"):
        setattr(CacheHandlers, name, timed(log, name, getattr(CacheHandlers, name), chunks))
    CacheHandlers._scatter = staticmethod(timed(  # type: ignore[method-assign]
        log, "scatter", CacheHandlers._scatter,
        lambda _result, _reg, _plan, positions, _blocks: len(positions)))
    MessageQueueServer._dispatch = timed(  # type: ignore[method-assign]
        log, "dispatch", MessageQueueServer._dispatch,
        lambda _result, _self, _identity, frames: sum(len(f) for f in frames))
    MessageQueueServer._send = timed(  # type: ignore[method-assign]
        log, "send", MessageQueueServer._send, lambda _result, _self, frames: len(frames))


class TraceTail:
    """A trace file read as it grows: each ``new_events`` call parses only the whole lines
    written since the last one (a line the server is still writing waits for the next call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_events(self) -> list[tuple[float, str]]:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[:data.rfind(b"\n") + 1]
        self.offset += len(whole)
        return parse(whole.decode())


@dataclass(frozen=True)
class Event:
    """One trace line: a call's name, its wall time, the thread, its CPU and queued ms, and its
    DETAIL (``words``: its ``key=value`` words; ``size``: a number, the server's chunks or bytes)."""

    name: str
    start: float
    end: float
    thread: int
    cpu_ms: float
    queued_ms: float
    detail: str

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1e3

    @property
    def words(self) -> dict[str, str]:
        return dict(w.split("=", 1) for w in self.detail.split() if "=" in w)

    @property
    def size(self) -> int:
        return int(self.detail) if self.detail.isdigit() else 0


def read_events(text: str) -> list[Event]:
    """Trace lines as events (lines cut short by a crash are skipped)."""
    events = []
    for line in text.splitlines():
        parts = line.split(" ", 6)
        if len(parts) != 7:
            continue
        name, start, end, thread, cpu, queued, detail = parts
        events.append(Event(name, float(start), float(end), int(thread), float(cpu),
                            0.0 if queued == "nan" else float(queued), detail))
    return events


def parse(text: str) -> list[tuple[float, str]]:
    """Trace lines as ``(start, text)``, the text naming the wall, CPU and queued time; for
    ``profile_hit`` to merge into its timeline."""
    return [(e.start, f"server {e.name} ({e.detail}) {e.ms:.2f}ms cpu {e.cpu_ms:.2f}ms "
                      f"queued {e.queued_ms:.2f}ms thread {e.thread % 10000:04d}")
            for e in read_events(text)]


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    log = open(sys.argv[1], "a", buffering=1)  # noqa: SIM115 - open for the process's life
    sys.path.insert(0, str(ROOT))
    install(log)
    from lmcache_cli.main import run

    sys.argv = ["lmcache", *sys.argv[2:]]
    run()


if __name__ == "__main__":
    main()
