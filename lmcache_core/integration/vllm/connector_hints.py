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

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lmcache_core.integration.vllm.connector_log import logger
from lmcache_core.protocol.messages import MAX_PRIORITY, MAX_TTL_S, MIN_PRIORITY, MIN_TTL_S

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


def _is_ttl(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and MIN_TTL_S <= value <= MAX_TTL_S)


def _is_priority(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            and MIN_PRIORITY <= value <= MAX_PRIORITY)


def _is_flag(value: Any) -> bool:
    return isinstance(value, bool)


#: Each hint: its key, what a valid value is, and what the warning says was expected.
_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (TTL, _is_ttl, f"a number of seconds in [{MIN_TTL_S:g}, {MAX_TTL_S:g}]"),
    (PIN, _is_flag, "true or false"),
    (PRIORITY, _is_priority, f"an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]"),
    (SKIP_STORE, _is_flag, "true or false"),
)


def parse_hints(params: Mapping[str, Any] | None) -> StoreHints:
    """The hints of a request's ``kv_transfer_params`` (``NO_HINTS`` when none apply). A value
    of the wrong type or range is ignored (logged once per key); None means "not given"."""
    if not params or not isinstance(params, Mapping):
        return NO_HINTS
    valid: dict[str, Any] = {}
    for key, is_valid, want in _CHECKS:
        value = params.get(key)
        if value is None:
            continue
        if is_valid(value):
            valid[key] = value
        else:
            _bad(key, value, want)
    ttl = valid.get(TTL)
    hints = StoreHints(None if ttl is None else float(ttl), valid.get(PIN, False),
                       valid.get(PRIORITY, 0), valid.get(SKIP_STORE, False))
    return NO_HINTS if hints == NO_HINTS else hints


def request_hints(request: Any) -> StoreHints:
    """The hints of a vLLM ``Request`` (its ``kv_transfer_params``, if any)."""
    return parse_hints(getattr(request, "kv_transfer_params", None))
