"""What each KV-cache group of a hybrid model moves per chunk (the worker client's side:
``lmcache_core.client.groups``)."""

from __future__ import annotations

import pytest
import torch

from lmcache_core.client.groups import (
    KVCacheGroupSpec,
    group_caches,
    group_pieces,
    load_skip,
    piece_blocks,
)
from lmcache_core.errors import IncompatibleError
from lmcache_core.keys import group_piece

FULL = group_piece(64, 16, "full")                      # 4 blocks a chunk, all of them
SHORT = group_piece(64, 16, "sliding", 40)              # the last 3; resuming needs 1 chunk
LONG = group_piece(64, 16, "sliding", 100)              # all 4; resuming needs 2 chunks
TABLE = list(range(1, 13))                               # 3 chunks of vLLM blocks


def test_a_store_takes_each_chunks_piece_blocks():
    assert piece_blocks(TABLE, 3, FULL, retrieve=False) == ([0, 1, 2], TABLE)
    assert piece_blocks(TABLE, 3, SHORT, retrieve=False) == (
        [0, 1, 2], [2, 3, 4, 6, 7, 8, 10, 11, 12])
    assert piece_blocks(TABLE, 2, LONG, retrieve=False) == ([0, 1], TABLE[:8])


def test_a_store_leaves_out_a_groups_chunk_that_names_the_null_block():
    freed = [0, 0, 0, 0, 0, 0, 7, 8, 9, 10, 11, 12]  # out of the window: vLLM freed them
    assert piece_blocks(freed, 3, SHORT, retrieve=False) == ([2], [10, 11, 12])
    freed_head = [0, 2, 3, 4, 0, 6, 7, 8, 0, 10, 11, 12]  # only blocks before each piece
    assert piece_blocks(freed_head, 3, SHORT, retrieve=False)[0] == [0, 1, 2]


def test_a_retrieve_of_a_sliding_group_takes_only_the_windows_last_chunks():
    assert piece_blocks(TABLE, 3, FULL, retrieve=True) == ([0, 1, 2], TABLE)
    assert piece_blocks(TABLE, 3, SHORT, retrieve=True) == ([2], [10, 11, 12])
    assert piece_blocks(TABLE, 3, LONG, retrieve=True) == ([1, 2], TABLE[4:])
    assert piece_blocks(TABLE, 1, LONG, retrieve=True) == ([0], TABLE[:4])
    # a retrieve keeps null ids (load_skip decides: nothing lands in block 0)
    assert piece_blocks([0] * 12, 3, SHORT, retrieve=True) == ([2], [0, 0, 0])


def test_a_load_leaves_out_the_null_blocks_resuming_does_not_need():
    # LONG: a 100-token window of 16-token blocks needs cdiv(99, 16) = 7 blocks, its pieces are
    # whole chunks: of the older chunk's piece only the last 3 blocks; vLLM gives null for the
    # first (vLLM 0.32: (3 * 64 - 100 + 1) // 16 = 5 blocks skipped of 12)
    table = [0] * 5 + list(range(6, 13))
    _, blocks = piece_blocks(table, 3, LONG, retrieve=True)
    assert blocks == [0, 6, 7, 8, 9, 10, 11, 12] and load_skip(blocks, LONG, 3) == 1
    assert load_skip(TABLE[4:], LONG, 3) == 0  # real ids are written, needed or not
    assert load_skip([0, 0, 7, 8, 9, 10, 11, 12], LONG, 3) is None  # a needed block is null
    assert load_skip([5, 0, 7, 8, 9, 10, 11, 12], LONG, 3) is None  # a null past a real one
    assert load_skip([0, 0, 0, 0], LONG, 1) is None  # one chunk: all of it is needed
    assert load_skip([10, 11, 12], SHORT, 3) == 0 and load_skip([0, 11, 12], SHORT, 3) is None
    assert load_skip([1, 2, 3, 4], FULL, 1) == 0 and load_skip([0, 2, 3, 4], FULL, 1) is None
    assert load_skip([], LONG, 0) == 0


LOCAL = group_piece(64, 16, "local", 96)    # attention chunks of 1.5 chunks (6 blocks)
LOCAL_2 = group_piece(64, 16, "local", 128)  # attention chunks of 2 chunks
LOCAL_3 = group_piece(64, 16, "local", 192)  # attention chunks of 3 chunks


def test_a_retrieve_of_a_local_group_takes_the_chunks_from_its_attention_chunks_start():
    assert piece_blocks(TABLE, 3, LOCAL, retrieve=False) == ([0, 1, 2], TABLE)  # stores: all
    assert piece_blocks(TABLE, 3, LOCAL, retrieve=True) == ([], [])  # 192 starts one: nothing
    assert piece_blocks(TABLE, 2, LOCAL, retrieve=True) == ([1], TABLE[4:8])  # [96, 128)
    assert piece_blocks(TABLE, 1, LOCAL, retrieve=True) == ([0], TABLE[:4])
    assert piece_blocks(TABLE, 3, LOCAL_2, retrieve=True) == ([2], TABLE[8:])  # [128, 192)
    assert piece_blocks(TABLE, 2, LOCAL_2, retrieve=True) == ([], [])
    assert piece_blocks(TABLE, 3, LOCAL_3, retrieve=True) == ([], [])
    assert piece_blocks(TABLE, 2, LOCAL_3, retrieve=True) == ([0, 1], TABLE[:8])
    # a load after vLLM's own hit of chunk 1: its position in the request decides
    assert piece_blocks(TABLE, 2, LOCAL_2, retrieve=True, first_chunk=1) == ([1], TABLE[4:8])
    assert piece_blocks(TABLE, 2, LOCAL_2, retrieve=True, first_chunk=2) == ([], [])
    assert piece_blocks(TABLE, 1, LOCAL_3, retrieve=True, first_chunk=1) == ([0], TABLE[:4])


def test_a_local_load_leaves_out_the_null_blocks_before_its_attention_chunk():
    # resuming at 128 needs [96, 128): chunk 1's last 2 blocks; vLLM nulls the 6 blocks before 96
    table = [0] * 6 + [7, 8]
    chunks, blocks = piece_blocks(table, 2, LOCAL, retrieve=True)
    assert (chunks, blocks) == ([1], [0, 0, 7, 8]) and load_skip(blocks, LOCAL, 2) == 2
    assert load_skip([0, 0, 0, 8], LOCAL, 2) is None  # a block of [96, 128) is null
    assert load_skip([5, 6, 7, 8], LOCAL, 2) == 0
    assert load_skip([0, 2, 3, 4], LOCAL, 1) is None  # [0, 64): all needed
    assert load_skip([0, 10, 11, 12], LOCAL_2, 3) is None  # [128, 192): all of chunk 2
    # vLLM's own hit held chunk 0; the load of chunk 1 (to 128) needs all of it
    assert load_skip([0, 6, 7, 8], LOCAL_3, 2) is None


def test_every_groups_block_size_must_divide_the_chunk_size():
    specs = [KVCacheGroupSpec(["a"], "full", 16), KVCacheGroupSpec(["b"], "sliding", 48, 40)]
    with pytest.raises(IncompatibleError, match=r"chunk size 64 is not a multiple of every KV "
                                                r"cache group's block size: group 0 \(full\) 16, "
                                                r"group 1 \(sliding\) 48"):
        group_pieces(64, specs)
    assert group_pieces(96, specs) == [group_piece(96, 16, "full"),
                                       group_piece(96, 48, "sliding", 40)]
    with pytest.raises(IncompatibleError, match="attention chunk size 100 is not a positive "
                                                "multiple of its block size 16"):
        group_pieces(64, [KVCacheGroupSpec(["a"], "full", 16),
                          KVCacheGroupSpec(["b"], "local", 16, 100)])


def test_group_caches_pick_each_groups_layers_and_refuse_what_cannot_be_stored():
    layer = torch.zeros(2, 4, 16, 1, 8)
    caches = {"l0": layer, "l1": layer, "l2": layer}
    full = KVCacheGroupSpec(["l2", "l0"], "full", 16)
    assert [list(g) for g in group_caches(caches, [full])] == [["l2", "l0"]]
    with pytest.raises(IncompatibleError, match="names layers not given"):
        group_caches(caches, [KVCacheGroupSpec(["l9"], "full", 16)])
    with pytest.raises(IncompatibleError, match="list of tensors"):
        group_caches({**caches, "m": [layer, layer]},
                     [KVCacheGroupSpec(["m"], "sliding", 16, 40)])


def test_a_mamba_layer_is_shared_as_rows_of_state_blocks():
    page = torch.zeros(6, 1, 1, 40, dtype=torch.int8)  # vLLM 0.32: the padded page per block
    mamba = KVCacheGroupSpec(["m"], "mamba", 128)
    (rows,) = group_caches({"m": page}, [mamba])
    assert rows["m"].shape == (6, 1, 40) and rows["m"].data_ptr() == page.data_ptr()
    assert group_caches({"m": [page]}, [mamba])[0]["m"].shape == (6, 1, 40)
    conv, ssm = torch.zeros(6, 3, 8), torch.zeros(6, 2, 4, 4)
    with pytest.raises(IncompatibleError, match="2 tensors"):
        group_caches({"m": [conv, ssm]}, [mamba])
    # the state at each chunk's end: the chunk's last block; a load needs only the last chunk's
    state = group_piece(256, 128, "mamba")
    assert piece_blocks([0, 3, 0, 7], 2, state, retrieve=False) == ([0, 1], [3, 7])
    assert piece_blocks([0, 0, 0, 7], 2, state, retrieve=True) == ([1], [7])


def test_a_hybrid_load_is_cut_into_even_requests() -> None:
    """A Gemma-3-like hit (8 full-attention chunks, 2 of each sliding group, 2 blocks a chunk):
    the full group's retrieve becomes two of 4 chunks, so two copy threads share the work; every
    chunk stays in exactly one request, with its own blocks, a skip with its first chunk's
    request; small loads are left whole."""
    from lmcache_core.client.groups import split_parts

    hashes = [bytes([i]) for i in range(12)]
    parts = [(1, hashes[:2], [10, 11, 12, 13]), (2, hashes[2:4], [20, 21, 22, 23]),
             (3, hashes[4:], list(range(100, 116)))]
    out = split_parts(parts, [1, 0, 1])
    assert [(iid, len(h), skip) for (iid, h, _), skip in out] == [
        (1, 2, 1), (2, 2, 0), (3, 4, 1), (3, 4, 0)]
    assert out[2][0] == (3, hashes[4:8], list(range(100, 108)))
    assert out[3][0] == (3, hashes[8:], list(range(108, 116)))
    small = [(1, hashes[:1], [1, 2]), (2, hashes[1:3], [3, 4, 5, 6])]
    assert split_parts(small, [0, 0]) == [(small[0], 0), (small[1], 0)]


def test_a_hybrid_load_is_sent_as_two_requests_of_about_as_many_chunks():
    """The Gemma-3-like hit's 4 pieces (2, 2, 4, 4 chunks) go as 2 requests of 6: a full-group
    piece first (in the request's own fields), a sliding one in ``more``; every piece once, its
    skip kept with it; fewer pieces than requests make fewer requests."""
    from lmcache_core.client.groups import bundle_parts

    pieces = [((1, [b"a", b"b"], [1, 2, 3, 4]), 1), ((2, [b"c", b"d"], [5, 6, 7, 8]), 0),
              ((3, [b"e"] * 4, list(range(8))), 1), ((3, [b"f"] * 4, list(range(8, 16))), 0)]
    bundles = bundle_parts(pieces, 2)
    assert [[len(p[0][1]) for p in b] for b in bundles] == [[4, 2], [4, 2]]
    assert [b[0][0][0] for b in bundles] == [3, 3]
    assert sorted((p for b in bundles for p in b), key=repr) == sorted(pieces, key=repr)
    assert bundle_parts(pieces[:1], 2) == [pieces[:1]]
    assert bundle_parts(pieces, 1) == [sorted(pieces, key=lambda p: -len(p[0][1]))]


def test_split_parts_cuts_a_group_in_parts_that_differ_by_one_chunk_at_most():
    from lmcache_core.client.groups import split_parts

    hashes = [bytes([i]) for i in range(7)]
    odd = [(7, hashes, list(range(14)))]
    cut = split_parts(odd, [0])  # at most ceil(7 / 3) = 3 a request: 3, 2, 2 (not 3, 3, 1)
    assert [len(h) for (_, h, _), _ in cut] == [3, 2, 2]
    assert [c for (_, h, _), _ in cut for c in h] == hashes  # every chunk once, in order
    assert [b for (_, _, b), _ in cut for b in b] == list(range(14))
