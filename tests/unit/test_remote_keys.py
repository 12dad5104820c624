"""Remote tier keys: ``redis_key`` and ``key_of`` round trip, and values of another piece are
refused. No Redis here: the tier is made without connecting (tests/integration/test_tiers.py runs
it against a real redis-server)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_core.events import REMOTE
from lmcache_core.keys import ChunkKey, layout_key, opaque_layout, world_heads
from lmcache_core.storage import integrity, record
from lmcache_core.storage.remote import RedisTier
from lmcache_core.storage.remote_keys import key_of

H = bytes(range(32))
LAYOUT = layout_key("bfloat16", 32, 8, 128, False)
MLA = layout_key("torch.bfloat16", 61, 1, 576, True)


@pytest.fixture
def tier() -> Iterator[RedisTier]:
    t = RedisTier("redis://127.0.0.1:1")  # never connects: no call here reaches Redis
    yield t
    t.stop(drain_timeout_s=0)


def test_redis_key_format(tier: RedisTier) -> None:
    assert tier.redis_key(ChunkKey("org/llama", LAYOUT, 4, 8, H)) == (
        f"lmcache:v2:org/llama:bfloat16:32x8x128:4-8:{H.hex()}").encode()
    assert tier.redis_key(ChunkKey("m", "ranks1", 0, 1, b"\xab" * 4)) == b"lmcache:v2:m:ranks1:0-1:abababab"
    other = RedisTier("redis://127.0.0.1:1", key_prefix="team")
    try:
        assert other.redis_key(ChunkKey("m", MLA, 0, 1, H)).startswith(b"team:v2:m:bfloat16:61xmla576:0-1:")
    finally:
        other.stop(drain_timeout_s=0)


@pytest.mark.parametrize("key", [
    ChunkKey("m", "ranks1", 0, 1, H),
    ChunkKey("m", opaque_layout(4), 3, 4, H[:8]),
    *(ChunkKey("org/model:v1", LAYOUT, lo, hi, H) for lo, hi in world_heads(LAYOUT, 4)),
    ChunkKey("a:b:c", MLA, 0, 1, H),              # ":" in the model name and in the layout
    ChunkKey("org/gemma", LAYOUT + "+g1of3s256", 0, 4, H),  # a hybrid model's sliding group
    ChunkKey("x:ranks2", LAYOUT, 0, 8, H),         # a model name that ends like a layout
    ChunkKey("x:bfloat16", "ranks2", 1, 2, H),     # ... or starts like one
    ChunkKey("", "ranks1", 0, 1, H),
    ChunkKey("модель", "ranks1", 0, 1, H),
])
def test_key_round_trip(tier: RedisTier, key: ChunkKey) -> None:
    assert key_of(tier.key_prefix, tier.redis_key(key)) == key


def test_pieces_of_one_chunk_have_distinct_keys(tier: RedisTier) -> None:
    keys = [ChunkKey("m", LAYOUT, lo, hi, H) for world in (1, 2, 4, 8)
            for lo, hi in world_heads(LAYOUT, world)]
    assert len({tier.redis_key(k) for k in keys}) == len(keys) == 15


@pytest.mark.parametrize("rkey", [
    b"lmcache:v1:m:1:0:" + H.hex().encode(),             # format v1
    b"lmcache:v2:m:ranks1:0-1:" + H.hex().upper().encode(),  # not as redis_key writes it
    b"lmcache:v2:m:ranks1:0-1:zz",
    b"lmcache:v2:m:ranks1:0-1:",
    b"lmcache:v2:m:ranks1:01-1:abab",
    b"lmcache:v2:m:ranks1:+0-1:abab",
    b"lmcache:v2:m:ranks1:0:abab",
    b"lmcache:v2:m:ranks1:1-1:abab",                     # an empty head range
    b"lmcache:v2:m:ranks0:0-1:abab",                     # no such layout
    b"lmcache:v2:m:opaque:0-1:abab",
    b"lmcache:v2:ranks1:0-1:abab",                       # no model
    b"other:v2:m:ranks1:0-1:abab",
    b"\xff\xfe",
    b"",
])
def test_anything_else_is_no_key(tier: RedisTier, rkey: bytes) -> None:
    assert key_of(tier.key_prefix, rkey) is None


class _Client:
    """A stand-in redis-py client: ``values`` answer GETs (through a pipeline), deletes are kept."""

    def __init__(self) -> None:
        self.deleted: list[bytes] = []
        self.values: dict[bytes, bytes] = {}
        self._gets: list[bytes] = []

    def pipeline(self, transaction: bool = False) -> _Client:
        return self

    def get(self, rkey: bytes) -> None:
        self._gets.append(rkey)

    def execute(self, raise_on_error: bool = True) -> list[bytes | None]:
        gets, self._gets = self._gets, []
        return [self.values.get(rkey) for rkey in gets]

    def delete(self, rkey: bytes) -> int:
        self.deleted.append(rkey)
        return 1


class _Sink:
    def __init__(self) -> None:
        self.removed_keys: list[tuple[list[ChunkKey], str]] = []

    def stored(self, keys: Any, medium: str) -> None:
        raise AssertionError("nothing is stored here")

    def removed(self, keys: Any, medium: str) -> None:
        self.removed_keys.append((list(keys), medium))


def test_a_value_of_another_piece_or_format_is_refused() -> None:
    client, sink = _Client(), _Sink()
    tier = RedisTier("redis://127.0.0.1:1", events=sink)  # never connects: its client is set
    tier._client = client
    low, high = ChunkKey("m", LAYOUT, 0, 4, H), ChunkKey("m", LAYOUT, 4, 8, H)
    data = memoryview(bytes(range(200)))
    out = memoryview(bytearray(256))
    value = record.encode(low, data)

    def fetch(key: ChunkKey, stored: bytes) -> tuple[int, int]:
        client.values = {tier.redis_key(key): stored}
        return tier.fetch_checked_into([key], [out[:200]], time.monotonic() + 10)[0]

    assert fetch(low, value) == (200, integrity.checksum(data))
    assert bytes(out[:200]) == bytes(data)
    out[:] = bytes(256)
    # Stored under the other piece's key (a collision, a hand-made copy): a miss, deleted.
    assert fetch(high, value) == (0, 0)
    assert bytes(out) == bytes(256)
    old = bytearray(value)
    old[4:6] = (1).to_bytes(2, "little")  # a record of format v1 is never read
    assert fetch(low, bytes(old)) == (0, 0)
    assert client.deleted == [tier.redis_key(high), tier.redis_key(low)]
    assert sink.removed_keys == [([high], REMOTE), ([low], REMOTE)]
    assert tier.stats().corrupt == 2
    tier._client = None  # nothing to close
    tier.stop(drain_timeout_s=0)
