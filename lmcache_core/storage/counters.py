"""``Counters``: the base of the tiers' counter dataclasses, safe to add to from several threads.

``x.n += 1`` on an attribute is a read, an add and a write: two threads (a tier's writer and a
lookup on a worker thread) can interleave them and lose a count. ``add`` does it under one lock,
``snapshot`` reads every counter at once under it.
"""

from __future__ import annotations

import threading
from dataclasses import asdict

_LOCK = threading.Lock()  # one for all: adds are rare and tiny next to the I/O they count


class Counters:
    """Mixed into a ``@dataclass(slots=True)`` of int fields."""

    __slots__ = ()

    def add(self, **deltas: int) -> None:
        """Add each ``name=delta`` to its counter, atomically."""
        with _LOCK:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        """Every counter by name, read at one moment."""
        with _LOCK:
            return asdict(self)  # type: ignore[call-overload]
