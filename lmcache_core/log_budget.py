"""``LogBudget``: how a component rations its log lines, so that a flood of bad frames or failing
writes costs a few lines, not one each (the socket loop, the lookup server, the HTTP listener, the
remote tier). Imports the standard library alone: any layer may use it."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any


class LogBudget:
    """At most ``lines`` log lines per ``window_s`` for one kind of event; the rest are counted and
    the count is told with the next line let through. ``log`` writes to ``logger`` (default: this
    module's)."""

    def __init__(self, lines: int = 20, window_s: float = 10.0,
                 logger: logging.Logger | None = None) -> None:
        self._logger = logger if logger is not None else logging.getLogger(__name__)
        self._lines = lines
        self._window_s = window_s
        self._lock = threading.Lock()
        self._window_start = 0.0
        self._used = 0
        self._suppressed = 0

    def take(self) -> int | None:
        """None when this line must be dropped; else how many were dropped before it."""
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= self._window_s:
                self._window_start, self._used = now, 0
            if self._used >= self._lines:
                self._suppressed += 1
                return None
            self._used += 1
            suppressed, self._suppressed = self._suppressed, 0
            return suppressed

    def log(self, level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
        """Log one line if the budget lets it through, telling how many were dropped before it."""
        suppressed = self.take()
        if suppressed is None:
            return
        if suppressed:
            msg += f" ({suppressed} similar line(s) suppressed before this one)"
        self._logger.log(level, msg, *args, exc_info=exc_info)
