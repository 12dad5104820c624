"""Per-request retention hints read from vLLM's ``kv_transfer_params``.

A request may carry (e.g. in the OpenAI API's ``kv_transfer_params``, or ``SamplingParams(
extra_args={"kv_transfer_params": {...}})``):

- ``lmcache.ttl_s`` (number, 0 < ttl <= 30 days): its chunks are kept at least this long before
  others are evicted (and are evicted first once it has passed);
- ``lmcache.pin`` (bool): its chunks are not evicted until the TTL ends (if any) or they are
  unpinned; pins are bounded by the server's ``server.max_pinned``;
- ``lmcache.priority`` (int, -100..100, default 0): lower priorities are evicted first;
- ``lmcache.skip_store`` (bool): the request's chunks are never stored (lookups and loads still run).

Values of the wrong type or out of range are ignored (logged once per key); keys outside the
``lmcache.`` namespace are other connectors' and are ignored, as are unknown ``lmcache.`` keys.
Part of :mod:`.lmcache_connector`; imports no vLLM.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcache_core.protocol.messages import MAX_PRIORITY, MAX_TTL_S, MIN_PRIORITY, MIN_TTL_S

# The connector's one logger, so logging configured for it applies.
logger = logging.getLogger("lmcache_core.integration.vllm.lmcache_connector")

PREFIX = "lmcache."
TTL, PIN, PRIORITY, SKIP_STORE = (f"{PREFIX}{k}" for k in ("ttl_s", "pin", "priority", "skip_store"))


@dataclass(frozen=True)
class StoreHints:
    """What a request asks of its stores."""

    ttl_s: float | None = None
    pin: bool = False
    priority: int = 0
    skip_store: bool = False


NO_HINTS = StoreHints()
#: Keys whose bad values were logged already (each is logged once per process).
_logged: set[str] = set()


def _bad(key: str, value: Any, want: str) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.warning("lmcache: kv_transfer_params %s=%r ignored: expected %s (logged once)",
                       key, _short(value), want)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}..."


def parse_hints(params: Mapping[str, Any] | None) -> StoreHints:
    """The hints of a request's ``kv_transfer_params`` (``NO_HINTS`` when none apply)."""
    if not params or not isinstance(params, Mapping):
        return NO_HINTS
    ttl_s: float | None = None
    pin = skip = False
    priority = 0
    if TTL in params:
        value = params[TTL]
        if (isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value) and MIN_TTL_S <= value <= MAX_TTL_S):
            ttl_s = float(value)
        elif value is not None:
            _bad(TTL, value, f"a number of seconds in [{MIN_TTL_S:g}, {MAX_TTL_S:g}]")
    if PIN in params:
        value = params[PIN]
        if isinstance(value, bool):
            pin = value
        elif value is not None:
            _bad(PIN, value, "true or false")
    if PRIORITY in params:
        value = params[PRIORITY]
        if isinstance(value, int) and not isinstance(value, bool) and (
                MIN_PRIORITY <= value <= MAX_PRIORITY):
            priority = value
        elif value is not None:
            _bad(PRIORITY, value, f"an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
    if SKIP_STORE in params:
        value = params[SKIP_STORE]
        if isinstance(value, bool):
            skip = value
        elif value is not None:
            _bad(SKIP_STORE, value, "true or false")
    hints = StoreHints(ttl_s, pin, priority, skip)
    return NO_HINTS if hints == NO_HINTS else hints


def request_hints(request: Any) -> StoreHints:
    """The hints of a vLLM ``Request`` (its ``kv_transfer_params``, if any)."""
    return parse_hints(getattr(request, "kv_transfer_params", None))
