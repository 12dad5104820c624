"""KV events from a real ``lmcache serve``: a SUB client sees stores, evictions, disk writes and
tier loads in order with consecutive seqs, replays what it missed, and a server without
``server.events_url`` listens on nothing more than its own socket."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from lmcache_core.config import leaf_keys
from lmcache_core.keys import chain_hashes
from lmcache_core.protocol import messages as m
from lmcache_core.server.events import END_SEQ, wire_hash
from lmcache_core.transport.client import MessageQueueClient
from tests.integration.chunks import CHUNK, tokens
from tests.vllm_events import V32, V32BlockRemoved, V32BlockStored

POOL_CHUNKS = 4
Event = tuple[str, str, int]  # ("stored" | "removed", medium, wire hash)


def wire(toks: list[int]) -> list[int]:
    return [wire_hash(h) for h in chain_hashes(toks, CHUNK)]


def no_http() -> dict:
    """Turn the operators' HTTP listener off where the config has one (its default port is shared)."""
    return {"http_url": "off"} if "server.http_url" in leaf_keys() else {}


def listening(pid: int) -> set[str]:
    """What ``pid`` listens on: unix socket paths and ``tcp:PORT``s (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and int(fields[3], 16) & 0x10000:  # ACCEPTCON
            out.add(fields[7])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                out.add(f"tcp:{int(fields[1].rsplit(':', 1)[1], 16)}")
    return out


class Subscriber:
    """A router's side: SUB on the events url, DEALER on the replay url (framed as vLLM's REQ)."""

    def __init__(self, ctx: zmq.Context, url: str, replay_url: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(url)
        self.replayer = ctx.socket(zmq.DEALER)
        self.replayer.connect(replay_url)
        self.live: list[tuple[bytes, int, bytes]] = []

    def receive(self, timeout_s: float) -> tuple[bytes, int, bytes] | None:
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        self.live.append((topic, int.from_bytes(seq, "big"), payload))
        return self.live[-1]

    def receive_until(self, done: Callable[[list[Event]], bool], timeout_s: float = 10.0) -> None:
        """Read live batches until ``done(every event so far)``."""
        while not done(list(flatten(self.live))):
            assert self.receive(timeout_s), \
                f"no batch within {timeout_s}s; the last events: {list(flatten(self.live))[-8:]}"

    def replay(self, start: int, timeout_s: float = 5.0) -> list[tuple[bytes, int, bytes]]:
        self.replayer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert self.replayer.poll(int(timeout_s * 1000)), "no replay reply in time"
            empty, topic, seq, payload = self.replayer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))


def flatten(batches: list[tuple[bytes, int, bytes]]) -> Iterator[Event]:
    for _, _, payload in batches:
        for event in V32.decode(payload).events:
            kind = "stored" if isinstance(event, V32BlockStored) else "removed"
            assert isinstance(event, V32BlockStored | V32BlockRemoved)
            if isinstance(event, V32BlockStored):
                assert (event.token_ids, event.block_size, event.parent_block_hash) == ([], CHUNK, None)
            for h in event.block_hashes:
                assert isinstance(h, int)
                yield kind, event.medium or "", h


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_subscriber_sees_stores_evictions_disk_and_loads_in_order_and_replays(
        tmp_path, ctx, make_server, make_worker):
    events_url = f"ipc://{tmp_path}/events.sock"
    server = make_server({
        "server": {"pool_size": f"{POOL_CHUNKS * 64}KiB", "events_url": events_url, **no_http()},
        "disk": {"path": str(tmp_path / "disk"), "write_through": True}})
    worker = make_worker(server.url)
    sub = Subscriber(ctx, events_url, events_url + ".replay")
    assert server.proc is not None
    assert {f"{tmp_path}/events.sock", f"{tmp_path}/events.sock.replay"} <= listening(
        server.proc.pid)
    # PUB drops what is sent before the subscription reaches it: store one-chunk prompts until
    # one's batch arrives; from then on nothing is missed.
    warm: list[int] = []
    for seed in range(100, 140):
        assert worker("store", req=f"w{seed}", keys=tokens(1, seed), blocks=[0, 1, 2, 3])["finished"]
        warm += wire(tokens(1, seed))
        if sub.receive(0.3):
            break
    assert sub.live, "the subscriber never got a batch"
    # The batch that arrived may be the last prompt's disk write, its memory store lost before
    # the subscription took: one more store, made once the subscription is known live, arrives whole.
    live_from = tokens(1, 140)
    assert worker("store", req="live", keys=live_from, blocks=[0, 1, 2, 3])["finished"]
    warm += wire(live_from)
    sub.receive_until(lambda seen: ("stored", "memory", warm[-1]) in seen)
    first = len(sub.live)

    a, b = tokens(POOL_CHUNKS, 1), tokens(POOL_CHUNKS, 2)
    ha, hb = wire(a), wire(b)
    expected = (
        [("removed", "memory", h) for h in warm[-POOL_CHUNKS:]]  # A's store evicts the warm-up
        + [("stored", "memory", h) for h in ha]  # chunks (oldest first), then A, prefix order
        + [("removed", "memory", h) for h in reversed(ha)]  # B's store evicts A, tail first
        + [("stored", "memory", h) for h in hb]
        + [("removed", "memory", h) for h in reversed(hb)]  # the lookup's load evicts B...
        + [("stored", "memory", h) for h in ha])  # ...and brings A back from disk

    def memory() -> list[Event]:
        return [e for e in flatten(sub.live[first:]) if e[1] == "memory"]

    def on_disk(hashes: list[int]) -> Callable[[list[Event]], bool]:
        return lambda seen: {("stored", "disk", h) for h in hashes} <= set(seen)

    assert worker("store", req="a", keys=a, blocks=list(range(16)))["finished"]
    sub.receive_until(on_disk(ha))  # written behind before B's store evicts A from memory
    assert worker("store", req="b", keys=b, blocks=list(range(16, 32)))["finished"]
    sub.receive_until(on_disk(hb))
    with MessageQueueClient(server.url) as client:
        assert client.request(m.LookupRequest(
            model_name="tiny", world_size=1, lookup_id="q", chunk_hashes=chain_hashes(a, CHUNK),
            lock=False)).hit_chunks == POOL_CHUNKS
    sub.receive_until(lambda _: len(memory()) >= len(expected))
    assert memory() == expected
    seqs = [seq for _, seq, _ in sub.live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive, nothing lost live
    assert all(topic.startswith(b"kv@") and topic.endswith(b"@tiny") for topic, _, _ in sub.live)

    # A router that joined late (or saw a gap) asks for everything kept from seq 0.
    replayed = sub.replay(0)
    assert [seq for _, seq, _ in replayed[:seqs[-1] + 1]] == list(range(seqs[-1] + 1))
    assert replayed[seqs[0]:seqs[-1] + 1] == sub.live  # the same bytes as went out live
    assert ("stored", "memory", warm[0]) in set(flatten(replayed[:1]))  # the first store
    assert sub.replay(10**9) == []  # nothing from there: the end marker alone


def test_server_without_events_url_listens_on_nothing_more(tmp_path, make_server):
    server = make_server({"server": no_http()}, name="plain")
    assert server.proc is not None
    assert listening(server.proc.pid) == {f"{tmp_path}/plain.sock"}
