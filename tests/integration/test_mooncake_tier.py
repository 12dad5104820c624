"""The Mooncake Store remote tier with real processes: a ``mooncake_master`` (the module's) and two
``lmcache serve`` that each mount a segment of their memory into its pool, with ``kv_worker.py``
workers. A store on one server is found and loaded byte-exact on the other; with two replicas a
killed server loses nothing; a corrupted value is dropped, never loaded; with the master down
lookups miss within their budget, the servers keep serving, and the tier comes back with it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmcache_core.keys import ChunkKey, chain_hashes, layout_key
from lmcache_core.protocol import messages as m
from lmcache_core.storage import record
from lmcache_core.storage.remote_keys import redis_key
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.chunks import CHUNK, blocks, lookup, stats, tokens
from tests.integration.servers import MooncakeMaster, ServerProcess, WorkerProcess

TINY_LAYOUT = layout_key("float16", 2, 4, 32, False)  # the tiny model at TP=1
#: The lookups' budget: a tenth of the ~4 s a client call waits on a master that is away, so a
#: lookup that waited on one would show even at 10x its budget.
LOOKUP_S = 0.3


def config(master: MooncakeMaster, replicas: int = 1) -> dict[str, Any]:
    return {"timeouts": {"lookup_ms": int(LOOKUP_S * 1000)},
            "remote": {"url": master.url, "timeout_ms": 200, "retry_interval_s": 0.2,
                       "mooncake": {"metadata_server": master.metadata_url,
                                    "segment_size": "16MiB", "replicas": replicas}}}


def joined(server: ServerProcess) -> ServerProcess:
    """``server`` once its tier has joined the pool (the client is set up behind the start)."""
    with MessageQueueClient(server.url) as client:
        wait_until(lambda: stats(client).remote.up == 1, 30,
                   lambda: f"the tier never joined the pool:\n{server.log()[-3000:]}")
    return server


def pair(master: MooncakeMaster, make_server: Callable[..., ServerProcess],
         replicas: int = 1) -> tuple[ServerProcess, ServerProcess]:
    """Servers A and B in the pool. First the master forgets the nodes of earlier tests (killed
    ones keep their segments placed until its client_ttl: a write to one fails)."""
    wait_until(lambda: master.active_clients() == 0, 20, "earlier tests' nodes stay in the pool")
    a = make_server(config(master, replicas), name="a", start=False)
    b = make_server(config(master, replicas), name="b", start=False)
    for server in (a, b):
        server.spawn()
    for server in (a, b):
        server.wait_ready(120)
    return joined(a), joined(b)


def store_on(server: ServerProcess, worker: WorkerProcess, toks: list[int], seed: int) -> list[str]:
    """Store ``toks``' chunks through ``worker`` and wait until the tier wrote them all; their
    digests (one per chunk)."""
    n = len(toks) // CHUNK
    worker("fill", blocks=blocks(0, n), seed=seed)
    digests = [worker("digest", blocks=blocks(i, 1))["digest"] for i in range(n)]
    with MessageQueueClient(server.url) as client:
        written = stats(client).remote.written_chunks
        assert worker("store", req=f"s{seed}", keys=toks, blocks=blocks(0, n))["finished"]
        wait_until(lambda: stats(client).remote.written_chunks == written + n, 20,
                   lambda: f"{stats(client).remote}\n{server.log()[-3000:]}")
    return digests


def load_on(server: ServerProcess, worker: WorkerProcess, toks: list[int], hits: int) -> list[str]:
    """Look ``toks`` up on ``server`` (``hits`` chunks expected, loaded from the pool), retrieve
    them into zeroed blocks; their digests."""
    with MessageQueueClient(server.url) as client:
        assert lookup(client, toks, "L", lock=True) == hits
    worker("zero", blocks=blocks(0, hits))
    result = worker("retrieve", req="L", keys=toks[:hits * CHUNK], blocks=blocks(0, hits))
    assert result["finished"] and not result["load_errors"]
    return [worker("digest", blocks=blocks(i, 1))["digest"] for i in range(hits)]


def test_a_store_on_one_server_is_loaded_byte_exact_on_another(
        mooncake_master: MooncakeMaster, make_server, make_worker) -> None:
    a, b = pair(mooncake_master, make_server)
    worker_b = make_worker(b.url)
    toks = tokens(3, seed=11)
    want = store_on(a, make_worker(a.url), toks, seed=4)
    with MessageQueueClient(b.url) as client:
        # What lmcache lookup asks: B sees the chunks in the pool, loading nothing.
        peek = client.request(m.PeekRequest(model_name="tiny", world_size=1,
                                            chunk_hashes=chain_hashes(toks, CHUNK)))
        assert (peek.hit_chunks, peek.remote_chunks, peek.remote) == (3, 3, "asked")
        assert stats(client).engine.chunks == 0  # nothing in B's memory: the pool has it
        # What lmcache inspect-chunks asks: the pool lists no keys, and says so.
        listing = client.request(m.ListChunksRequest(tiers=["memory", "remote"]))
        remote = next(t for t in listing.tiers if t.tier == "remote")
        assert not remote.complete and "cannot list" in remote.error
    assert load_on(b, worker_b, toks, 3) == want
    with MessageQueueClient(b.url) as client:
        s = stats(client).remote
        assert s.loaded_chunks == 3 and s.corrupt == 0 and s.errors == 0


def test_with_two_replicas_a_killed_server_loses_nothing(
        mooncake_master: MooncakeMaster, make_server, make_worker) -> None:
    a, b = pair(mooncake_master, make_server, replicas=2)
    toks = tokens(3, seed=12)
    want = store_on(a, make_worker(a.url), toks, seed=5)
    a.kill()  # its segment (one replica of each chunk) goes with it
    assert load_on(b, make_worker(b.url), toks, 3) == want
    wait_until(lambda: mooncake_master.active_clients() == 1, 20)  # and the master drops it
    assert load_on(b, make_worker(b.url), toks, 3) == want


def test_a_corrupted_value_is_dropped_and_never_loaded(
        mooncake_master: MooncakeMaster, make_server, make_worker) -> None:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    a, b = pair(mooncake_master, make_server)
    worker_b = make_worker(b.url)  # B learns the model's layout from it (a lookup needs one)
    toks = tokens(3, seed=13)
    want = store_on(a, make_worker(a.url), toks, seed=6)
    bad = ChunkKey("tiny", TINY_LAYOUT, 0, 4, chain_hashes(toks, CHUNK)[2])
    name = redis_key(f"lmcache:v{record.FORMAT_VERSION}:", bad).decode()
    # Chunk 2's payload changes by one byte in the pool, behind the servers' backs (its header
    # intact: only the store-time checksum, payload_xxh3, can tell).
    tool = MooncakeDistributedStore()
    assert tool.setup("127.0.0.1", mooncake_master.metadata_url, 16 * 2**20, 16 * 2**20, "tcp", "",
                      mooncake_master.url.removeprefix("mooncake://")) == 0
    try:
        value = bytearray(tool.get(name))
        assert value
        value[-7] ^= 0x01
        assert tool.remove(name, True) == 0
        assert tool.put(name, bytes(value), ReplicateConfig()) == 0
        with MessageQueueClient(b.url) as client:
            assert lookup(client, toks, "x", lock=False) == 2  # stops before the bad chunk
            assert stats(client).remote.corrupt == 1
            assert tool.is_exist(name) == 0  # removed, so nobody loads it again
            assert stats(client).engine.chunks == 2  # the bad one never became resident
    finally:
        tool.close()
    assert load_on(b, worker_b, toks, 2) == want[:2]


def test_the_master_down_makes_lookups_misses_within_budget_until_it_returns(
        mooncake_master: MooncakeMaster, make_server, make_worker) -> None:
    a, b = pair(mooncake_master, make_server)
    worker_a, worker_b = make_worker(a.url), make_worker(b.url)
    before = tokens(2, seed=14)
    store_on(a, worker_a, before, seed=7)
    mooncake_master.stop()
    try:
        with MessageQueueClient(b.url) as client:
            # This one may find the tier up and wait on the master: its lookup budget bounds it
            # (the engine's, shared by both kinds: test_tiers' hung Redis tests it).
            assert lookup(client, before, "down") == 0
            wait_until(lambda: stats(client).remote.up == 0, 20)
            # The writer probes it every retry_interval_s: each probe fails (counted) while the
            # master is away; one that took the tier for up would let lookups wait on it again.
            wait_until(lambda: stats(client).remote.errors >= 3, 30, lambda: f"{stats(client).remote}")
            # While down (its probes see it) the tier is skipped: a lookup never waits on the
            # master, so none stops at its deadline (a lookup that asked it would, ~4 s a call).
            waited = stats(client).remote.lookup_timeouts
            for attempt in range(3):
                assert lookup(client, before, f"down{attempt}") == 0
            s = stats(client).remote
            assert s.lookup_timeouts == waited, s
            assert s.outages == 1 and s.up == 0  # one outage: no probe took it for up meanwhile
        # A keeps serving: a new store lands in its memory and is found there.
        with MessageQueueClient(a.url) as client:
            during = tokens(2, seed=15)
            worker_a("fill", blocks=blocks(0, 2), seed=8)
            assert worker_a("store", req="d", keys=during, blocks=blocks(0, 2))["finished"]
            assert lookup(client, during, "mem") == 2
    finally:
        mooncake_master.start()
    for server in (a, b):
        joined(server)
    # Each node mounts its segment again by itself (its heartbeat finds the master new); until
    # then the pool has no room and a write is refused.
    wait_until(lambda: mooncake_master.active_clients() == 2, 30, "the nodes never came back")
    after = tokens(2, seed=16)  # the restarted master's index is empty: what is stored now
    want = store_on(a, worker_a, after, seed=9)
    assert load_on(b, worker_b, after, 2) == want


def test_each_server_writes_its_chunks_into_its_own_segment(
        mooncake_master: MooncakeMaster, make_server, make_worker) -> None:
    """remote.mooncake.prefer_local (the default): a write is a local copy, the reader's load
    crosses the transfer network. (Placed at random, as without it, 4 chunks of each server all
    on one node and the two servers' on different ones: about 1 in 128.)"""
    from mooncake.store import MooncakeDistributedStore

    a, b = pair(mooncake_master, make_server)
    toks_a, toks_b = tokens(4, seed=17), tokens(4, seed=18)
    want = store_on(a, make_worker(a.url), toks_a, seed=10)
    store_on(b, make_worker(b.url), toks_b, seed=11)
    tool = MooncakeDistributedStore()
    assert tool.setup("127.0.0.1", mooncake_master.metadata_url, 16 * 2**20, 16 * 2**20, "tcp", "",
                      mooncake_master.url.removeprefix("mooncake://")) == 0
    try:
        def nodes(toks: list[int]) -> list[str]:
            names = [redis_key(f"lmcache:v{record.FORMAT_VERSION}:",
                               ChunkKey("tiny", TINY_LAYOUT, 0, 4, h)).decode()
                     for h in chain_hashes(toks, CHUNK)]
            replicas = tool.batch_get_replica_desc(names)
            return [r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                    for name in names for r in replicas[name]]

        on_a, on_b = nodes(toks_a), nodes(toks_b)
    finally:
        tool.close()
    assert len(on_a) == len(on_b) == 4  # one replica each
    assert len(set(on_a)) == len(set(on_b)) == 1 and on_a[0] != on_b[0], (on_a, on_b)
    assert load_on(b, make_worker(b.url), toks_a, 4) == want  # and B reads A's over TCP
