"""Chunks stored at one tensor-parallel size and read at another through the lower tiers: a disk
tier after the server's memory is cleared, and Redis shared by two servers. Real servers, real
worker processes, a real ``redis-server``; each rank checks it holds exactly its slice of the
model's heads (``check_model``), so a tier that mixed up head ranges fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import wait_until
from tests.integration.chunks import CHUNK, tokens
from tests.integration.cross_tp import HEADS, Node, clear, in_parallel, load_and_check, stats, store
from tests.integration.cross_tp import lookup as shared_lookup
from tests.integration.servers import RedisServer, ServerProcess, WorkerProcess, redis_binary

MODEL = "xtier"
POOL = {"server": {"pool_size": "16MiB", "slab_size": "1MiB"}}


def lookup(url: str, world_size: int, request_id: str, toks: list[int]) -> int:
    """Hit tokens of a scheduler lookup at ``world_size`` (through the tiers)."""
    return shared_lookup(url, world_size, request_id, toks, MODEL)


def start_groups(url: str, worlds: tuple[int, ...]) -> dict[int, list[WorkerProcess]]:
    """The ranks of one engine per world size (each rank holds HEADS / world heads)."""
    specs = [(w, r) for w in worlds for r in range(w)]
    made = in_parallel(*(lambda w=w, r=r: WorkerProcess(url, rank=r, world_size=w, model=MODEL,
                                                        heads=HEADS // w) for w, r in specs))
    out: dict[int, list[WorkerProcess]] = {w: [] for w in worlds}
    for (w, _), worker in zip(specs, made, strict=True):
        assert isinstance(worker, WorkerProcess)
        out[w].append(worker)
    return out


def kill_groups(*groups: dict[int, list[WorkerProcess]]) -> None:
    """SIGKILL the workers (and remove their shared memory): their server goes next anyway, and a
    graceful close of seven workers costs seconds of the shared CPUs."""
    for made in groups:
        for workers in made.values():
            for worker in workers:
                worker.kill()


# ---------------------------------------------------------------- disk


@pytest.fixture(scope="class")
def disk_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("xtp_disk")
    config = {**POOL, "disk": {"path": str(tmp / "disk"), "max_size": "64MiB",
                               "write_through": True}}
    server = ServerProcess(tmp, config, name="disk").start()
    try:
        made = start_groups(server.url, (1, 2, 4))
    except BaseException:
        server.kill()
        raise
    yield server, made
    kill_groups(made)
    server.kill()


class TestDisk:
    """One server with a write-through disk tier (its fixture ends with the class, so its
    processes never compete with the Redis tests' for the CPU)."""

    @pytest.mark.parametrize(("stored_by", "read_by"), [(2, 1), (1, 4)])
    def test_disk_pieces_of_one_tp_size_load_byte_exact_at_another(
            self, disk_node: Node, stored_by: int, read_by: int) -> None:
        server, made = disk_node
        seed, n_chunks = 50 + 10 * stored_by + read_by, 3
        toks = tokens(n_chunks, seed)
        before = stats(server.url)
        store(made[stored_by], toks, seed, n_chunks)
        pieces = n_chunks * stored_by
        written = before.disk.written_chunks + pieces
        wait_until(lambda: stats(server.url).disk.written_chunks == written)
        clear(server.url)  # memory forgets; only the disk holds the pieces now

        request_id = f"disk{stored_by}{read_by}"
        assert lookup(server.url, read_by, request_id, toks) == n_chunks * CHUNK
        after = stats(server.url)
        # Every piece of the other TP size came from disk, once (a wide piece serves several ranks).
        assert after.disk.loaded_chunks - before.disk.loaded_chunks == pieces
        assert after.engine.chunks == pieces
        load_and_check(made[read_by], request_id, toks, seed, n_chunks)


# ---------------------------------------------------------------- Redis shared by two servers


Shared = tuple[ServerProcess, ServerProcess, dict[int, list[WorkerProcess]],
               dict[int, list[WorkerProcess]]]


@pytest.fixture(scope="class")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    tmp = tmp_path_factory.mktemp("xtp_redis")
    redis_server = RedisServer(redis_binary(), tmp).start()
    remote = {"url": redis_server.url, "timeout_ms": 500, "retry_interval_s": 0.2}
    server_a = ServerProcess(tmp, {**POOL, "remote": remote}, name="a")
    server_b = ServerProcess(tmp, {**POOL, "remote": remote}, name="b")
    made: list[dict[int, list[WorkerProcess]]] = []
    try:
        in_parallel(server_a.start, server_b.start)
        made = [start_groups(server_a.url, (2,)), start_groups(server_b.url, (1, 4))]
        yield server_a, server_b, made[0], made[1]
    finally:
        kill_groups(*made)
        server_a.kill()
        server_b.kill()
        redis_server.stop()


def flushed_to_redis(url: str, written_before: int, pieces: int) -> None:
    """Wait until the server's write-behind put ``pieces`` more pieces in Redis."""
    wait_until(lambda: stats(url).remote.written_chunks >= written_before + pieces)


@pytest.mark.redis
class TestSharedRedis:
    """Servers A and B on one Redis: TP=2 stores through A; TP=1 and TP=4 read through B."""

    def test_redis_pieces_of_tp2_load_byte_exact_at_tp1_and_tp4_on_another_server(
            self, shared: Shared) -> None:
        server_a, server_b, on_a, on_b = shared
        seed, n_chunks = 61, 3
        toks = tokens(n_chunks, seed)
        written = stats(server_a.url).remote.written_chunks
        store(on_a[2], toks, seed, n_chunks)
        flushed_to_redis(server_a.url, written, n_chunks * 2)
        for read_by in (1, 4):
            clear(server_b.url)  # each TP size loads from Redis, not from the other's loads
            loaded = stats(server_b.url).remote.loaded_chunks
            request_id = f"redis2{read_by}"
            assert lookup(server_b.url, read_by, request_id, toks) == n_chunks * CHUNK
            assert stats(server_b.url).remote.loaded_chunks - loaded == n_chunks * 2
            load_and_check(on_b[read_by], request_id, toks, seed, n_chunks)
        assert stats(server_b.url).remote.corrupt == 0

    def test_redis_pieces_missing_a_ranks_heads_count_nothing(self, shared: Shared) -> None:
        server_a, server_b, on_a, on_b = shared
        seed, n_chunks = 71, 2
        toks = tokens(n_chunks, seed)
        written = stats(server_a.url).remote.written_chunks
        store(on_a[2][:1], toks, seed, n_chunks)  # rank 0 of TP=2 only: heads 0-3 of each chunk
        flushed_to_redis(server_a.url, written, n_chunks)
        clear(server_b.url)
        loaded = stats(server_b.url).remote.loaded_chunks
        assert lookup(server_b.url, 1, "missing1", toks) == 0
        assert lookup(server_b.url, 4, "missing4", toks) == 0
        assert stats(server_b.url).remote.loaded_chunks == loaded  # nothing half-useful came in

        store(on_a[2][1:], toks, seed, n_chunks)  # rank 1 too: now every head is in Redis
        flushed_to_redis(server_a.url, written, 2 * n_chunks)
        assert lookup(server_b.url, 4, "whole4", toks) == n_chunks * CHUNK
        load_and_check(on_b[4], "whole4", toks, seed, n_chunks)
