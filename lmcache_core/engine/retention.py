"""Retention asked for by requests: TTLs, pins and priorities on pieces, and eviction's order.

A store may carry hints (vLLM's ``kv_transfer_params``: ``lmcache.ttl_s``, ``lmcache.pin``,
``lmcache.priority``). Eviction then takes expired pieces first, then lower priorities before higher
ones, least recently used first within a priority; it never takes a pinned piece before its TTL ends
or it is unpinned. Pins are bounded by ``max_pinned_bytes``: a pin past it is refused (counted and
reported), never silently dropped. Pieces stored again keep the longer TTL, the higher priority and
their pin. A pin without a TTL of its own (a store's, ``lmcache pin``'s) holds until unpinned, so it
drops the TTL a piece had; one with a TTL ends with it. Not thread-safe: the engine calls it under
its lock.

Without any hint in use the order is plain LRU at no extra cost; with some, eviction sorts a
snapshot of the index (O(pieces) per eviction pass).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from lmcache_core.engine.index import Piece, PieceIndex
from lmcache_core.keys import ChunkKey


@dataclass(frozen=True, slots=True)
class Retention:
    """A request's hints for the pieces it stores (all optional)."""

    ttl_s: float | None = None  # may be evicted first once this many seconds have passed
    pin: bool = False  # never evicted until this TTL ends (none: until unpinned)
    priority: int = 0  # lower priorities are evicted first

    @property
    def plain(self) -> bool:
        return self.ttl_s is None and not self.pin and self.priority == 0


PLAIN = Retention()


def _special(piece: Piece) -> bool:
    return piece.pinned or piece.priority != 0 or piece.expires != math.inf


class RetentionBook:
    """The pinned pieces and their bytes, and how many pieces carry any hint."""

    def __init__(self, max_pinned_bytes: int) -> None:
        self.max_pinned_bytes = max_pinned_bytes
        self.pinned: dict[ChunkKey, Piece] = {}
        self.pinned_bytes = 0
        self.special = 0  # pieces with a TTL, a pin or a priority

    def apply(self, piece: Piece, retention: Retention, now: float, fresh: bool,
              replace_ttl: bool | None = None) -> bool:
        """Give ``piece`` the hints (``fresh``: just stored, else the longer/higher wins; the TTL
        is replaced when ``replace_ttl``, by default when ``fresh``: a pin's own TTL); False when
        its pin was refused (``max_pinned_bytes``): it is kept unpinned."""
        if retention.plain:
            return True
        was = _special(piece)
        if retention.ttl_s is not None:
            until = now + retention.ttl_s
            replace = fresh if replace_ttl is None else replace_ttl
            piece.expires = until if replace else max(piece.expires, until)
        piece.priority = retention.priority if fresh else max(piece.priority, retention.priority)
        pinned = not retention.pin or self._pin(piece)
        if retention.pin and retention.ttl_s is None and piece.pinned:
            piece.expires = math.inf  # a pin of no TTL of its own holds until unpinned
        self.special += _special(piece) - was
        return pinned

    def keep(self, pieces: Iterable[Piece], retention: Retention, now: float) -> int:
        """A store found ``pieces`` already held: give them its hints (the longer/higher wins);
        how many of its pins were refused."""
        return sum(not self.apply(piece, retention, now, False) for piece in pieces)

    def unpin(self, piece: Piece) -> bool:
        """Unpin ``piece``; False when it was not pinned."""
        if not piece.pinned:
            return False
        self._unpin(piece)
        self.special -= not _special(piece)
        return True

    def _pin(self, piece: Piece) -> bool:
        if piece.pinned:
            return True
        if self.pinned_bytes + piece.nbytes > self.max_pinned_bytes:
            return False
        piece.pinned = True
        self.pinned[piece.key] = piece
        self.pinned_bytes += piece.nbytes
        return True

    def _unpin(self, piece: Piece) -> None:
        piece.pinned = False
        del self.pinned[piece.key]
        self.pinned_bytes -= piece.nbytes

    def forget(self, piece: Piece) -> None:
        """``piece`` left the index."""
        if piece.pinned:
            self.unpin(piece)
        if _special(piece):
            self.special -= 1

    def lapse(self, now: float) -> int:
        """Unpin the pinned pieces whose TTL ended; how many."""
        due = [piece for piece in self.pinned.values() if piece.expires <= now]
        for piece in due:
            self.unpin(piece)
        return len(due)


def pinned_now(piece: Piece, now: float) -> bool:
    """Whether ``piece`` is pinned and its pin has not lapsed: eviction never takes it."""
    return piece.pinned and piece.expires > now


def free_to_go(piece: Piece, now: float) -> bool:
    """Whether eviction may take ``piece`` now: not locked, not being read, not pinned."""
    return not piece.locks and not piece.readers and not pinned_now(piece, now)


def eviction_order(index: PieceIndex, book: RetentionBook, now: float) -> Iterator[Piece]:
    """Pieces in the order eviction considers them (callers skip those not ``free_to_go``)."""
    if not book.special:
        yield from index.lru.values()
        return
    pieces = list(index.lru.values())  # a snapshot: the caller evicts after choosing
    yield from (piece for piece in pieces if piece.expires <= now)
    # Lower priorities first, LRU within one: a stable sort keeps the LRU order of equals (one
    # pass, where a scan per priority level cost up to 201 passes over the index).
    yield from sorted((piece for piece in pieces if piece.expires > now), key=_priority)


def _priority(piece: Piece) -> int:
    return piece.priority
