"""KV events: the bounded pending buffer, batches, vLLM's wire shapes (both generations), replay
framing on real sockets, the config keys, and what the engine and the disk tier report."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pytest
import zmq

from lmcache_core.config import load_config
from lmcache_core.engine import GroupTarget
from lmcache_core.errors import BindError, ConfigError
from lmcache_core.events import DISK, MEMORY
from lmcache_core.keys import ChunkKey, layout_key, opaque_layout, rank_heads, world_heads
from lmcache_core.server.events import (
    END_SEQ,
    REMOVED,
    STORED,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    PendingEvents,
    build_batches,
    wire_hash,
)
from lmcache_core.storage.disk import DiskTier, file_name
from lmcache_core.supervision import Supervisor
from tests.vllm_events import (
    LEGACY,
    V32,
    EarlyBlockRemoved,
    EarlyBlockStored,
    LegacyBlockRemoved,
    LegacyBlockStored,
    V32BlockRemoved,
    V32BlockStored,
)

if TYPE_CHECKING:
    from lmcache_core.engine import CacheEngine

def key(i: int, model: str = "m", rank: int = 0, world: int = 1) -> ChunkKey:
    """Chunk ``i``'s piece that rank ``rank`` of ``world`` holds (opaque layout: heads are ranks)."""
    layout = opaque_layout(world)
    return ChunkKey(model, layout, *rank_heads(layout, world, rank), _hash(i))


def _hash(i: int) -> bytes:
    return bytes([i]) * 24 + i.to_bytes(8, "big")


LAYOUT = layout_key("bfloat16", 4, 8, 128, False)


class Recorder:
    """A ``KVEventSink`` that keeps what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[ChunkKey]]] = []

    def stored(self, keys: Any, medium: str) -> None:
        self.calls.append((STORED, medium, list(keys)))

    def removed(self, keys: Any, medium: str) -> None:
        self.calls.append((REMOVED, medium, list(keys)))


# ------------------------------------------------------------------ pending buffer and batches

def test_pending_is_bounded_and_drops_the_oldest_reports_counted():
    pending = PendingEvents(max_keys=5)
    pending.add(STORED, MEMORY, [key(1), key(2)])
    pending.add(REMOVED, MEMORY, [key(3)])
    pending.add(STORED, MEMORY, [key(4), key(5)])
    assert len(pending) == 5 and pending.dropped == 0
    pending.add(STORED, DISK, [key(6)])  # one over: the oldest report (2 keys) goes
    assert len(pending) == 4 and pending.dropped == 2
    pending.add(STORED, MEMORY, [key(i) for i in range(10, 20)])  # alone over the bound: it stays
    assert [r[2][0] for r in pending.take()] == [key(10)]
    assert pending.dropped == 6 and len(pending) == 0 and not pending.take()
    pending.add(STORED, MEMORY, [])  # nothing to report: not even a record
    assert not pending.take()


def test_batches_one_per_model_stores_apart_removals_merged():
    records = [
        (STORED, MEMORY, [key(1), key(2)]),
        (STORED, MEMORY, [key(3, model="other")]),
        (REMOVED, MEMORY, [key(2)]),
        (REMOVED, MEMORY, [key(1), key(2, rank=1, world=2)]),  # a hash twice (two ranks): once
        (REMOVED, DISK, [key(1)]),
        (STORED, MEMORY, [key(4)]),
        (STORED, MEMORY, [key(5)]),
    ]
    batches = build_batches(records, block_size=256, ts=12.5)
    assert list(batches) == ["m", "other"]
    h = [wire_hash(key(i).chunk_hash) for i in range(6)]
    assert batches["m"].ts == 12.5
    assert batches["m"].events == [
        BlockStored([h[1], h[2]], None, [], 256, None, MEMORY, None),
        BlockRemoved([h[2], h[1]], MEMORY),
        BlockRemoved([h[1]], DISK),
        BlockStored([h[4]], None, [], 256, None, MEMORY, None),  # separate stores stay separate
        BlockStored([h[5]], None, [], 256, None, MEMORY, None),
    ]
    assert batches["other"].events == [BlockStored([h[3]], None, [], 256, None, MEMORY, None)]


def test_pieces_of_one_chunk_are_one_hash_per_event():
    """A chunk is held as pieces (head ranges, at several TP sizes or layouts); events name chunks."""
    def pieces(i: int, world: int, layout: str = LAYOUT) -> list[ChunkKey]:
        return [ChunkKey("m", layout, lo, hi, _hash(i)) for lo, hi in world_heads(layout, world)]

    mla = layout_key("bfloat16", 4, 1, 576, True)
    records = [
        (STORED, MEMORY, pieces(1, 4) + pieces(2, 4) + pieces(1, 2)),  # TP 4 and TP 2 pieces of 1
        (STORED, DISK, [*pieces(3, 1), *pieces(3, 1, mla), ChunkKey("n", LAYOUT, 0, 8, _hash(3))]),
        (REMOVED, MEMORY, pieces(1, 2)),
        (REMOVED, MEMORY, pieces(1, 4) + pieces(2, 8)),  # merged with the one before: 1 once
        (STORED, MEMORY, pieces(1, 8)),  # another report: its own event, as before
    ]
    batches = build_batches(records, block_size=16, ts=1.0)
    h = [wire_hash(_hash(i)) for i in range(4)]
    assert batches["m"].events == [
        BlockStored([h[1], h[2]], None, [], 16, None, MEMORY, None),
        BlockStored([h[3]], None, [], 16, None, DISK, None),
        BlockRemoved([h[1], h[2]], MEMORY),
        BlockStored([h[1]], None, [], 16, None, MEMORY, None),
    ]
    assert batches["n"].events == [BlockStored([h[3]], None, [], 16, None, DISK, None)]


def test_wire_hash_is_vllm_default_int_form():
    digest = bytes(range(32))
    # vLLM's maybe_convert_block_hash: int.from_bytes(hash, "big") & (2**64 - 1)
    assert wire_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert wire_hash(b"\xff" * 32) == 2**64 - 1


# ------------------------------------------------------------------ the payload, as vLLM decodes it

def published(fmt: str) -> list[tuple[int, bytes, bytes]]:
    publisher = KVEventPublisher("ipc://unused", "ipc://unused2", block_size=64, fmt=fmt,  # type: ignore[arg-type]
                                 host="h")
    publisher.stored([key(1), key(2)], MEMORY)
    publisher.removed([key(1)], DISK)
    assert publisher.publish_pending() == 1
    return list(publisher._ring)


def test_map_payload_decodes_with_vllm_032_structs():
    [(seq, topic, payload)] = published("map")
    assert (seq, topic) == (0, b"kv@h@m")
    batch = V32.decode(payload)
    h1, h2 = wire_hash(key(1).chunk_hash), wire_hash(key(2).chunk_hash)
    assert batch.data_parallel_rank is None and abs(batch.ts - time.time()) < 60
    assert batch.events == [
        V32BlockStored([h1, h2], None, [], 64, None, MEMORY, None),
        V32BlockRemoved([h1], DISK),
    ]
    with pytest.raises(msgspec.ValidationError):  # the two generations are not interchangeable
        LEGACY.decode(payload)


def test_array_payload_decodes_with_older_vllm_structs():
    [(_, _, payload)] = published("array")
    batch = LEGACY.decode(payload)
    h1, h2 = wire_hash(key(1).chunk_hash), wire_hash(key(2).chunk_hash)
    assert batch.events == [
        LegacyBlockStored([h1, h2], None, [], 64, None, MEMORY),
        LegacyBlockRemoved([h1], DISK),
    ]
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"  # the tag leads the array
    # The first vLLM with KV events had no ``medium``: msgspec skips the trailing fields it lacks.
    early = msgspec.msgpack.Decoder(list[EarlyBlockStored | EarlyBlockRemoved])
    assert early.decode(msgspec.msgpack.encode(msgspec.msgpack.decode(payload)[1])) == [
        EarlyBlockStored([h1, h2], None, [], 64, None), EarlyBlockRemoved([h1])]


# ------------------------------------------------------------------ sockets: live and replay

@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def replay(ctx: zmq.Context, url: str, request: list[bytes], timeout_s: float = 5.0
           ) -> list[list[bytes]]:
    """Send one replay request from a DEALER (as a REQ would frame it); every reply up to and with
    the end marker, without the empty delimiter."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(url)
    try:
        dealer.send_multipart(request)
        replies = []
        while True:
            assert dealer.poll(int(timeout_s * 1000)), "no replay reply in time"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            replies.append(frames[1:])
            if END_SEQ in frames:
                return replies
    finally:
        dealer.close()


def started(tmp_path: Path, ctx: zmq.Context, fmt: str) -> KVEventPublisher:
    publisher = KVEventPublisher(f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/ev.replay",
                                 block_size=64, fmt=fmt, context=ctx, host="h")  # type: ignore[arg-type]
    publisher.start(Supervisor())
    return publisher


def replay_until(ctx: zmq.Context, url: str, count: int, timeout_s: float = 5.0) -> list[list[bytes]]:
    """Ask for a replay from 0 until ``count`` batches are there (the publisher batches every
    20 ms); each ask waits on the socket."""
    deadline = time.monotonic() + timeout_s
    while True:
        replies = replay(ctx, url, [b"", (0).to_bytes(8, "big")])
        if len(replies) > count or time.monotonic() > deadline:
            return replies


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_replay_sends_batches_from_the_seq_on_then_the_end_marker(tmp_path, ctx, fmt):
    publisher = started(tmp_path, ctx, fmt)
    try:
        for i in range(3):
            publisher.stored([key(i)], MEMORY)
            replay_until(ctx, publisher.replay_url, i + 1)  # so each store is its own batch
        replies = replay(ctx, publisher.replay_url, [b"", (1).to_bytes(8, "big")])
        if fmt == "map":  # vLLM 0.32: [topic, seq, payload]; end [b"", -1, b""]
            assert [r[:2] for r in replies] == [[b"kv@h@m", (1).to_bytes(8, "big")],
                                                [b"kv@h@m", (2).to_bytes(8, "big")],
                                                [b"", END_SEQ]]
            assert replies[-1] == [b"", END_SEQ, b""]
            decoded = [V32.decode(r[2]) for r in replies[:-1]]
        else:  # older vLLM: [seq, payload]; end [-1, b""]
            assert [r[0] for r in replies] == [(1).to_bytes(8, "big"), (2).to_bytes(8, "big"), END_SEQ]
            assert replies[-1] == [END_SEQ, b""]
            decoded = [LEGACY.decode(r[1]) for r in replies[:-1]]
        assert [b.events[0].block_hashes for b in decoded] == [[wire_hash(key(1).chunk_hash)],
                                                               [wire_hash(key(2).chunk_hash)]]
        assert replay(ctx, publisher.replay_url, [b"", (9).to_bytes(8, "big")]) == [
            replies[-1]]  # nothing from there yet: the end marker alone
        assert replay(ctx, publisher.replay_url, [b"", b"\x01"]) == [replies[-1]]  # malformed
        assert publisher.stats().bad_replays == 1
    finally:
        publisher.stop(5)


def test_live_subscriber_and_stop_publishes_what_is_pending(tmp_path, ctx):
    publisher = started(tmp_path, ctx, "map")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(publisher.url)
    try:
        # PUB drops what it sends before the subscription arrives: report until one gets through.
        got = None
        for i in range(100):
            publisher.stored([key(i % 250)], MEMORY)
            if sub.poll(100):
                got = sub.recv_multipart()
                break
        assert got is not None, "the subscriber never received a batch"
        topic, seq, payload = got
        assert topic == b"kv@h@m" and len(seq) == 8 and V32.decode(payload).events
        publisher.removed([key(7)], MEMORY)
        publisher.stop(5)  # the last report still goes out
        last = None
        while sub.poll(2000):
            last = sub.recv_multipart()
            if V32.decode(last[2]).events[-1] == V32BlockRemoved([wire_hash(key(7).chunk_hash)],
                                                                 MEMORY):
                break
        assert last is not None and int.from_bytes(last[1], "big") == publisher.stats().batches - 1
    finally:
        sub.close(0)
        publisher.stop(5)


def test_a_taken_address_is_a_bind_error_naming_the_key_and_nothing_stays_bound(ctx):
    blocker = ctx.socket(zmq.PUB)
    taken = blocker.bind_to_random_port("tcp://127.0.0.1")
    try:
        publisher = KVEventPublisher(f"tcp://127.0.0.1:{taken}", "tcp://127.0.0.1:0",
                                     block_size=64, context=ctx)
        with pytest.raises(BindError, match=rf"server\.events_url: cannot listen on .*:{taken}"):
            publisher.start(Supervisor())
        publisher = KVEventPublisher("tcp://127.0.0.1:0", f"tcp://127.0.0.1:{taken}",
                                     block_size=64, context=ctx)
        with pytest.raises(BindError, match=r"server\.events_replay_url: cannot listen"):
            publisher.start(Supervisor())
        assert publisher._pub is None  # the events socket that did bind was closed again
    finally:
        blocker.close(0)


# ------------------------------------------------------------------ config

def test_config_keys_off_by_default_replay_derived_and_checked():
    server = load_config().server
    assert server.events_url is None and server.events_urls is None and server.events_format == "map"
    assert load_config(overrides={"server.events_url": "tcp://127.0.0.1:5557"}).server.events_urls == (
        "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert load_config(environ={"LMCACHE_SERVER_EVENTS_URL": "ipc:///run/lm/ev"}).server.events_urls == (
        "ipc:///run/lm/ev", "ipc:///run/lm/ev.replay")
    assert load_config(environ={"LMCACHE_SERVER_EVENTS_URL": "off"}).server.events_urls is None
    explicit = load_config(overrides={"server.events_url": "tcp://0.0.0.0:7000",
                                      "server.events_replay_url": "ipc:///tmp/r",
                                      "server.events_format": "array"}).server
    assert explicit.events_urls == ("tcp://0.0.0.0:7000", "ipc:///tmp/r")
    for overrides, message in [
        ({"server.events_url": "http://x:1"}, "server.events_url: expected tcp://HOST:PORT"),
        ({"server.events_url": "tcp://x"}, "server.events_url: 'tcp://x' needs a port"),
        ({"server.events_replay_url": "tcp://x:1"}, "server.events_replay_url: set events_url"),
        ({"server.events_url": "tcp://x:1", "server.events_replay_url": "tcp://x:1"}, "must differ"),
        ({"server.events_format": "json"}, "server.events_format"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=overrides)


# ------------------------------------------------------------------ the sources of events

SLOT = 1024


def store(engine: CacheEngine, keys: list[ChunkKey]) -> None:
    plan = engine.store.begin_store(keys, SLOT)
    engine.store.finish_store(plan)


def test_engine_reports_stores_evictions_clears_and_tier_loads(tmp_path):
    from lmcache_core.engine import CacheEngine  # here: the other tests need no engine
    from lmcache_core.storage.pool import MemoryPool

    sink = Recorder()
    disk = DiskTier(tmp_path, 2**20, write_through=True, events=sink)  # the server's: one sink
    engine = CacheEngine(MemoryPool.slots(SLOT, 3, pin=False), chunk_size=16, disk=disk, events=sink)
    store(engine, [key(1), key(2)])
    store(engine, [key(1), key(3), key(4)])  # 1 is there; 3 fills the pool, 4 evicts 2 (the LRU)
    assert sink.calls == [(STORED, MEMORY, [key(1), key(2)]),
                          (REMOVED, MEMORY, [key(2)]),
                          (STORED, MEMORY, [key(3), key(4)])]
    sink.calls.clear()
    for k in (key(3), key(4)):  # what write-through would write behind
        with engine.store.reading(k) as held:
            assert held is not None and disk.write(k, held[1])
    assert sink.calls == [(STORED, DISK, [key(3)]), (STORED, DISK, [key(4)])]
    sink.calls.clear()
    assert engine.store.clear() == (3, 0)
    assert sink.calls == [(REMOVED, MEMORY, [key(1), key(4), key(3)])]  # LRU order
    sink.calls.clear()
    assert engine.lookup("m", [GroupTarget(opaque_layout(1), ((0, 1),))],
                         [key(3).chunk_hash, key(4).chunk_hash], "q", lock=False,
                         tier_timeout_s=1.0) == 2
    assert sink.calls == [(STORED, MEMORY, [key(3), key(4)])]  # loaded back, in prefix order


def test_disk_tier_reports_cap_deletions_and_lost_files(tmp_path):
    sink = Recorder()
    disk = DiskTier(tmp_path, 2500, events=sink)  # two 1000-byte payloads (plus headers) fit
    data = memoryview(bytes(1000))
    for i in (1, 2, 3):
        assert disk.write(key(i), data)
    assert sink.calls == [(STORED, DISK, [key(1)]), (STORED, DISK, [key(2)]),
                          (REMOVED, DISK, [key(1)]), (STORED, DISK, [key(3)])]
    sink.calls.clear()
    (tmp_path / file_name(key(2))).unlink()  # gone behind our back: the read finds out
    assert disk.read_into(key(2), memoryview(bytearray(1000))) == 0
    assert disk.remove(key(3))
    assert sink.calls == [(REMOVED, DISK, [key(2)]), (REMOVED, DISK, [key(3)])]
