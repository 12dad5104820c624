"""The remote tier's writer batch (``RedisTier._write_batch``) without Redis: the pipelined SET is
replaced by a recorder, so what each batch would send is seen (tests/integration/test_tiers.py runs
the writer against a real redis-server); and a bad value whose delete fails, with no Redis at all."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_core.keys import ChunkKey, opaque_layout
from lmcache_core.storage import integrity, record
from lmcache_core.storage.remote import RedisTier
from lmcache_core.storage.remote_tier import MAX_BATCH_BYTES

LAYOUT = opaque_layout(1)


def key(i: int, lo: int = 0, hi: int = 1) -> ChunkKey:
    return ChunkKey("m", LAYOUT, lo, hi, bytes([i]) * 32)


@pytest.fixture
def tier() -> Iterator[RedisTier]:
    t = RedisTier("redis://127.0.0.1:1")  # never connects: _set_many is replaced below
    yield t
    t.stop(drain_timeout_s=0)


def serve(tier: RedisTier, payloads: dict[ChunkKey, bytes]) -> list[tuple[bytes, bytes]]:
    """``payloads`` as the tier's source (what ``start`` gives its writer; the batches are written
    here by hand); the returned list gets each (redis key, value) SET."""
    @contextlib.contextmanager
    def source(k: ChunkKey) -> Iterator[tuple[memoryview, int] | None]:
        p = payloads.get(k)
        yield None if p is None else (memoryview(p), integrity.checksum(p))

    sent: list[tuple[bytes, bytes]] = []

    def set_many(values: list[tuple[bytes, Any]]) -> list[Any]:
        sent.extend((rkey, bytes(value)) for rkey, value in values)  # copied: buffers are reused
        return [True] * len(values)

    tier._source = source
    tier._set_many = set_many  # type: ignore[method-assign]
    return sent


def test_growing_values_after_a_mid_batch_flush(tier: RedisTier) -> None:
    # 9 MiB fills a batch (a flush mid-batch); the 10 MiB value after it reuses, and must grow, the
    # same buffer: a view of it kept past the flush made that a BufferError and lost the rest.
    payloads = {key(1): b"\x01" * (MAX_BATCH_BYTES + 2**20), key(2): b"\x02" * (MAX_BATCH_BYTES + 2**21),
                key(3): b"\x03" * 1000}
    sent = serve(tier, payloads)
    tier._write_batch(list(payloads))
    assert [rkey for rkey, _ in sent] == [tier.redis_key(k) for k in payloads]
    for (_, value), (k, payload) in zip(sent, payloads.items(), strict=True):
        out = memoryview(bytearray(len(payload)))
        assert record.decode_into(value, k, out) == len(payload) and out == payload
    assert tier.stats().written_chunks == 3 and tier.stats().write_failed == 0


def test_a_key_that_cannot_be_encoded_is_counted_and_the_batch_goes_on(tier: RedisTier) -> None:
    bad = key(2, lo=3, hi=1)  # no record holds an empty head range: encoding it raises
    payloads = {key(1): b"a" * 100, bad: b"b" * 100, key(3): b"c" * 100}
    sent = serve(tier, payloads)
    tier._write_batch(list(payloads))
    assert [rkey for rkey, _ in sent] == [tier.redis_key(key(1)), tier.redis_key(key(3))]
    assert tier.stats().write_failed == 1 and tier.stats().written_chunks == 2


def test_evicted_keys_are_skipped_and_the_rest_flushed(tier: RedisTier) -> None:
    sent = serve(tier, {key(1): b"a" * 100})
    tier._write_batch([key(1), key(2)])  # key(2) left memory before its turn
    assert [rkey for rkey, _ in sent] == [tier.redis_key(key(1))]
    assert tier.stats().write_failed == 0


def test_refused_writes_are_rationed_and_the_dropped_lines_counted(
        tier: RedisTier, caplog: pytest.LogCaptureFixture) -> None:
    # Redis full (maxmemory, noeviction) refuses every batch: a LogBudget lets 20 lines through per
    # window and tells how many it dropped with the next line (no line is lost uncounted).
    payloads = {key(1): b"a" * 100}
    serve(tier, payloads)
    tier._set_many = lambda values: [Exception("OOM")] * len(values)  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="lmcache_core.storage.remote_tier"):
        for _ in range(25):
            tier._write_batch(list(payloads))
        lines = [r.getMessage() for r in caplog.records if "Redis refused" in r.getMessage()]
        assert len(lines) == 20 and tier.stats().write_failed == 25
        tier._refused._window_start = float("-inf")  # the window has passed
        tier._write_batch(list(payloads))
    assert "(5 similar line(s) suppressed before this one)" in caplog.records[-1].getMessage()


def test_a_bad_value_whose_delete_fails_is_counted_as_a_fault(tier: RedisTier) -> None:
    # nothing listens on port 1: the delete fails at once, and is neither silent nor lost
    tier._drop(key(1), record.RecordError("payload checksum mismatch"))
    stats = tier.stats()
    assert (stats.corrupt, stats.errors, stats.outages, stats.up) == (1, 1, 1, 0), stats
