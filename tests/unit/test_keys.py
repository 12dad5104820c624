import struct

import numpy as np
import pytest
import torch
from blake3 import blake3

from lmcache_core.keys import (
    NONE_HASH,
    ChunkKey,
    TokenDatabase,
    block_hash_bytes,
    chain_hashes,
    striding_block_hashes,
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
    key = ChunkKey("m", 2, 1, b"\xab" * 32)
    assert key == ChunkKey("m", 2, 1, b"\xab" * 32) and hash(key) == hash(tuple(key))
    assert key.short() == "abababababab@1/2"
    assert block_hash_bytes(b"xy") == b"xy"
