"""``LMCacheConnector`` with its calls timestamped into trace files: ``TracedLMCacheConnector``.

A measuring tool for ``profile_serve.py``, which runs ``vllm serve`` with it (its
``--kv-transfer-config`` names this module, found on the engine's ``PYTHONPATH``) beside a
``lmcache serve`` traced by ``server_trace.py``. ``LMCACHE_CONNECTOR_TRACE`` names a folder; each
process that makes a connector writes ``connector-<pid>.trace`` there, one line a call in
``server_trace``'s format (``EVENT START END THREAD CPU QUEUED DETAIL``, times of
``time.perf_counter``, CLOCK_MONOTONIC, the server's clock too). Events and their DETAIL
(``key=value`` words; a request is its vLLM id):

- scheduler side: ``lookup`` (``get_num_new_matched_tokens``: ``req computed hit async``, hit
  ``None`` while the server's answer is out), ``may_load`` (``req yes``), ``alloc``
  (``update_state_after_alloc``: ``req external``), ``meta`` (``build_connector_meta``: the step:
  ``idle tokens`` scheduled, ``loads`` and ``stores`` as ``req:chunks[:s]`` lists, ``s`` a
  synchronous load), ``finished`` (``req``);
- worker side: ``bind`` (a step's first call, before its forward pass), ``start_load`` (before
  the forward pass with a synchronous load, which it waits for; else after it), ``save``
  (``wait_for_save``: the step's stores submitted), ``results`` (``get_finished``: ``sent`` and
  ``recv`` request lists).

A method is wrapped once where it is defined, so a call through another wrapped one is not counted
twice. The wrappers cost tens of microseconds a call.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_trace import timed

from lmcache_core.integration.vllm.lmcache_connector import LMCacheConnector

ENV = "LMCACHE_CONNECTOR_TRACE"


class _TraceFile:
    """This process's trace file, opened by its first line (importing the module writes
    nothing, and a process forked after that opens its own)."""

    def __init__(self) -> None:
        self._file: TextIO | None = None
        self._pid = 0

    def write(self, line: str) -> None:
        if self._file is None or self._pid != os.getpid():
            folder = Path(os.environ[ENV])
            folder.mkdir(parents=True, exist_ok=True)
            self._pid = os.getpid()
            self._file = (folder / f"connector-{self._pid}.trace").open("a", buffering=1)
        self._file.write(line)


def _ids(requests: Any) -> str:
    return ",".join(sorted(requests or ())) or "-"


def _specs(specs: Any, sync: bool) -> str:
    return ",".join(f"{s.request_id}:{len(s.chunk_hashes)}{':s' if sync and s.sync else ''}"
                    for s in specs) or "-"


def _lookup(result: Any, _self: Any, request: Any, computed: int) -> str:
    hit, is_async = result if result is not None else (None, False)
    return f"req={request.request_id} computed={computed} hit={hit} async={int(is_async)}"


def _meta(meta: Any, _self: Any, scheduler_output: Any) -> str:
    if meta is None:
        return "error"
    tokens = sum(scheduler_output.num_scheduled_tokens.values())
    return (f"idle={int(meta.idle)} tokens={tokens} loads={_specs(meta.loads, True)} "
            f"stores={_specs(meta.stores, False)}")


def _bound(self: Any) -> Any:
    return self._connector_metadata if self.has_connector_metadata() else None


def _start_load(_result: Any, self: Any, *_: Any) -> str:
    meta = _bound(self)
    return "-" if meta is None else f"loads={_specs(meta.loads, True)}"


def _save(_result: Any, self: Any) -> str:
    meta = _bound(self)
    return "-" if meta is None else f"stores={_specs(meta.stores, False)}"


def _results(result: Any, *_: Any) -> str:
    if result is None:
        return "sent=- recv=-"
    sent, received = result
    return f"sent={_ids(sent)} recv={_ids(received)}"


WRAPPED = {
    "get_num_new_matched_tokens": ("lookup", _lookup),
    "may_load_async": ("may_load", lambda r, _s, request: f"req={request.request_id} yes={int(bool(r))}"),
    "update_state_after_alloc": ("alloc", lambda _r, _s, request, _b, n: f"req={request.request_id} "
                                                                        f"external={n}"),
    "build_connector_meta": ("meta", _meta),
    "request_finished": ("finished", lambda _r, _s, request, _b: f"req={request.request_id}"),
    "bind_connector_metadata": ("bind", lambda _r, _s, meta: f"idle={int(meta.idle)}"),
    "start_load_kv": ("start_load", _start_load),
    "wait_for_save": ("save", _save),
    "get_finished": ("results", _results),  # vLLM 0.34's get_transfer_results calls it
}


class TracedLMCacheConnector(LMCacheConnector):
    """``LMCacheConnector``, each call of ``WRAPPED`` written to this process's trace file."""


def _install() -> None:
    log = _TraceFile()
    for name, (event, detail) in WRAPPED.items():
        if name in vars(TracedLMCacheConnector):
            continue
        owner = next((klass for klass in LMCacheConnector.__mro__ if name in vars(klass)), None)
        if owner is None:  # a method this vLLM's connector does not have
            continue
        setattr(TracedLMCacheConnector, name, timed(log, event, vars(owner)[name], detail))


_install()
