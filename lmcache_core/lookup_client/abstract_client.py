"""``LookupClientInterface``: what every lookup client offers the scheduler (the seed's base class).

A lookup is started with ``lookup()`` and its answer read with ``lookup_cache()``; a synchronous
client may answer from ``lookup()`` itself, an asynchronous one returns None there and answers
later. ``close()`` releases the client's sockets and threads. Clients that keep per-lookup state
override ``clear_lookup_status`` (the scheduler used the answer) and ``cancel_lookup`` (the request
went away); the defaults keep nothing. Nothing here imports torch.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class LookupClientInterface(abc.ABC):
    """The scheduler's view of a lookup client: start a lookup, poll its answer, forget it, close."""

    @abc.abstractmethod
    def lookup(self, token_ids: torch.Tensor | list[int], lookup_id: str,
               request_configs: dict[str, Any] | None = None) -> int | None:
        """Look up the cached prefix of ``token_ids`` under ``lookup_id``.

        Returns the number of hit tokens, or None when the answer comes later through
        ``lookup_cache``."""

    @abc.abstractmethod
    def lookup_cache(self, lookup_id: str) -> int | None:
        """``-1``: no such lookup (never asked, cleared or cancelled); ``None``: still running;
        ``n >= 0``: hit tokens. Never blocks."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the client's resources; idempotent."""

    def clear_lookup_status(self, lookup_id: str) -> None:  # noqa: B027 - a no-op by default
        """Forget ``lookup_id``'s answer (the scheduler used it); a client without state has none."""

    def cancel_lookup(self, lookup_id: str) -> None:
        """The request is gone: forget its lookup (and release what it holds)."""
        self.clear_lookup_status(lookup_id)

    def supports_producer_reuse(self) -> bool:
        """Whether KV cache a producer stored can be found by later lookups (False unless said)."""
        return False
