"""Lower tiers against a real ``redis-server``: in-process engines first, then ``lmcache serve`` pairs.

The Redis fixtures (``redis_up``, ``make_redis``: tests/conftest.py) start Debian's ``redis-server``
on 127.0.0.1, a free port, a temp dir, no persistence; they fail (never skip) when the binary is
missing and ``CI`` is set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lmcache_core.engine import CacheEngine, GroupTarget
from lmcache_core.keys import (
    ChunkKey,
    HeadRange,
    chain_hashes,
    layout_key,
    rank_heads,
    world_heads,
)
from lmcache_core.protocol import messages as m
from lmcache_core.storage import record
from lmcache_core.storage.disk import SUFFIX, DiskTier, file_name
from lmcache_core.storage.pool import MemoryPool
from lmcache_core.storage.remote import RedisTier
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.chunks import CHUNK, blocks, lookup, stats, tokens
from tests.integration.cross_tp import in_parallel
from tests.integration.servers import RedisServer, ServerProcess, WorkerProcess, frozen

pytestmark = pytest.mark.redis

SLOT = 4096
NBYTES = 4000
LOOKUP_MS = 1000


# ---------------------------------------------------------------- in-process engines

LAYOUT = layout_key("float16", 2, 8, 16, False)  # 8 KV heads: TP 1, 2 and 4 hold 8, 4, 2 each


def key(i: int, rank: int = 0, world: int = 1) -> ChunkKey:
    """Chunk ``i``'s piece that rank ``rank`` of ``world`` holds."""
    return ChunkKey("m", LAYOUT, *rank_heads(LAYOUT, world, rank), bytes([i, 0x5A]) * 16)


def every_rank(i: int, world: int) -> list[ChunkKey]:
    return [key(i, rank, world) for rank in range(world)]


def groups(world: int) -> list[GroupTarget]:
    """What a lookup of every rank of ``world`` counts in: one full-attention group."""
    return [GroupTarget(LAYOUT, world_heads(LAYOUT, world))]


def pattern(k: ChunkKey) -> torch.Tensor:
    """The piece's own bytes: distinct per chunk and per head range (so per rank)."""
    salt = 29 * (k.head_lo + 1) + 7 * k.head_hi
    return ((torch.arange(NBYTES, dtype=torch.int64) * (k.chunk_hash[0] + 3) + salt)
            % 251).to(torch.uint8)


def payload(k: ChunkKey) -> memoryview:
    return pattern(k).numpy().data


def engine(remote: RedisTier | None = None, disk: DiskTier | None = None,
           slots: int = 40) -> CacheEngine:
    return CacheEngine(MemoryPool.slots(SLOT, slots, pin=False), chunk_size=16, disk=disk,
                       remote=remote)


def store(e: CacheEngine, keys: list[ChunkKey]) -> None:
    plan = e.store.begin_store(keys, NBYTES)
    assert plan.stored == len(keys)
    for _, k, view in plan.writes:
        view.copy_(pattern(k))
    e.store.finish_store(plan)


def retrieve_ok(e: CacheEngine, keys: list[ChunkKey], lookup_id: str) -> bool:
    """Each key's head range retrieves, for every chunk, exactly that piece with its own bytes."""
    by_heads: dict[HeadRange, list[ChunkKey]] = {}
    for k in keys:
        by_heads.setdefault((k.head_lo, k.head_hi), []).append(k)
    for heads, group in by_heads.items():
        plan = e.store.begin_retrieve("m", LAYOUT, heads, [k.chunk_hash for k in group], lookup_id)
        try:
            if plan.missing or len(plan.found) != len(group):
                return False
            for index, sources in plan.found:
                (view, lo, hi), = sources
                if (lo, hi) != heads or not torch.equal(view, pattern(group[index])):
                    return False
        finally:
            e.store.finish_retrieve(plan)
    return True


def tier(url: str, **kw: object) -> RedisTier:
    kw.setdefault("timeout_ms", 200)
    kw.setdefault("retry_interval_s", 0.1)
    return RedisTier(url, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_two_engines_share_chunks_through_redis(redis_up: RedisServer, world: int) -> None:
    a_tier, b_tier = tier(redis_up.url), tier(redis_up.url.replace("redis://", "valkey://"))
    c_tier = tier(redis_up.url)
    a, b, c = engine(a_tier), engine(b_tier), engine(c_tier)
    assert a.tiers is not None
    a.tiers.start()  # its writer, writing a's pieces
    try:
        keys = [k for i in range(4) for k in every_rank(i, world)]
        store(a, keys)
        assert a_tier.flush(5) and a.snapshot().remote.written_chunks == 4 * world
        with redis_up.client() as client:  # one value per piece, named by its head range
            for k in keys:
                rkey = (f"lmcache:v{record.FORMAT_VERSION}:m:{LAYOUT}:{k.head_lo}-{k.head_hi}:"
                        f"{k.chunk_hash.hex()}").encode()
                assert rkey == a_tier.redis_key(k)
                assert client.exists(rkey) and client.strlen(rkey) == record.header_bytes(k) + NBYTES
            assert client.dbsize() == 4 * world
        hashes = [k.chunk_hash for k in keys[::world]] + [key(9).chunk_hash]
        assert b.lookup("m", groups(world), hashes, "q") == 0
        assert b.lookup("m", groups(world), hashes, "q", tier_timeout_s=2) == 4
        # resident and locked when the reply goes out
        assert set(b.store.inspect().locks_of("q")) == set(keys)
        assert retrieve_ok(b, keys, "q")  # every rank reads back its own bytes
        stats = b.snapshot()
        assert stats.remote.loaded_chunks == 4 * world and stats.remote.errors == 0
        assert stats.engine.lookup_hit_chunks == 4

        # A's memory copy gone: A reads each rank's piece back from Redis too.
        assert a.store.clear(force=True) == (4 * world, 0) and len(a.store) == 0
        assert a.lookup("m", groups(world), hashes, "a", tier_timeout_s=2) == 4
        assert retrieve_ok(a, keys, "a")

        # A TP=1 engine reads the chunks out of the pieces of this TP size, each its own bytes.
        assert c.lookup("m", groups(1), hashes, "c", tier_timeout_s=2) == 4
        plan = c.store.begin_retrieve("m", LAYOUT, (0, 8), hashes[:4], "c")
        try:
            assert not plan.missing and len(plan.found) == 4
            for index, sources in plan.found:
                assert [(lo, hi) for _, lo, hi in sources] == list(world_heads(LAYOUT, world))
                for (view, _, _), k in zip(sources, every_rank(index, world), strict=True):
                    assert torch.equal(view, pattern(k))
        finally:
            c.store.finish_retrieve(plan)
    finally:
        a_tier.stop()
        b_tier.stop()
        c_tier.stop()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_disk_round_trip_every_rank(tmp_path: Path, world: int) -> None:
    disk = DiskTier(tmp_path, 1 << 20, write_through=True)
    e = engine(disk=disk)
    assert e.tiers is not None
    e.tiers.start()
    try:
        keys = [k for i in range(4) for k in every_rank(i, world)]
        store(e, keys)
        assert disk.flush(5) and e.snapshot().disk.written_chunks == 4 * world
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(SUFFIX)) == sorted(
            file_name(k) for k in keys)  # one file per piece
        assert e.store.clear(force=True) == (4 * world, 0) and len(e.store) == 0
        hashes = [k.chunk_hash for k in keys[::world]] + [key(9).chunk_hash]
        assert e.lookup("m", groups(world), hashes, "q") == 0
        assert e.lookup("m", groups(world), hashes, "q", tier_timeout_s=2) == 4
        assert set(e.store.inspect().locks_of("q")) == set(keys)
        assert retrieve_ok(e, keys, "q")  # every rank reads back its own bytes
        assert e.snapshot().disk.loaded_chunks == 4 * world
    finally:
        disk.stop()
    fresh = engine(disk=DiskTier(tmp_path, 1 << 20))  # a restart on the same directory
    assert fresh.lookup("m", groups(world), hashes, "r", tier_timeout_s=2) == 4
    assert retrieve_ok(fresh, keys, "r")


def test_cluster_url(make_redis: Callable[..., RedisServer]) -> None:
    cluster = make_redis(cluster=True)
    a_tier, b_tier = tier(cluster.url), tier(cluster.url.replace("redis+", "valkey+"))
    try:
        a, b = engine(a_tier), engine(b_tier)
        assert a.tiers is not None
        a.tiers.start()
        keys = [key(i) for i in range(3)]
        store(a, keys)
        assert a_tier.flush(5) and a.snapshot().remote.written_chunks == 3
        assert b.lookup("m", groups(1), [k.chunk_hash for k in keys], "c",
                        tier_timeout_s=2) == 3
        assert retrieve_ok(b, keys, "c") and b.snapshot().remote.errors == 0
    finally:
        a_tier.stop()
        b_tier.stop()


def test_bad_values_are_never_served(redis_up: RedisServer) -> None:
    t = tier(redis_up.url)
    e = engine(t)
    keys = [key(i) for i in range(3)]
    good = [record.encode(k, payload(k)) for k in keys]
    flipped = bytearray(good[1])
    flipped[-7] ^= 0x10
    with redis_up.client() as c:
        c.set(t.redis_key(keys[0]), good[0])
        c.set(t.redis_key(keys[1]), bytes(flipped))
        c.set(t.redis_key(keys[2]), good[1])  # an intact record, but of another key
    try:
        assert e.lookup("m", groups(1), [k.chunk_hash for k in keys], "q",
                        tier_timeout_s=2) == 1
        assert not e.store.inspect().resident(keys[1]) and not e.store.inspect().resident(keys[2])
        assert e.snapshot().remote.corrupt == 2
        with redis_up.client() as c:
            assert not c.exists(t.redis_key(keys[1]))  # deleted so nobody fetches it again
    finally:
        t.stop()


def test_a_value_of_another_head_range_is_never_served(redis_up: RedisServer) -> None:
    """Rank 1's Redis key holding rank 0's (intact) record: refused, the chunk is a miss."""
    t = tier(redis_up.url)
    e = engine(t)
    low, high = every_rank(0, 2)
    with redis_up.client() as c:
        c.set(t.redis_key(low), record.encode(low, payload(low)))
        c.set(t.redis_key(high), record.encode(low, payload(low)))
    try:
        assert e.lookup("m", groups(2), [low.chunk_hash], "q", tier_timeout_s=2) == 0
        assert not e.store.inspect().resident(high) and e.snapshot().remote.corrupt == 1
    finally:
        t.stop()


def test_full_queue_drops_writes_without_blocking(redis_up: RedisServer) -> None:
    t = tier(redis_up.url, queue_size=2)  # writer not started: the queue only fills
    e = engine(t)
    store(e, [key(i) for i in range(5)])  # returns (a blocking submit would never, unstarted)
    assert e.snapshot().remote.write_dropped == 3 and e.snapshot().remote.queued == 2
    assert e.tiers is not None
    e.tiers.start()
    try:
        assert t.flush(5) and e.snapshot().remote.written_chunks == 2
    finally:
        t.stop()


def test_redis_down_then_back(redis_up: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lmcache_core.storage.remote_tier")
    t = tier(redis_up.url)
    e = engine(t)
    assert e.tiers is not None
    e.tiers.start()
    try:
        store(e, [key(0)])
        assert t.flush(5)
        redis_up.stop()
        hashes = [key(0).chunk_hash, key(1).chunk_hash]
        for i in range(20):  # memory keeps serving; every lookup answers within its budget
            start = time.monotonic()
            assert e.lookup("m", groups(1), hashes, f"d{i}", tier_timeout_s=0.5) == 1
            assert time.monotonic() - start < 5.0  # 10x the budget (Redis refuses: ~ms)
        store(e, [key(2)])  # queued while down
        wait_until(lambda: e.snapshot().remote.up == 0)
        warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1  # once per outage, not per request
        assert e.snapshot().remote.outages == 1 and e.snapshot().remote.errors >= 1

        redis_up.start()  # same port, empty
        wait_until(lambda: e.snapshot().remote.up == 1)
        assert any("reachable again" in r.getMessage() for r in caplog.records)
        wait_until(lambda: e.snapshot().remote.written_chunks >= 2)  # the queued write went out
        other_tier = tier(redis_up.url)
        other = engine(other_tier)
        try:
            assert other.lookup("m", groups(1), [key(2).chunk_hash], "o",
                                tier_timeout_s=2) == 1
            assert retrieve_ok(other, [key(2)], "o")
        finally:
            other_tier.stop()
    finally:
        t.stop()


def test_hung_redis_costs_a_lookup_at_most_its_budget(redis_up: RedisServer) -> None:
    # The sockets would wait 30 s, 100x the lookup's budget: a lookup that waited on them would
    # take far past the bounds below (10x the budget), however busy the machine.
    t = tier(redis_up.url, timeout_ms=30_000)
    e = engine(t)
    assert redis_up.proc is not None
    t.probe()  # connected before the freeze
    try:
        with frozen(redis_up.proc.pid):
            start = time.monotonic()
            assert e.lookup("m", groups(1), [key(5).chunk_hash], "h",
                            tier_timeout_s=0.3) == 0
            assert time.monotonic() - start < 3.0
            assert e.snapshot().remote.lookup_timeouts == 1
            start = time.monotonic()
            assert e.lookup("m", groups(1), [key(5).chunk_hash], "h") == 0  # never waits
            assert time.monotonic() - start < 3.0  # a hang bound only; the behaviour is the next line
            assert e.snapshot().remote.lookup_timeouts == 1  # it never asked the hung Redis
    finally:
        t.stop()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_disk_first_then_redis_in_one_prefix(redis_up: RedisServer, tmp_path: Path,
                                             world: int) -> None:
    t = tier(redis_up.url)
    disk = DiskTier(tmp_path, 1 << 20)
    e = engine(t, disk)
    chunks = [every_rank(i, world) for i in range(4)]
    for k in chunks[0] + chunks[1]:
        assert disk.write(k, payload(k))
    for k in chunks[2] + chunks[3]:
        assert t.put(k, payload(k))
    keys = [k for chunk in chunks for k in chunk]
    try:
        assert e.lookup("m", groups(world), [c[0].chunk_hash for c in chunks], "p",
                        tier_timeout_s=2) == 4
        assert retrieve_ok(e, keys, "p")  # every rank reads back its own bytes
        stats = e.snapshot()
        assert stats.disk.loaded_chunks == 2 * world
        assert stats.remote.loaded_chunks == 2 * world
    finally:
        t.stop()


# ---------------------------------------------------------------- lmcache serve processes


def test_two_servers_share_redis_and_disk_survives_restart(
        redis_up: RedisServer, tmp_path: Path, make_server: Callable[..., ServerProcess],
        make_worker: Callable[..., WorkerProcess]) -> None:
    remote = {"url": redis_up.url, "timeout_ms": 200, "retry_interval_s": 0.2}
    disk_dir = tmp_path / "disk"
    a_cfg = {"remote": remote, "disk": {"path": str(disk_dir), "max_size": "64MiB",
                                        "write_through": True}}
    srv_a = make_server(a_cfg, name="a", start=False)
    srv_b = make_server({"remote": remote}, name="b", start=False)
    in_parallel(srv_a.start, srv_b.start)
    wa, wb = in_parallel(lambda: make_worker(srv_a.url), lambda: make_worker(srv_b.url))
    assert isinstance(wa, WorkerProcess) and isinstance(wb, WorkerProcess)
    with MessageQueueClient(srv_a.url) as ca, MessageQueueClient(srv_b.url) as cb:
        # A chunk stored through server A is a hit and retrieves byte-exact through server B.
        toks = tokens(4, seed=1)
        wa("fill", blocks=blocks(0, 4), seed=7)
        want = wa("digest", blocks=blocks(0, 4))["digest"]
        assert wa("store", req="s", keys=toks, blocks=blocks(0, 4))["finished"]
        wait_until(lambda: stats(ca).remote.written_chunks == 4 and stats(ca).disk.chunks == 4)
        assert lookup(cb, toks, "r", lock=True) == 4
        wb("zero", blocks=blocks(0, 4))
        result = wb("retrieve", req="r", keys=toks, blocks=blocks(0, 4))
        assert result["finished"] and not result["failed"]
        assert wb("digest", blocks=blocks(0, 4))["digest"] == want
        assert stats(cb).remote.loaded_chunks == 4

        # A hung Redis: a lookup waits (bounded) on a worker thread; pings are not delayed.
        # (The ping answered first is the behaviour; the lookup's bound is 10x its budget.)
        assert redis_up.proc is not None
        with frozen(redis_up.proc.pid):
            start = time.monotonic()
            pending = cb.request_async(m.LookupRequest(
                model_name="tiny", world_size=1, lookup_id="hung", lock=False,
                chunk_hashes=chain_hashes(tokens(1, seed=9), CHUNK)), timeout_s=30)
            cb.ping()
            ping_s = time.monotonic() - start
            assert cb.wait(pending, 10 * LOOKUP_MS / 1000)
            lookup_s = time.monotonic() - start
            assert pending.result(0).hit_chunks == 0
        assert ping_s < lookup_s
        wait_until(lambda: stats(cb).remote.up)

        # Redis restarts during the run: lookups answer within their timeout meanwhile.
        redis_up.stop()
        fresh = tokens(2, seed=2)
        for client in (ca, cb):
            start = time.monotonic()
            assert lookup(client, fresh) == 0
            assert lookup(client, toks) == 4  # memory still serves
            assert time.monotonic() - start < 10 * LOOKUP_MS / 1000  # 10x its budget (a hang)
        assert stats(cb).remote.errors >= 1
        redis_up.start()
        wa("fill", blocks=blocks(4, 2), seed=8)
        want2 = wa("digest", blocks=blocks(4, 2))["digest"]
        assert wa("store", req="s2", keys=fresh, blocks=blocks(4, 2))["finished"]
        wait_until(lambda: stats(ca).remote.written_chunks == 6)  # it reconnected by itself
        wait_until(lambda: stats(cb).remote.up)  # B's writer probes every 0.2 s
        assert lookup(cb, fresh, "r2", lock=True) == 2
        assert wb("retrieve", req="r2", keys=fresh, blocks=blocks(4, 2))["finished"]
        assert wb("digest", blocks=blocks(4, 2))["digest"] == want2
        assert srv_a.log().count("unavailable") == 1  # one warning for A's one outage

    # Disk tier across a restart of server A (Redis lost the first prefix when it restarted),
    # with one of its files corrupted meanwhile: the prefix stops there, nothing bad is served.
    wa.close()
    assert srv_a.stop() == 0
    tiny = layout_key("float16", 2, 4, 32, False)  # the servers' model, at TP=1
    bad = disk_dir / file_name(ChunkKey("tiny", tiny, 0, 4, chain_hashes(toks, CHUNK)[2]))
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    srv_a.start()
    wc = make_worker(srv_a.url)
    with MessageQueueClient(srv_a.url) as ca:
        assert lookup(ca, toks, "after", lock=True) == 2
        assert wc("retrieve", req="after", keys=toks[:2 * CHUNK], blocks=blocks(0, 2))["finished"]
        wa_first_two = wc("digest", blocks=blocks(0, 2))["digest"]
        s = stats(ca)
        assert s.disk.loaded_chunks == 3 and s.disk.corrupt == 1 and not bad.exists()
    wc("fill", blocks=blocks(0, 4), seed=7)  # the same bytes A stored at first
    assert wc("digest", blocks=blocks(0, 2))["digest"] == wa_first_two
