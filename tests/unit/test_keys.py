import re
import struct

import numpy as np
import pytest
import torch
from blake3 import blake3

from lmcache_core.keys import (
    NONE_HASH,
    ChunkKey,
    GroupPiece,
    LayoutGroup,
    TokenDatabase,
    block_hash_bytes,
    candidate_ranges,
    chain_hashes,
    group_piece,
    is_mla,
    layout_group,
    layout_heads,
    layout_key,
    local_start,
    rank_heads,
    salt_prefix,
    salted_prefix,
    striding_block_hashes,
    tenant_tag,
    world_heads,
)


def test_none_hash_is_lmcache_seed():
    assert NONE_HASH.hex() == "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"


def test_chain_matches_an_independent_computation():
    tokens = list(range(1000, 1000 + 600))
    expected, prev = [], NONE_HASH
    for i in range(2):  # 600 tokens -> 2 complete chunks of 256; the tail is ignored
        prev = blake3(prev + struct.pack(">256I", *tokens[i * 256:(i + 1) * 256])).digest()
        expected.append(prev)
    assert chain_hashes(tokens, 256) == expected


def test_known_chain_value():
    # blake3(NONE_HASH || big-endian uint32 0..255): pins the byte order and the seed.
    assert chain_hashes(list(range(600)), 256)[0].hex() == (
        "084547b6c40ed5b05ba8cd0305db5bf74d5617673948d9ed193ab7d6cbc484d4")


def test_prefix_property_and_input_kinds():
    tokens = list(range(64 * 5 + 7))
    full = chain_hashes(tokens, 64)
    assert len(full) == 5
    assert chain_hashes(tokens[:64 * 3], 64) == full[:3]
    assert chain_hashes(np.array(tokens), 64) == full
    assert chain_hashes(torch.tensor(tokens), 64) == full
    changed = tokens.copy()
    changed[70] += 1
    other = chain_hashes(changed, 64)
    assert other[0] == full[0] and other[1:] != full[1:] and all(
        a != b for a, b in zip(other[1:], full[1:], strict=True))


@pytest.mark.parametrize("bad", [[-1], [2**32], ["x"]])
def test_tokens_must_fit_uint32(bad):
    with pytest.raises(ValueError):
        chain_hashes(bad * 64, 64)


def test_striding_takes_each_chunks_last_block():
    blocks = [bytes([i]) * 32 for i in range(10)]
    assert list(striding_block_hashes(blocks, 4)) == [blocks[3], blocks[7]]
    assert list(striding_block_hashes(blocks, 1)) == blocks
    with pytest.raises(ValueError):
        list(striding_block_hashes(blocks, 0))


def test_token_database_and_keys():
    db = TokenDatabase(16)
    assert db.chunk_hashes(list(range(40))) == chain_hashes(list(range(40)), 16)
    assert db.chunk_offsets(2) == [16, 32]
    key = ChunkKey("m", "ranks2", 1, 2, b"\xab" * 32)
    assert key == ChunkKey("m", "ranks2", 1, 2, b"\xab" * 32) and hash(key) == hash(tuple(key))
    assert key.short() == "abababababab@1-2"
    assert key.chunk == ("m", "ranks2", b"\xab" * 32)
    assert block_hash_bytes(b"xy") == b"xy"


def test_layout_fingerprints_and_head_ranges():
    gqa = layout_key("torch.bfloat16", 32, 8, 128, False)
    mla = layout_key("bfloat16", 61, 1, 576, True)
    assert (gqa, mla) == ("bfloat16:32x8x128", "bfloat16:61xmla576")
    assert layout_key("float16", 32, 8, 128, False) != gqa  # dtype alone tells them apart
    assert layout_heads(gqa) == 8 and layout_heads(mla) == 1 and layout_heads("ranks4") == 4
    assert is_mla(mla) and not is_mla(gqa) and not is_mla("ranks4")
    assert rank_heads(gqa, 2, 1) == (4, 8) and rank_heads(gqa, 4, 3) == (6, 8)
    assert world_heads(gqa, 2) == ((0, 4), (4, 8)) and world_heads(mla, 8) == ((0, 1),)
    assert world_heads("ranks3", 3) == ((0, 1), (1, 2), (2, 3))
    with pytest.raises(ValueError, match="divide"):
        rank_heads(gqa, 3, 0)
    with pytest.raises(ValueError, match="outside"):
        rank_heads(gqa, 2, 2)
    for bad in ("", "bfloat16", "bfloat16:32x8", "x" * 100, "ranks0", "bf16:1x2x3x4", "bf16:1x0x1",
                "bf16:0x8x128", "bf16:32x8x0", "bf16:0xmla576", "bf16:61xmla0", "bf16:032x8x128"):
        with pytest.raises(ValueError):
            layout_heads(bad)


def test_block_order_fingerprints_name_their_block_size():
    """A ``cpu_attn`` cache's chunks are in its block order: its fingerprint names the block
    size, so they are shared neither with canonical chunks nor across block sizes."""
    blocks = layout_key("float32", 2, 8, 64, False, block_tokens=128)
    assert blocks == "float32:2x8x64b128" and blocks != layout_key("float32", 2, 8, 64, False)
    assert layout_key("float32", 2, 8, 64, False, block_tokens=16) != blocks
    sliding = layout_key("float32", 2, 8, 64, False, LayoutGroup(1, 3, 512), block_tokens=128)
    assert sliding == "float32:2x8x64b128+g1of3s512" and layout_group(sliding) == (1, 3, 512, 0, 0)
    assert layout_heads(blocks) == 8 and world_heads(sliding, 2) == ((0, 4), (4, 8))
    for bad in ("float32:2x8x64b", "float32:2x8x64b0", "float32:2x8x64b1234567"):
        with pytest.raises(ValueError):
            layout_heads(bad)


def test_group_fingerprints_name_the_group_and_leave_single_group_ones_as_they_were():
    full = layout_key("bfloat16", 4, 8, 64, False, LayoutGroup(0, 3, 0))
    sliding = layout_key("torch.bfloat16", 4, 8, 64, False, LayoutGroup(2, 3, 256))
    assert (full, sliding) == ("bfloat16:4x8x64+g0of3", "bfloat16:4x8x64+g2of3s256")
    # Gemma-3's groups have one tensor shape: only the group tells their pieces apart
    assert layout_key("bfloat16", 4, 8, 64, False, LayoutGroup(1, 3, 256)) != sliding
    assert layout_key("bfloat16", 4, 8, 64, False) == "bfloat16:4x8x64"  # as ever
    assert layout_group("bfloat16:4x8x64") is None and layout_group("ranks2") is None
    assert layout_group(full) == (0, 3, 0, 0, 0) and layout_group(sliding) == (2, 3, 256, 0, 0)
    # Mamba state: rows of state bytes, one piece per rank of its world size (never cross-TP)
    state = layout_key("int8", 2, 0, 39296, False, LayoutGroup(0, 2, 0, 2))
    assert state == "int8:2xstate39296+g0of2m2" and layout_group(state) == (0, 2, 0, 2, 0)
    assert layout_heads(state) == 2 and world_heads(state, 2) == ((0, 1), (1, 2))
    assert not is_mla(state) and candidate_ranges(state, (0, 1)) == ((0, 1),)
    assert layout_heads(sliding) == 8 and world_heads(sliding, 2) == ((0, 4), (4, 8))
    assert layout_heads(layout_key("bfloat16", 61, 1, 576, True, LayoutGroup(0, 2, 0))) == 1
    for bad in ("bf16:4x8x64+g", "bf16:4x8x64+g1", "bf16:4x8x64+g1of0", "bf16:4x8x64+g1of3s0",
                "bf16:4x8x64+g100of3", "bf16:4x8x64+g1of3s", "bf16:4x8x64g1of3",
                "int8:2xstate64", "int8:2xstate64+g0of2", "bf16:4x8x64+g0of2m2",
                "int8:2xstate64+g0of2m0", "bf16:4x8x64+g1of2c0", "bf16:4x8x64+g1of2c",
                "bf16:4x8x64+g1of2c512s256", "int8:2xstate64+g0of2c512", "bf16:4x8x64+g1of2c" +
                "9" * 9):
        with pytest.raises(ValueError):
            layout_heads(bad)


def test_chunked_local_fingerprints_name_the_attention_chunk_size():
    local = layout_key("bfloat16", 3, 8, 64, False, LayoutGroup(1, 2, 0, 0, 8192))
    assert local == "bfloat16:3x8x64+g1of2c8192"
    assert layout_group(local) == (1, 2, 0, 0, 8192)
    # engines of other attention chunk sizes compute other KV: never the same keys
    assert layout_key("bfloat16", 3, 8, 64, False, LayoutGroup(1, 2, 0, 0, 4096)) != local
    assert layout_heads(local) == 8 and world_heads(local, 2) == ((0, 4), (4, 8))
    assert (0, 8) in candidate_ranges(local, (0, 4))  # cross-TP, as full attention


@pytest.mark.parametrize(("chunk", "block", "kind", "window", "piece"), [
    (256, 16, "full", 0, (16, 16, 0, 0)),
    (256, 16, "sliding", 1024, (16, 16, 4, 64)),  # Gemma-3: 1023 tokens = 64 blocks = 4 chunks
    (256, 16, "sliding", 128, (16, 8, 1, 8)),     # 127 tokens: the chunk's last 8 blocks
    (256, 16, "sliding", 129, (16, 8, 1, 8)),     # 128 tokens: still 8 blocks
    (256, 16, "sliding", 130, (16, 9, 1, 9)),
    (256, 16, "sliding", 257, (16, 16, 1, 16)),   # W <= C + 1: one chunk
    (256, 16, "sliding", 258, (16, 16, 2, 17)),   # 2 chunks, the older one's last block only
    (256, 128, "sliding", 300, (2, 2, 2, 3)),     # 3 blocks: the older chunk's last one
    (64, 64, "sliding", 4096, (1, 1, 64, 64)),
    (256, 16, "mamba", 0, (16, 1, 1, 1)),         # the state at the chunk's end
    (256, 16, "local", 8192, (16, 16, 0, 0, 512)),  # Llama 4: whole chunks, 512-block chunks
    (256, 16, "local", 384, (16, 16, 0, 0, 24)),  # an attention chunk of 1.5 chunks
])
def test_group_pieces(chunk, block, kind, window, piece):
    assert group_piece(chunk, block, kind, window) == GroupPiece(*piece)


def test_group_pieces_refuse_what_cannot_be_cut_into_chunks():
    with pytest.raises(ValueError, match="chunk size 256 is not a multiple of the block size 48"):
        group_piece(256, 48, "full")
    with pytest.raises(ValueError, match="positive window"):
        group_piece(256, 16, "sliding", 0)
    for bad in (0, 100):
        with pytest.raises(ValueError, match=f"attention chunk size {bad} is not a positive "
                                             f"multiple of its block size 16"):
            group_piece(256, 16, "local", bad)


@pytest.mark.parametrize(("chunk", "attention", "end", "first", "blocks"), [
    (256, 512, 4, 4, 0),    # N a multiple of the attention chunk: nothing is needed
    (256, 512, 5, 4, 16),   # one chunk into the attention chunk: that chunk
    (256, 512, 1, 0, 16),   # the first attention chunk
    (256, 256, 3, 3, 0),    # attention chunk = chunk: never anything
    (256, 384, 1, 0, 16),   # 1.5 chunks: [0, 256) of [0, 384)
    (256, 384, 2, 1, 8),    # [384, 512): the second half of chunk 1
    (256, 384, 3, 3, 0),    # 768 = 2 x 384: nothing
    (256, 384, 4, 3, 16),   # [768, 1024)
    (512, 256, 3, 3, 0),    # attention chunks inside a chunk: 1536 starts one
])
def test_local_groups_need_their_attention_chunk_from_its_start(chunk, attention, end, first,
                                                                 blocks):
    piece = group_piece(chunk, 16, "local", attention)
    assert piece.first_needed(end) == first and piece.needed_blocks(end) == blocks
    assert local_start(end, piece.local_blocks, piece.blocks_per_chunk) == first


def test_the_other_kinds_need_what_they_always_did():
    full, slide, state = (group_piece(256, 16, "full"), group_piece(256, 128, "sliding", 300),
                          group_piece(256, 16, "mamba"))
    assert (full.first_needed(5), full.needed_blocks(5)) == (0, 80)
    assert (slide.first_needed(5), slide.needed_blocks(5)) == (3, 3)  # older chunk's last block
    assert (slide.first_needed(1), slide.needed_blocks(1)) == (0, 2)
    assert (state.first_needed(5), state.needed_blocks(5)) == (4, 1)


def test_candidate_ranges_cover_every_tp_split():
    gqa = layout_key("float16", 2, 8, 16, False)
    got = candidate_ranges(gqa, (4, 8))
    assert got[0] == (4, 8) and (0, 8) in got and (6, 8) in got and (7, 8) in got
    assert all(lo < 8 and hi > 4 for lo, hi in got)  # only pieces overlapping the range
    assert len(set(got)) == len(got)
    assert candidate_ranges("ranks2", (1, 2)) == ((1, 2),)
    assert candidate_ranges(layout_key("float16", 2, 1, 64, True), (0, 1)) == ((0, 1),)


# ---- pins taken before the vectorized hashing (issue 13): every input kind must keep these values
_RNG_TOKENS = __import__("random").Random(13)
PIN_TOKENS = [_RNG_TOKENS.randrange(0, 2**32) for _ in range(16384 + 100)]  # full uint32 range
PIN_FIRST = "309c136d8b49b74dd3cdbebb5a5cea36aa1a4d8d465dce6104200b4fcca28cc9"
PIN_LAST = "884d26e4e3774a3127bf35e9c80a29d20e28af4d232f95885c16642f1cc471f8"
PIN_ALL_SHA256 = "5d2be92a1526540e4306f3e0f0ea4457b5a696b84ad81ede4d21631e5026dabd"


def _check_pins(hashes: list[bytes]) -> None:
    import hashlib

    assert len(hashes) == 64
    assert hashes[0].hex() == PIN_FIRST and hashes[-1].hex() == PIN_LAST
    assert hashlib.sha256(b"".join(hashes)).hexdigest() == PIN_ALL_SHA256


@pytest.mark.parametrize("kind", ["list", "tuple", "int64", "uint32", "big-endian", "uint64",
                                  "strided", "torch", "array"])
def test_16k_prompt_pinned_for_every_input_kind(kind):
    from array import array

    tokens = PIN_TOKENS
    data = {
        "list": lambda: list(tokens),
        "tuple": lambda: tuple(tokens),
        "int64": lambda: np.array(tokens, dtype=np.int64),
        "uint32": lambda: np.array(tokens, dtype=np.uint32),
        "big-endian": lambda: np.array(tokens, dtype=">u4"),
        "uint64": lambda: np.array(tokens, dtype=np.uint64),
        "strided": lambda: np.repeat(np.array(tokens, dtype=np.int64), 2)[::2],
        "torch": lambda: torch.tensor(tokens, dtype=torch.int64),
        "array": lambda: array("I", tokens),
    }[kind]()
    _check_pins(chain_hashes(data, 256))


def test_small_chunk_pins_and_int32_inputs():
    tokens = list(range(100, 100 + 16 * 7 + 3))
    expected = ["c5977d249eeb44e2", "39b59311f24c163a", "ce475930e07a21c1", "761cc44d5f9b6fdd",
                "af43c4bd59366a48", "7993ae08f74f88e9", "73cf73753266eb9b"]
    for data in (tokens, np.array(tokens, dtype=np.int32), np.array(tokens, dtype=np.int16),
                 torch.tensor(tokens, dtype=torch.int32)):
        assert [h.hex()[:16] for h in chain_hashes(data, 16)] == expected
    assert chain_hashes(tokens[:15], 16) == [] and chain_hashes(np.array([], dtype=np.int64), 16) == []
    assert chain_hashes(tokens, 16, prefix=b"\x01" * 32) != chain_hashes(tokens, 16)


@pytest.mark.parametrize("bad", [np.array([-1] * 64), np.array([2**32] * 64, dtype=np.int64),
                                 np.array([1.5] * 64), torch.tensor([-1] * 64)])
def test_array_tokens_must_fit_uint32(bad):
    with pytest.raises(ValueError):
        chain_hashes(bad, 64)


def test_cache_salt_seeds_the_chain_and_unsalted_stays_lmcache():
    # the salt's seed: blake3(NONE_HASH || "salt" 0x00 uint32_be(len) salt); pinned, so chunks
    # stored under a salt stay hits across versions
    seed = salt_prefix("tenant-1")
    assert seed == blake3(NONE_HASH + b"salt\0" + struct.pack(">I", 8) + b"tenant-1").digest()
    assert seed.hex() == "cae3e9eb6ce3646b6e1b60417eb2e84b90a8946195e80d03c84434bb5bf7fbbb"
    tokens = list(range(512))
    assert chain_hashes(tokens, 256, seed)[-1].hex() == (
        "f9003e9796431d085f2d705164903ed4ec87e75657a210af3b6d0f72ca0edf7e")
    # no salt (None or ""): exactly LMCache's chain
    assert salt_prefix(None) == salt_prefix("") == salted_prefix([]) == NONE_HASH
    assert chain_hashes(tokens, 256, salt_prefix(None)) == chain_hashes(tokens, 256)
    # different salts (and no salt) never share a chunk hash, at any position
    chains = [set(chain_hashes(tokens, 256, salt_prefix(salt))) for salt in (None, "a", "b", "ab")]
    assert sum(len(c) for c in chains) == len(set().union(*chains)) == 4 * 2
    # the parts are delimited: ("salt", "a\0lora") is not ("salt", "a") + ("lora", ...)
    assert salted_prefix([("salt", "a"), ("lora", "x")]) != salted_prefix([("salt", "a\0lora\0x")])


def test_tenant_tags_are_pinned_short_hex_and_never_the_salt():
    # pinned: workers and servers of different versions must agree on a salt's tag
    assert tenant_tag("alice") == "fba5eb8cf37dfd38"
    assert tenant_tag("alice") == blake3(b"lmcache-tenant\0alice").hexdigest()[:16]
    assert tenant_tag("bob") == "66fdbe90eb8f3e5a"
    assert tenant_tag(None) == tenant_tag("") == ""
    assert tenant_tag("é") == blake3("lmcache-tenant\0é".encode()).hexdigest()[:16]
    tags = {tenant_tag(f"user-{i}") for i in range(1000)}
    assert len(tags) == 1000
    assert all(re.fullmatch(r"[0-9a-f]{16}", t) for t in tags)  # 16 lowercase hex digits
    # the tag is not the chain's seed (nor a prefix of it): one cannot be had from the other
    assert salt_prefix("alice").hex()[:16] != tenant_tag("alice")
