"""A hybrid model's peek (``lmcache lookup``): the hit is ``find_group_hits``' rule over what the
tiers hold together, each chunk counted in the slowest tier a group needs it from."""

from __future__ import annotations

from lmcache_core.engine.index import GroupTarget
from lmcache_core.engine.tiered import DISK, MEMORY, REMOTE, _count_tiers

FULL = GroupTarget("f16:2x4x16+g0of3", ((0, 4),), 0)
SHORT = GroupTarget("f16:2x4x16+g1of3s48", ((0, 4),), 1)  # resuming needs the last chunk's piece
LONG = GroupTarget("f16:2x4x16+g2of3s64", ((0, 4),), 2)  # the last 2 chunks' pieces
M, D, R, _ = MEMORY, DISK, REMOTE, None


def counts(tiers: list[list[int | None]]) -> tuple[int, int, int]:
    got = _count_tiers([FULL, SHORT, LONG], tiers, 3, "")
    return got.memory, got.disk, got.remote_chunks


def test_each_chunk_counts_in_the_slowest_tier_a_group_needs_it_from():
    # chunk 0: only the full group needs it (memory); chunk 1: the full group's on disk; chunk 2:
    # the short window's in Redis. The windows' earlier pieces are gone and not needed.
    assert counts([[M, D, M], [_, _, R], [_, M, D]]) == (1, 1, 1)
    assert counts([[M, M, M], [R, R, M], [R, M, M]]) == (3, 0, 0)  # unneeded slow pieces


def test_a_window_or_a_full_chunk_that_no_tier_holds_cuts_the_hit():
    assert counts([[M, M, _], [M, M, M], [M, M, M]]) == (2, 0, 0)  # the full group's chunk 2
    assert counts([[M, M, M], [M, M, _], [M, M, M]]) == (2, 0, 0)  # the short window at 3
    # the long window lacks chunk 1: no boundary after it can be restored, nor 1 (chunk 0's)
    assert counts([[M, M, M], [M, M, M], [_, _, M]]) == (0, 0, 0)
    assert counts([[M, M, M], [M, M, M], [M, _, M]]) == (1, 0, 0)
