"""A chunked-local attention group's lookup rule (Llama 4): resuming at chunk N needs the group's
pieces from the chunk the attention chunk N lies in starts in, up to N; nothing at all when N
starts an attention chunk. Only those pieces are locked; one that is missing cuts the hit."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.engine.index import group_reach
from lmcache_core.engine.tiered import DISK, MEMORY, REMOTE, _count_tiers
from lmcache_core.keys import ChunkKey, LayoutGroup, group_piece, layout_key, world_heads
from lmcache_core.storage.pool import MemoryPool

MODEL = "llama4"
SLOT = 64
CHUNK = 16  # tokens; 8-token blocks: 2 a chunk
FULL = layout_key("bfloat16", 1, 4, 8, False, LayoutGroup(0, 2, 0))
LOCAL = layout_key("bfloat16", 3, 4, 8, False, LayoutGroup(1, 2, 0, 0, 32))


def h(i: int) -> bytes:
    return bytes([i + 1]) * 32


HASHES = [h(i) for i in range(6)]


def groups(attention: int = 32, world: int = 1) -> list[GroupTarget]:
    """The full group and a local group of ``attention``-token attention chunks."""
    piece = group_piece(CHUNK, 8, "local", attention)
    return [GroupTarget(FULL, world_heads(FULL, world), 0),
            GroupTarget(LOCAL, world_heads(LOCAL, world), 0, piece.local_blocks,
                        piece.blocks_per_chunk)]


def make() -> CacheEngine:
    return CacheEngine(MemoryPool.slots(SLOT, 64, pin=False), chunk_size=CHUNK)


def store(engine: CacheEngine, layout: str, chunks: Sequence[int],
          heads: tuple[int, int] = (0, 4)) -> None:
    plan = engine.store.begin_store([ChunkKey(MODEL, layout, *heads, h(i)) for i in chunks], SLOT)
    engine.store.finish_store(plan)
    assert plan.stored == len(chunks)


def locked(engine: CacheEngine, lookup_id: str, layout: str) -> list[int]:
    return sorted(k.chunk_hash[0] - 1 for k in engine.store.inspect().locks_of(lookup_id)
                  if k.layout == layout)


def test_a_hit_at_an_attention_chunks_start_needs_nothing_of_the_group():
    engine = make()
    store(engine, FULL, range(6))  # no local piece at all
    assert engine.lookup(MODEL, groups(), HASHES, "even") == 6  # 96 = 3 x 32
    assert locked(engine, "even", LOCAL) == [] and locked(engine, "even", FULL) == list(range(6))
    # 80 tokens need [64, 80): chunk 4, missing; 64 starts an attention chunk
    assert engine.lookup(MODEL, groups(), HASHES[:5], "odd") == 4


def test_a_hit_inside_an_attention_chunk_needs_its_pieces_from_its_start_and_locks_only_them():
    engine = make()
    store(engine, FULL, range(6))
    store(engine, LOCAL, [4])
    assert engine.lookup(MODEL, groups(), HASHES[:5], "r") == 5
    assert locked(engine, "r", LOCAL) == [4]
    # attention chunks of 3 chunks: 80 tokens need [48, 80), chunks 3 and 4; 3 is missing,
    # 64 needs chunk 3 too; 48 starts one
    assert engine.lookup(MODEL, groups(attention=48), HASHES[:5], "3") == 3
    store(engine, LOCAL, [3])
    assert engine.lookup(MODEL, groups(attention=48), HASHES[:5], "3") == 5
    assert locked(engine, "3", LOCAL) == [3, 4]


def test_an_attention_chunk_that_is_no_whole_number_of_chunks_needs_part_of_its_first():
    # 24-token attention chunks: 80 tokens need [72, 80), in chunk 4; 64 need [48, 64): chunk 3
    engine = make()
    store(engine, FULL, range(6))
    store(engine, LOCAL, [4])
    assert engine.lookup(MODEL, groups(attention=24), HASHES[:5], "a") == 5
    assert engine.lookup(MODEL, groups(attention=24), HASHES[:4], "b") == 3  # 48: none
    assert locked(engine, "b", LOCAL) == []


def test_a_missing_needed_piece_cuts_the_hit_at_that_chunk():
    engine = make()
    store(engine, FULL, range(6))
    store(engine, LOCAL, [0, 1, 2, 3])
    assert engine.lookup(MODEL, groups(), HASHES[:5], "cut") == 4
    engine.store.clear(force=True)
    store(engine, FULL, [0, 1, 3, 4, 5])
    store(engine, LOCAL, range(6))
    assert engine.lookup(MODEL, groups(), HASHES, "full") == 2  # full attention lacks 2


def test_every_ranks_heads_are_needed_and_pieces_of_another_tp_size_serve():
    engine = make()
    store(engine, FULL, range(5), (0, 2))
    store(engine, FULL, range(5), (2, 4))
    store(engine, LOCAL, [4], (0, 2))
    assert engine.lookup(MODEL, groups(world=2), HASHES[:5], "half") == 4
    store(engine, LOCAL, [4], (2, 4))
    assert engine.lookup(MODEL, groups(world=1), HASHES[:5], "tp1") == 5  # two pieces


def test_groups_rules_are_met_at_one_boundary_together():
    """A sliding window of one chunk lacking chunk 5 and a local group lacking chunk 4: the
    window holds at 5, the local group at 4 and 6 but not 5, so the hit is 4 (each group's own
    best, taken once in turn, would have said 5)."""
    window = GroupTarget("bfloat16:1x4x8+g2of3s16", ((0, 4),), 1)
    local = groups()[1]
    full = GroupTarget(FULL, ((0, 4),), 0)
    present = [True] * 6
    slide = [c if c else None for c in (True, True, True, True, True, False)]
    lacking_4 = [c if c else None for c in (True, True, True, True, False, False)]
    assert group_reach([full, local, window], [present, lacking_4, slide], 6) == 4
    assert group_reach([full, window, local], [present, slide, lacking_4], 6) == 4


def test_a_peek_counts_only_the_local_pieces_the_hit_needs():
    local = groups()[1]
    full = groups()[0]
    m, d, r, none = MEMORY, DISK, REMOTE, None
    # 48 tokens need [32, 48): chunk 2 (on disk); chunk 0's piece in Redis is not needed
    got = _count_tiers([full, local], [[m, d, m], [r, none, d]], 3, "")
    assert (got.memory, got.disk, got.remote_chunks) == (1, 2, 0)
    got = _count_tiers([full, local], [[m, d, m], [r, none, none]], 3, "")
    assert (got.memory, got.disk, got.remote_chunks) == (1, 1, 0)  # back to 32: none needed
