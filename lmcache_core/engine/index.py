"""The engine's index: resident pieces by key, by chunk and by pool handle, in LRU order.

A chunk ``(model, layout, chunk hash)`` is held as pieces (``ChunkKey``), each covering a range of
KV heads. ``cover`` picks the pieces that together hold a head range, which is what a lookup counts
and a retrieve copies from. Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from lmcache_core.engine.lifecycle import State
from lmcache_core.keys import ChunkKey, HeadRange, first_needed_chunk

ChunkId = tuple[str, str, bytes]  # (model, layout, chunk hash): ``ChunkKey.chunk``


class Piece:
    """One resident piece: where it lives in the pool and who holds it."""

    __slots__ = ("checksum", "created", "expires", "handle", "hits", "key", "locks", "nbytes",
                 "pinned", "priority", "readers", "state", "tenant")

    def __init__(self, key: ChunkKey, handle: int, nbytes: int, created: float,
                 checksum: int = 0, tenant: str = "", state: State = State.RESIDENT) -> None:
        self.state = state  # where it is in its lifecycle (``lifecycle``: only ``advance`` moves it)
        self.key = key
        self.handle = handle
        self.nbytes = nbytes
        self.created = created
        # xxh3-64 of its bytes, taken right after its store's copy (``storage.integrity``: NONE,
        # none recorded; PENDING, being taken, the hash holding it as a reader; ABANDONED).
        self.checksum = checksum
        self.tenant = tenant  # the cache_salt tenant that stored it (``keys.tenant_tag``; "": none)
        self.locks = 0  # (lookup id, head range) pairs holding it for a coming retrieve
        self.readers = 0  # retrieves, tier writers and its hash reading it right now
        self.hits = 0
        # Retention asked for by the requests that stored it (``plans.Retention``): evicted
        # after ``expires`` first; never while ``pinned`` (until ``expires``); lower ``priority``
        # before higher, LRU within one.
        self.expires = math.inf
        self.pinned = False
        self.priority = 0


def cover(pieces: Sequence[Piece], lo: int, hi: int) -> list[Piece] | None:
    """The pieces that together hold heads ``[lo, hi)``, fewest first-found; None if some head
    is missing. One piece holding the whole range is taken when there is one."""
    for piece in pieces:
        key = piece.key
        if key.head_lo <= lo and key.head_hi >= hi:
            return [piece]
    chosen: list[Piece] = []
    at = lo
    while at < hi:
        best: Piece | None = None
        for piece in pieces:
            key = piece.key
            if key.head_lo <= at < key.head_hi and (best is None or key.head_hi > best.key.head_hi):
                best = piece
        if best is None:
            return None
        chosen.append(best)
        at = best.key.head_hi
    return chosen


class Tally:
    """Pieces and bytes per name (a model, a tenant tag); a name with none left is dropped."""

    __slots__ = ("bytes", "pieces")

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.pieces: dict[str, int] = {}

    def add(self, name: str, nbytes: int) -> None:
        self.bytes[name] = self.bytes.get(name, 0) + nbytes
        self.pieces[name] = self.pieces.get(name, 0) + 1

    def remove(self, name: str, nbytes: int) -> None:
        left = self.pieces[name] - 1
        if left:
            self.pieces[name] = left
            self.bytes[name] -= nbytes
        else:
            del self.pieces[name]
            del self.bytes[name]

    def counts(self) -> dict[str, tuple[int, int]]:
        return {name: (count, self.bytes[name]) for name, count in self.pieces.items()}


class PieceIndex:
    """Resident pieces: by key (in LRU order, front = least recently used), by chunk, by handle,
    with bytes per model and per tenant (quotas and their figures)."""

    def __init__(self) -> None:
        self.lru: OrderedDict[ChunkKey, Piece] = OrderedDict()
        self.chunks: dict[ChunkId, list[Piece]] = {}
        self.by_handle: dict[int, Piece] = {}
        self.models = Tally()
        self.tenants = Tally()  # per tenant tag (pieces of no tenant: not kept)
        # Per model, its pieces per tenant tag (as ``tenants``): which tenants hold a model
        # (``lmcache lookup --explain``), without a walk over its pieces.
        self.model_tenants: dict[str, Tally] = {}
        self.layout_chunks: dict[tuple[str, str], int] = {}  # (model, layout) -> chunks held
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.lru)

    def __iter__(self) -> Iterator[Piece]:
        return iter(self.lru.values())

    def get(self, key: ChunkKey) -> Piece | None:
        return self.lru.get(key)

    def pieces(self, chunk: ChunkId) -> list[Piece]:
        return self.chunks.get(chunk, [])

    def covering(self, key: ChunkKey) -> list[Piece] | None:
        """The resident pieces that hold ``key``'s heads (``cover``); None if some head is not."""
        pieces = self.chunks.get(key.chunk)
        return cover(pieces, key.head_lo, key.head_hi) if pieces else None

    def add(self, piece: Piece) -> None:
        """Index a committed piece as the most recently used."""
        key = piece.key
        self.lru[key] = piece
        siblings = self.chunks.get(key.chunk)
        if siblings is None:
            siblings = self.chunks[key.chunk] = []
            pair = (key.model_name, key.layout)
            self.layout_chunks[pair] = self.layout_chunks.get(pair, 0) + 1
        siblings.append(piece)
        self.by_handle[piece.handle] = piece
        self.models.add(key.model_name, piece.nbytes)
        if piece.tenant:
            self.tenants.add(piece.tenant, piece.nbytes)
            self.model_tenants.setdefault(key.model_name, Tally()).add(piece.tenant, piece.nbytes)
        self.nbytes += piece.nbytes

    def remove(self, piece: Piece) -> None:
        key = piece.key
        del self.lru[key]
        del self.by_handle[piece.handle]
        siblings = self.chunks[key.chunk]
        siblings.remove(piece)
        if not siblings:
            del self.chunks[key.chunk]
            pair = (key.model_name, key.layout)
            self.layout_chunks[pair] -= 1
            if not self.layout_chunks[pair]:
                del self.layout_chunks[pair]
        self.models.remove(key.model_name, piece.nbytes)
        if piece.tenant:
            self.tenants.remove(piece.tenant, piece.nbytes)
            of_model = self.model_tenants[key.model_name]
            of_model.remove(piece.tenant, piece.nbytes)
            if not of_model.pieces:
                del self.model_tenants[key.model_name]
        self.nbytes -= piece.nbytes

    def touch(self, piece: Piece) -> None:
        self.lru.move_to_end(piece.key)

    def model_counts(self) -> dict[str, tuple[int, int]]:
        """Per model: (pieces, bytes)."""
        return self.models.counts()

    def tenant_counts(self) -> dict[str, tuple[int, int]]:
        """Per tenant tag: (pieces, bytes)."""
        return self.tenants.counts()


#: A (model, layout) pair: the chunks of one engine shape under one model name.
Pair = tuple[str, str]


class Holder(NamedTuple):
    """Where a probed chunk hash is held (``lmcache lookup --explain``): probe ``probe`` of the
    request, under ``model_name`` and ``layout``, in ``tier``, as pieces of the head ranges
    ``ranges``, stored for the tenant tags ``tenants``."""

    probe: int
    model_name: str
    layout: str
    tier: str
    ranges: tuple[HeadRange, ...]
    tenants: tuple[str, ...] = ()


def find_holders(index: PieceIndex, pairs: Sequence[Pair], chunk_hashes: Sequence[bytes],
                 tier: str) -> list[Holder]:
    """The ``pairs`` that hold each of ``chunk_hashes``: one dict look-up per pair and hash."""
    chunks_of = index.chunks.get
    out: list[Holder] = []
    for model_name, layout in pairs:
        for probe, chunk_hash in enumerate(chunk_hashes):
            pieces = chunks_of((model_name, layout, chunk_hash))
            if pieces:
                ranges = sorted({(p.key.head_lo, p.key.head_hi) for p in pieces})
                tenants = sorted({p.tenant for p in pieces if p.tenant})
                out.append(Holder(probe, model_name, layout, tier, tuple(ranges), tuple(tenants)))
    return out


#: Per head range, per chunk (in prefix order), the pieces covering it: the shape a lookup's
#: locks are kept in (``locks.LockSet.held``), so a locking lookup hands it over as it is.
Held = dict[HeadRange, dict[ChunkId, list[Piece]]]


class Hits:
    """What a lookup found: ``count`` leading chunks covered for every range, and their pieces
    (``held``; a chunk named twice in the request is there once)."""

    __slots__ = ("count", "held")

    def __init__(self, count: int, held: Held) -> None:
        self.count = count
        self.held = held

    def pieces(self) -> list[Piece]:
        """Every piece found, once."""
        found = {piece.handle: piece for chunks in self.held.values()
                 for pieces in chunks.values() for piece in pieces}
        return list(found.values())


def find_hits(index: PieceIndex, model_name: str, layout: str, ranges: Sequence[HeadRange],
              chunk_hashes: Sequence[bytes]) -> Hits:
    """The leading chunks whose pieces cover every range, with those pieces. (The scheduler's
    hot path: one range, one piece per chunk is the common case, checked before ``cover``.)"""
    if len(ranges) != 1:
        return _find_hits_ranges(index, model_name, layout, ranges, chunk_hashes)
    chunks_of = index.chunks.get
    heads = ranges[0]
    lo, hi = heads
    found: dict[ChunkId, list[Piece]] = {}
    count = 0
    for chunk_hash in chunk_hashes:
        chunk = (model_name, layout, chunk_hash)
        pieces = chunks_of(chunk)
        if not pieces:
            break
        key = pieces[0].key
        if key.head_lo <= lo and key.head_hi >= hi:
            found[chunk] = [pieces[0]]  # a new list: the index's own changes with stores
        else:
            covering = cover(pieces, lo, hi)
            if covering is None:
                break
            found[chunk] = covering
        count += 1
    return Hits(count, {heads: found} if found else {})


def _find_hits_ranges(index: PieceIndex, model_name: str, layout: str,
                      ranges: Sequence[HeadRange], chunk_hashes: Sequence[bytes]) -> Hits:
    """``find_hits`` for several ranges (a lookup for world size > 1). The same walk as its
    one-range loop, kept apart on purpose: that loop is every TP=1 lookup's hot path (the first
    piece checked inline, no per-range lists; 64-chunk lookups took half the time)."""
    chunks_of = index.chunks.get
    held: Held = {}
    count = 0
    for chunk_hash in chunk_hashes:
        chunk = (model_name, layout, chunk_hash)
        pieces = chunks_of(chunk)
        if not pieces:
            break
        covers: list[list[Piece]] = []
        for lo, hi in ranges:
            covering = cover(pieces, lo, hi)
            if covering is None:
                return Hits(count, held)
            covers.append(covering)
        for heads, covering in zip(ranges, covers, strict=True):
            held.setdefault(heads, {})[chunk] = covering
        count += 1
    return Hits(count, held)


class GroupTarget(NamedTuple):
    """One KV-cache group as a lookup counts it (a model of one layout is one full-attention
    group: ``GroupTarget(layout, ranges)``): its layout fingerprint, every rank's head range in
    it, and the chunks resuming at a boundary ``N`` needs of it (``keys.group_piece``): all of
    ``[0, N)`` for full attention (``window_chunks`` 0, no ``local_blocks``);
    ``[max(0, N - wc), N)`` for a sliding window (and Mamba state); for chunked-local attention
    of ``local_blocks`` blocks an attention chunk (``blocks_per_chunk`` a chunk), those from the
    one its attention chunk at ``N`` starts in (``keys.local_start``: none when ``N`` starts
    one)."""

    layout: str
    ranges: tuple[HeadRange, ...]
    window_chunks: int = 0
    local_blocks: int = 0
    blocks_per_chunk: int = 1

    @property
    def full(self) -> bool:
        """Whether resuming needs every chunk before the boundary (full attention)."""
        return not self.window_chunks and not self.local_blocks


#: Per chunk of a prefix, the pieces covering each range (in ``ranges`` order), None if one is not.
_Covers = list[list[list[Piece]] | None]


def _group_covers(index: PieceIndex, model_name: str, group: GroupTarget,
                  chunk_hashes: Sequence[bytes], stop_at_miss: bool) -> _Covers:
    """Each chunk's covering pieces in ``group`` (for full attention only the covered prefix:
    ``stop_at_miss``). The one-range case checks the first piece inline, as ``find_hits``."""
    chunks_of = index.chunks.get
    layout, ranges = group.layout, group.ranges
    lo, hi = ranges[0]
    single = len(ranges) == 1
    out: _Covers = []
    append = out.append
    for chunk_hash in chunk_hashes:
        pieces = chunks_of((model_name, layout, chunk_hash))
        covers: list[list[Piece]] | None = None
        if not pieces:
            pass
        elif single and pieces[0].key.head_lo <= lo and pieces[0].key.head_hi >= hi:
            covers = [[pieces[0]]]
        else:
            covers = _cover_all(pieces, ranges)
        if covers is None and stop_at_miss:
            break
        append(covers)
    return out


def _cover_all(pieces: Sequence[Piece], ranges: Sequence[HeadRange]) -> list[list[Piece]] | None:
    """The pieces covering each range, in ``ranges`` order; None if one is not covered."""
    out: list[list[Piece]] = []
    for lo, hi in ranges:
        covering = cover(pieces, lo, hi)
        if covering is None:
            return None
        out.append(covering)
    return out


def group_reach(groups: Sequence[GroupTarget], covers: Sequence[Sequence[object | None]],
                limit: int) -> int:
    """A hybrid model's hit over each group's per-chunk covers (None, or past its end: missing),
    the rule of ``find_group_hits`` and ``TieredStorage.peek``: the largest ``N <= limit``
    such that every full-attention group covers chunks ``[0, N)`` and every other group the
    chunks from ``window_needed(group, N)`` to ``N``. Those groups' rules are not monotone in
    ``N`` (an attention chunk's start needs nothing, the chunk after it one piece), so their
    reaches are taken again until all of them hold at one ``N`` (one pass, nearly always)."""
    reach = limit
    for group, found in zip(groups, covers, strict=True):
        if group.full:
            reach = min(reach, next((i for i, c in enumerate(found) if c is None), len(found)))
    tails = [(group, found) for group, found in zip(groups, covers, strict=True)
             if not group.full]
    while True:
        lowest = reach
        for group, found in tails:
            lowest = _tail_reach(found, group, lowest)
        if lowest == reach:
            return reach
        reach = lowest


def window_needed(group: GroupTarget, reach: int) -> int:
    """The first chunk a hit of ``reach`` chunks needs of ``group`` (0 for full attention;
    ``reach``: none)."""
    return first_needed_chunk(reach, group.window_chunks, group.local_blocks,
                              group.blocks_per_chunk)


def _tail_reach(covers: Sequence[object | None], group: GroupTarget, limit: int) -> int:
    """The largest ``n <= limit`` whose chunks ``group`` needs (from ``window_needed``) are all
    covered (not None in ``covers``)."""
    local, per_chunk, window = group.local_blocks, group.blocks_per_chunk, group.window_chunks
    run = 0
    best = 0
    for n in range(1, limit + 1):  # run: covered chunks ending at chunk n - 1
        run = run + 1 if covers[n - 1] is not None else 0
        if run >= n - first_needed_chunk(n, window, local, per_chunk):
            best = n
    return best


def find_group_hits(index: PieceIndex, model_name: str, groups: Sequence[GroupTarget],
                    chunk_hashes: Sequence[bytes]) -> Hits:
    """A hybrid model's hit: the largest ``N`` such that every full-attention group covers chunks
    ``[0, N)`` and every other group its pieces of ``[window_needed(group, N), N)`` (a sliding
    window's last chunks, a chunked-local group's from its attention chunk's start), for every
    rank's range; ``held`` holds exactly those pieces (nothing of a window's earlier chunks),
    chunk by chunk in prefix order (so ``touch_hits`` touches the prefix's tail first)."""
    limit = len(chunk_hashes)
    covers: list[_Covers] = []
    for group in groups:  # a full group's first miss cuts how far the groups after it are walked
        full = group.full
        found = _group_covers(index, model_name, group, chunk_hashes[:limit], stop_at_miss=full)
        limit = min(limit, len(found)) if full else limit
        covers.append(found)
    count = group_reach(groups, covers, limit)
    held: Held = {heads: {} for group in groups for heads in group.ranges}
    # (from which position, its layout, its ranges' dicts, its covers) per group
    parts = [(window_needed(group, count), group.layout,
              [held[heads] for heads in group.ranges], found)
             for group, found in zip(groups, covers, strict=True)]
    for position in range(count):
        chunk_hash = chunk_hashes[position]
        for start, layout, per_range, found in parts:
            if position >= start:
                chunk = (model_name, layout, chunk_hash)
                for chunks, pieces in zip(per_range, found[position] or (), strict=True):
                    chunks[chunk] = pieces
    return Hits(count, {heads: chunks for heads, chunks in held.items() if chunks})


def touch_hits(index: PieceIndex, hits: Hits) -> None:
    """LRU-touch and count each hit piece once per chunk, the prefix's tail first (so eviction
    eats prefixes from the tail, which keeps what remains of a prefix usable)."""
    move = index.lru.move_to_end
    per_range = list(hits.held.values())
    if len(per_range) == 1:
        for pieces in reversed(per_range[0].values()):
            for piece in pieces:
                move(piece.key)
                piece.hits += 1
        return
    # Ranges may differ in their chunks (a hybrid model's groups of other head counts).
    order = dict.fromkeys(chunk for chunks in per_range for chunk in chunks)
    for chunk in reversed(order):
        seen: set[int] = set()
        for chunks in per_range:
            for piece in chunks.get(chunk, ()):
                if piece.handle not in seen:
                    seen.add(piece.handle)
                    move(piece.key)
                    piece.hits += 1
