"""Hybrid models (issue 23) through the adapters, with real processes: a Gemma-3-like model (one
full-attention group, two sliding-window groups of the same tensor shapes) stored at TP=2 loads
byte-exact at TP=1 (full chunks and window pieces by head ranges), from memory, from a disk tier
and from Redis through another server; only the window's pieces are loaded; a prompt whose window
pieces are gone is a miss at that chunk; a retrieve is all or nothing per request across groups;
a chunk size that no group's block size divides is refused at registration."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import zmq

from lmcache_core.client.scheduler import LMCacheMPSchedulerAdapter
from lmcache_core.client.worker import wrap_kv_caches
from lmcache_core.errors import IncompatibleError, NotRegisteredError, ProtocolError
from lmcache_core.keys import chain_hashes
from lmcache_core.kv.share import allocate_shared_kv_caches, release_shared_kv_caches
from lmcache_core.protocol import messages as m
from lmcache_core.storage.disk_files import iter_files, read_meta
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.chunks import BLOCK, CHUNK, PER_CHUNK, tokens
from tests.integration.cli import cli
from tests.integration.cross_tp import (
    Node,
    clear,
    in_parallel,
    lookup,
    redis_pair,
    server_info,
    start_node,
    stats,
)
from tests.integration.servers import ServerProcess, WorkerProcess

HEADS = 4  # the model's KV heads over all ranks
MODEL = "gemma-like"
#: Full attention; a window of 40 tokens (pieces: each chunk's last 3 blocks; resuming needs the
#: last chunk's); a window of 100 (pieces: whole chunks; resuming needs the last 2 chunks').
GROUPS = [{"kind": "full"}, {"kind": "sliding", "window_tokens": 40},
          {"kind": "sliding", "window_tokens": 100}]
POOL = {"server": {"pool_size": "16MiB", "slab_size": "1MiB"}}
N = 3  # chunks of the prompts


def hybrid(url: str, world_size: int, rank: int = 0, **extra: object) -> WorkerProcess:
    return WorkerProcess(url, rank=rank, world_size=world_size, model=MODEL,
                         heads=HEADS // world_size, head_dim=16, script="hybrid_worker.py",
                         **{"groups": GROUPS, "layers_per_group": 2, **extra})


def engine(url: str, world_size: int) -> list[WorkerProcess]:
    made = in_parallel(*(lambda r=r: hybrid(url, world_size, r) for r in range(world_size)))
    return [w for w in made if isinstance(w, WorkerProcess)]


def store_tables(first: int, n: int) -> list[list[int]]:
    """Block tables of a store of ``n`` chunks from block ``first``: the 40-token window's group
    has each chunk's first block already freed (vLLM's null 0: out of its window)."""
    full = list(range(first, first + n * PER_CHUNK))
    windowed = [0 if j % PER_CHUNK == 0 else b for j, b in enumerate(full)]
    return [full, windowed, full]


def skipped_blocks(window: int, n: int) -> int:
    """The blocks vLLM (0.32's ``SlidingWindowManager``) allocates as its null block for a load
    of ``n`` chunks: those wholly before the window of the next token."""
    return max(0, n * CHUNK - window + 1) // BLOCK


def load_tables(first: int, n: int) -> list[list[int]]:
    """The tables of a load of ``n`` chunks as vLLM allocates a hybrid request's blocks: real
    blocks only where each group needs them (the full group: all; the 40-token window: the last
    3; the 100-token window: the last 7, so of its older piece only the last 3 blocks), null
    before."""
    full = list(range(first, first + n * PER_CHUNK))
    short = [b if j >= skipped_blocks(40, n) else 0 for j, b in enumerate(full)]
    long = [b if j >= skipped_blocks(100, n) else 0 for j, b in enumerate(full)]
    return [full, short, long]


def loaded_positions(n: int) -> list[list[int]]:
    blocks = n * PER_CHUNK
    return [list(range(blocks)), list(range(skipped_blocks(40, n), blocks)),
            list(range(skipped_blocks(100, n), blocks))]


def store(workers: list[WorkerProcess], toks: list[int], seed: int, n: int = N) -> None:
    tables = store_tables(1, n)
    for worker in workers:
        worker("fill_model", tables=tables, seed=seed)
        result = worker("store", req=f"store-{seed}-{n}", keys=toks, tables=tables)
        assert result["finished"] and not result["failed"], result


def load_and_check(workers: list[WorkerProcess], request_id: str, toks: list[int], seed: int,
                   n: int = N) -> None:
    """Each rank loads into zeroed blocks, then holds exactly its slice of what was stored where
    each group needs it, and nothing went into the null block."""
    tables = load_tables(30, n)
    for worker in workers:
        worker("zero", tables=tables)
        result = worker("retrieve", req=request_id, keys=toks, tables=tables)
        assert result["finished"] and not result["failed"], result
        assert not result["load_errors"] and not result["failed_recving"], result
        # the stored model's logical blocks, read back at the load's positions
        check = worker("check_model", tables=tables, seed=seed, positions=loaded_positions(n))
        assert check == {"equal": True, "null_untouched": True}


#: Pieces one store of n chunks at TP=2 makes: every group's chunks, of both ranks.
def stored_pieces(n: int, world: int = 2) -> int:
    return 3 * n * world


#: Pieces a TP=1 load of n chunks needs: the full group's n, the 40-token window's last chunk,
#: the 100-token window's last 2 (stored at TP=2: two pieces each).
def needed_pieces(n: int, stored_by: int = 2) -> int:
    return (n + 1 + min(n, 2)) * stored_by


# ---------------------------------------------------------------- memory


@pytest.fixture(scope="module")
def node(module_server: Callable[..., ServerProcess]) -> Iterator[Node]:
    yield from start_node(module_server(POOL, name="mem"), engine)


def test_each_group_registers_on_its_own_under_its_own_fingerprint(node):
    server, made = node
    hello = made[2][0].hello
    assert len(set(hello["instance_ids"])) == 3
    assert hello["pieces"] == [[4, 4, 0, 0, 0], [4, 3, 1, 3, 0], [4, 4, 2, 7, 0]]
    info = server_info(server.url)
    assert {row.model_name: row.registered for row in info.models}[MODEL] == 9  # 3 workers x 3


def test_a_hybrid_model_stored_at_tp2_loads_byte_exact_at_tp1(node):
    server, made = node
    seed = 1
    toks = tokens(N, seed)
    store(made[2], toks, seed)
    assert lookup(server.url, 1, "tp1", toks, MODEL) == N * CHUNK
    load_and_check(made[1], "tp1", toks, seed)
    assert lookup(server.url, 2, "tp2", toks, MODEL) == N * CHUNK  # and back at TP=2
    load_and_check(made[2], "tp2", toks, seed)


def test_server_info_and_inspect_chunks_show_a_hybrid_chunks_groups(node):
    server, made = node
    seed = 7
    toks = tokens(1, seed)
    store(made[1], toks, seed, n=1)
    row = next(r for r in server_info(server.url).models if r.model_name == MODEL)
    assert [(g.index, g.count, g.kind, g.block_size, g.window_tokens, g.layout)
            for g in row.groups] == [(0, 3, "full", 16, 0, "float16:2x4x16+g0of3"),
                                     (1, 3, "sliding", 16, 40, "float16:2x4x16+g1of3s48"),
                                     (2, 3, "sliding", 16, 100, "float16:2x4x16+g2of3s64")]
    shown = cli("inspect-chunks", "--url", server.url, "--model", MODEL, "--sort", "key")
    assert shown.code == 0, shown.err
    for text in ("0/3 full", "1/3 sliding: last 48 tokens", "2/3 sliding: last 64 tokens",
                 "KV-cache groups (hybrid models)"):
        assert text in shown.out, shown.out


def test_a_pin_keeps_every_piece_a_hit_of_the_prefix_needs(node):
    server, made = node
    seed = 8
    toks = tokens(N, seed)
    store(made[1], toks, seed)
    scheduler = LMCacheMPSchedulerAdapter(server.url, zmq.Context.instance(), MODEL, 1, 0, BLOCK)
    try:
        # full: 3 chunks; the short window: chunk 2's piece; the long window: chunks 1-2's
        assert scheduler.pin(toks, ttl_s=60).result(10).pinned == needed_pieces(N, stored_by=1)
        with MessageQueueClient(server.url, connect_timeout_s=2) as client:
            assert client.request(m.ClearRequest()).kept_locked >= needed_pieces(N, stored_by=1)
        assert lookup(server.url, 1, "pinned", toks, MODEL) == N * CHUNK
        load_and_check(made[1], "pinned", toks, seed)
        # unpin: of every group's pieces held, the pinned ones
        assert scheduler.unpin(toks).result(10).unpinned == needed_pieces(N, stored_by=1)
    finally:
        scheduler.close()


def test_a_prompt_whose_window_pieces_are_gone_is_a_miss_at_that_chunk(node):
    server, made = node
    seed = 2
    toks = tokens(5, seed)
    store(made[1], toks, seed, n=4)
    tables = store_tables(1, 5)
    tables[1][4 * PER_CHUNK:] = [0] * PER_CHUNK  # chunk 4's short-window blocks already freed
    made[1][0]("fill_model", tables=tables, seed=seed)
    assert not made[1][0]("store", req="s5", keys=toks, tables=tables)["failed"]
    # chunk 4: full attention and the long window are there, the short window's piece is not
    assert lookup(server.url, 1, "gone", toks, MODEL) == 4 * CHUNK
    load_and_check(made[1], "gone", toks[:4 * CHUNK], seed, n=4)


def test_a_retrieve_is_all_or_nothing_across_groups_and_reported_per_request(node):
    server, made = node
    seed = 3
    toks = tokens(2, seed)
    tables = store_tables(1, 2)
    tables[2][PER_CHUNK:] = [0] * PER_CHUNK  # the long window's chunk 1 is never stored
    worker = made[1][0]
    worker("fill_model", tables=tables, seed=seed)
    assert not worker("store", req="s-partial", keys=toks, tables=tables)["failed"]
    # the lookup stops before chunk 1, whose long window lacks it
    assert lookup(server.url, 1, "partial-lookup", toks, MODEL) == CHUNK
    # a retrieve made anyway (no lookup): the other groups load, the request fails as a whole
    result = worker("retrieve", req="partial", keys=toks, tables=load_tables(30, 2))
    assert result["finished"] and "1 chunk(s) were no longer cached" in result["failed"]
    assert result["failed_recving"] == ["partial"] and result["load_errors"] == []
    # a load into the null block fails before anything is sent
    bad = load_tables(30, 2)
    bad[1][-1] = 0
    result = worker("retrieve", req="null", keys=toks, tables=bad)
    assert result["failed_recving"] == ["null"] and "null block" in result["failed"]


def test_one_retrieve_request_carries_several_groups_parts(node):
    """``RetrieveRequest.more`` (the adapter sends a hybrid load as 2 such requests): missing
    chunks are indexed over every part in order; a part naming an unregistered instance or a
    block id out of range is refused before any part is copied."""
    server, made = node
    seed = 14
    toks = tokens(3, seed)
    store(made[1], toks, seed, n=2)
    worker = made[1][0]
    full, _, wide = worker.hello["instance_ids"]
    hashes = chain_hashes(toks, CHUNK)
    tables = load_tables(30, 3)

    def part(instance_id: int, chunks: list[int], table: list[int]) -> m.RetrievePart:
        blocks = [b for c in chunks for b in table[c * PER_CHUNK:(c + 1) * PER_CHUNK]]
        return m.RetrievePart(instance_id=instance_id, chunk_hashes=[hashes[c] for c in chunks],
                              block_ids=blocks)

    def retrieve(*parts: m.RetrievePart) -> m.RetrieveReply:
        first, *more = parts
        request = m.RetrieveRequest(instance_id=first.instance_id,
                                    chunk_hashes=first.chunk_hashes, block_ids=first.block_ids,
                                    more=more)
        with MessageQueueClient(server.url, connect_timeout_s=5) as client:
            return client.request(request)

    worker("zero", tables=tables)
    # chunk 2 was never stored: index 2 of the request (the full group's 2 chunks come first);
    # the long window's part goes into its own layers' blocks of the same ids (none null)
    reply = retrieve(part(full, [0, 1], tables[0]), part(wide, [2, 1], tables[0]))
    assert (reply.retrieved, reply.missing, reply.late) == (3, [2], 0)
    check = worker("check_model", tables=tables, seed=seed, positions=[list(range(8)), [], []])
    assert check == {"equal": True, "null_untouched": True}
    worker("zero", tables=tables)
    with pytest.raises(NotRegisteredError):
        retrieve(part(full, [0, 1], tables[0]), part(12345, [1], tables[0]))
    out_of_range = m.RetrievePart(instance_id=wide, chunk_hashes=[hashes[1]],
                                  block_ids=[1, 2, 3, 10**6])
    with pytest.raises(ProtocolError, match="block ids must be in"):
        retrieve(part(full, [0, 1], tables[0]), out_of_range)
    assert worker("all_zero", tables=tables) == {"zero": True}


def test_a_window_wider_than_a_chunk_loads_only_the_needed_part_of_its_oldest_piece(node):
    """The 100-token window needs 7 blocks, its pieces are whole chunks: of chunk N - 2's piece
    only the last 3 blocks; vLLM's null block stands for the first, which stays unwritten. A
    null block among the 7 needed is a failed load, never a partial one."""
    server, made = node
    seed = 9
    toks = tokens(N, seed)
    store(made[1], toks, seed)
    tables = load_tables(30, N)
    assert tables[2][:6] == [0] * 5 + [35]  # vLLM's skipped blocks: chunk 1's first is null
    assert lookup(server.url, 1, "wide", toks, MODEL) == N * CHUNK
    load_and_check(made[1], "wide", toks, seed)  # and block 0 untouched
    before = stats(server.url).engine.retrieved_chunks
    bad = load_tables(30, N)
    bad[2][skipped_blocks(100, N)] = 0  # the oldest block the window needs
    assert lookup(server.url, 1, "wide-null", toks, MODEL) == N * CHUNK
    result = made[1][0]("retrieve", req="wide-null", keys=toks, tables=bad)
    assert result["failed_recving"] == ["wide-null"] and "null block" in result["failed"]
    assert stats(server.url).engine.retrieved_chunks == before  # nothing was sent


def peek(url: str, world_size: int, prompts: list[list[int]]) -> list[dict]:
    """``lmcache lookup --json``'s rows for ``prompts`` of the hybrid model."""
    shown = cli("lookup", "--url", url, "--model", MODEL, "--world-size", str(world_size),
                "--tokens", "-", "--json", stdin=json.dumps(prompts))
    assert shown.code == 0, shown.err
    return list(json.loads(shown.out)["prompts"])


GROUP_LAYOUTS = ["float16:2x4x16+g0of3", "float16:2x4x16+g1of3s48", "float16:2x4x16+g2of3s64"]


def test_lmcache_lookup_counts_a_hybrid_prefix_as_its_lookup_does(node):
    """``lmcache lookup`` (PEEK) counts the chunks at whose end every group can be restored, the
    same count as the lookup, and locks, loads and counts nothing."""
    server, made = node
    seed = 10
    whole = tokens(N, seed)
    store(made[1], whole, seed)
    cut = tokens(2, seed + 1)  # the long window's chunk 1 is never stored: resuming at 2 fails
    tables = store_tables(1, 2)
    tables[2][PER_CHUNK:] = [0] * PER_CHUNK
    made[1][0]("fill_model", tables=tables, seed=seed + 1)
    assert not made[1][0]("store", req="s-cut", keys=cut, tables=tables)["failed"]
    before = stats(server.url).engine
    rows = peek(server.url, 1, [whole, cut, tokens(2, seed + 2)])
    assert [(r["hit_chunks"], r["memory_chunks"]) for r in rows] == [(N, N), (1, 1), (0, 0)]
    assert all(r["groups"] == GROUP_LAYOUTS and r["layout"] == "" for r in rows)
    after = stats(server.url).engine
    assert (after.lookups, after.lookup_hit_chunks) == (before.lookups, before.lookup_hit_chunks)
    assert peek(server.url, 2, [whole])[0]["hit_chunks"] == N  # TP=1 pieces serve TP=2 ranks
    assert lookup(server.url, 1, "peeked", whole, MODEL) == N * CHUNK
    assert lookup(server.url, 1, "peeked-cut", cut, MODEL) == CHUNK
    load_and_check(made[1], "peeked", whole, seed)  # (its retrieve releases the locks)
    shown = cli("lookup", "--url", server.url, "--model", MODEL, "--world-size", "1",
                "--tokens", "-", stdin=json.dumps(whole))
    assert shown.code == 0, shown.err
    assert "hybrid, 3 KV-cache groups" in shown.out and GROUP_LAYOUTS[2] in shown.out, shown.out


def test_lmcache_lookup_of_a_hybrid_model_without_all_its_groups_registered_is_a_miss(node):
    server, _ = node
    caches, segment = allocate_shared_kv_caches(1, [2, 8, BLOCK, 4, 16], torch.float16)
    try:  # group 1 of 2 alone: nothing can be restored, as the model's lookups say
        wrapped = wrap_kv_caches(caches)
        request = m.RegisterKVCacheRequest(
            instance_id=78, model_name="half-registered", world_size=1, kv_rank=0,
            block_size=BLOCK, layout=wrapped.layout, layers=wrapped.layers, pid=os.getpid(),
            group=m.KVGroup(index=1, count=2, kind="sliding", block_size=BLOCK, window_tokens=40))
        with MessageQueueClient(server.url, connect_timeout_s=2) as client:
            client.request(request)
            shown = cli("lookup", "--url", server.url, "--model", "half-registered",
                        "--tokens", "-", "--json", stdin=json.dumps(tokens(1, 12)))
            assert shown.code == 0, shown.err
            row = json.loads(shown.out)["prompts"][0]
            assert (row["hit_chunks"], row["groups"]) == (0, [])
            shown = cli("lookup", "--url", server.url, "--model", "half-registered",
                        "--tokens", "-", stdin=json.dumps(tokens(1, 12)))
            assert "hybrid, incomplete KV-cache groups" in shown.out, shown.out
            assert "do not cover every KV-cache group" in shown.out, shown.out
            client.request(m.UnregisterKVCacheRequest(instance_id=78))
    finally:
        release_shared_kv_caches(segment)


def test_a_chunk_size_no_group_block_size_divides_is_refused_at_registration(node):
    server, _ = node
    with pytest.raises(RuntimeError, match=r"chunk size 64 is not a multiple of every KV cache "
                                           r"group's block size: group 0 \(full\) 16, group 1 "
                                           r"\(sliding\) 48"):
        hybrid(server.url, 1, groups=[{"kind": "full"},
                                      {"kind": "sliding", "window_tokens": 40, "block_size": 48}])
    # the server refuses it too, whatever the client checked
    caches, segment = allocate_shared_kv_caches(1, [2, 8, 48, 4, 16], torch.float16)
    try:
        wrapped = wrap_kv_caches(caches)
        request = m.RegisterKVCacheRequest(
            instance_id=77, model_name=MODEL, world_size=1, kv_rank=0, block_size=48,
            layout=wrapped.layout, layers=wrapped.layers, pid=os.getpid(),
            group=m.KVGroup(index=1, count=2, kind="sliding", block_size=48, window_tokens=40))
        with MessageQueueClient(server.url, connect_timeout_s=2) as client, pytest.raises(
                IncompatibleError, match=r"chunk size 64 is not a multiple of KV cache group 1's "
                                         r"\(sliding\) block size 48"):
            client.request(request)
    finally:
        release_shared_kv_caches(segment)


# ---------------------------------------------------------------- disk


@pytest.fixture(scope="module")
def disk_node(module_server: Callable[..., ServerProcess], module_tmp: Path) -> Iterator[Node]:
    config = {**POOL, "disk": {"path": str(module_tmp / "disk"), "max_size": "64MiB",
                               "write_through": True}}
    yield from start_node(module_server(config, name="disk"), engine)


def store_on_disk_only(server: ServerProcess, workers: list[WorkerProcess], toks: list[int],
                       seed: int) -> m.ServerStats:
    """Store at TP=2, wait for the disk to hold every piece, clear memory; the stats before."""
    before = stats(server.url)
    store(workers, toks, seed)
    wait_until(lambda: stats(server.url).disk.written_chunks
               == before.disk.written_chunks + stored_pieces(N))
    clear(server.url)
    return before


def test_through_the_disk_tier_only_the_windows_pieces_load(disk_node):
    server, made = disk_node
    seed = 4
    toks = tokens(N, seed)
    before = store_on_disk_only(server, made[2], toks, seed)
    assert lookup(server.url, 1, "disk1", toks, MODEL) == N * CHUNK
    after = stats(server.url)
    assert after.disk.loaded_chunks - before.disk.loaded_chunks == needed_pieces(N)
    load_and_check(made[1], "disk1", toks, seed)


def test_lmcache_lookup_counts_a_hybrid_prefix_on_disk_and_loads_nothing(disk_node):
    server, made = disk_node
    seed = 13
    toks = tokens(N, seed)
    before = store_on_disk_only(server, made[2], toks, seed)
    (row,) = peek(server.url, 1, [toks])
    assert (row["hit_chunks"], row["memory_chunks"], row["disk_chunks"]) == (N, 0, N)
    assert stats(server.url).disk.loaded_chunks == before.disk.loaded_chunks
    assert lookup(server.url, 1, "peek-disk", toks, MODEL) == N * CHUNK  # loads what it needs
    (row,) = peek(server.url, 1, [toks])
    assert (row["hit_chunks"], row["memory_chunks"], row["disk_chunks"]) == (N, N, 0)
    load_and_check(made[1], "peek-disk", toks, seed)


def test_window_pieces_removed_from_disk_make_a_miss_at_that_chunk(disk_node):
    server, made = disk_node
    seed = 5
    toks = tokens(N, seed)
    store_on_disk_only(server, made[2], toks, seed)
    last = chain_hashes(toks, CHUNK)[-1]
    disk = server.config_path.parent / "disk"
    removed = 0
    for path in iter_files(disk):  # the short window's pieces of the last chunk (both ranks)
        key, _ = read_meta(disk, path.name, path.stat().st_size)
        if key.chunk_hash == last and key.layout.endswith("+g1of3s48"):
            path.unlink()
            removed += 1
    assert removed == 2
    # The disk's index still named the removed files: this lookup finds them gone (a miss); the
    # next one sees chunk 2's full and long-window pieces but not the short window's: N = 2,
    # whose windows (chunk 1's, chunks 0-1's) are there
    assert lookup(server.url, 1, "disk-gone0", toks, MODEL) == 0
    assert lookup(server.url, 1, "disk-gone", toks, MODEL) == 2 * CHUNK
    load_and_check(made[1], "disk-gone", toks[:2 * CHUNK], seed, n=2)


# ---------------------------------------------------------------- Redis shared by two servers


@pytest.mark.redis
def test_through_redis_another_server_loads_the_hybrid_chunks_at_tp1(make_redis, make_server):
    server_a, server_b = redis_pair(make_server, make_redis().url, POOL)
    made: list[WorkerProcess] = []
    try:
        on_a = engine(server_a.url, 2)
        on_b = engine(server_b.url, 1)
        made = on_a + on_b
        seed = 6
        toks = tokens(N, seed)
        store(on_a, toks, seed)
        wait_until(lambda: stats(server_a.url).remote.written_chunks >= stored_pieces(N))
        (row,) = peek(server_b.url, 1, [toks])  # counted in Redis, nothing loaded
        assert (row["hit_chunks"], row["remote_chunks"], row["remote"]) == (N, N, "asked")
        assert stats(server_b.url).remote.loaded_chunks == 0
        assert lookup(server_b.url, 1, "redis1", toks, MODEL) == N * CHUNK
        assert stats(server_b.url).remote.loaded_chunks == needed_pieces(N)
        load_and_check(on_b, "redis1", toks, seed)
        assert stats(server_b.url).remote.corrupt == 0
    finally:
        for worker in made:
            worker.kill()


# ---------------------------------------------------------------- Mamba state (Granite-4-like)

MAMBA_MODEL = "granite-like"
#: Full attention and Mamba state (vLLM 0.32's form: one int8 tensor per layer, a block a row).
MAMBA_GROUPS = [{"kind": "full"}, {"kind": "mamba"}]


def mamba_engine(url: str, world_size: int) -> list[WorkerProcess]:
    made = in_parallel(*(lambda r=r: WorkerProcess(
        url, rank=r, world_size=world_size, model=MAMBA_MODEL, heads=HEADS // world_size,
        head_dim=16, script="hybrid_worker.py", groups=MAMBA_GROUPS, layers_per_group=2)
        for r in range(world_size)))
    return [w for w in made if isinstance(w, WorkerProcess)]


def state_table(first: int, n: int, live: list[int] | None = None) -> list[int]:
    """A Mamba group's block table in vLLM's align mode: only the state blocks at the chunks'
    ends (``live``: those chunks; default all) are real, the rest null."""
    live = list(range(n)) if live is None else live
    return [first + j if j % PER_CHUNK == PER_CHUNK - 1 and j // PER_CHUNK in live else 0
            for j in range(n * PER_CHUNK)]


@pytest.fixture(scope="module")
def mamba_node(module_server: Callable[..., ServerProcess]) -> Iterator[Node]:
    yield from start_node(module_server(POOL, name="mamba"), mamba_engine)


def mamba_store(workers: list[WorkerProcess], toks: list[int], seed: int,
                live: list[int] | None = None) -> None:
    tables = [list(range(1, 1 + N * PER_CHUNK)), state_table(1, N, live)]
    for worker in workers:
        worker("fill_model", tables=tables, seed=seed)
        result = worker("store", req=f"mstore-{seed}", keys=toks, tables=tables)
        assert result["finished"] and not result["failed"], result


def mamba_load_and_check(workers: list[WorkerProcess], request_id: str, toks: list[int],
                         seed: int, n: int) -> None:
    """Each rank loads the full group's chunks and the one state block at the hit's end."""
    tables = [list(range(30, 30 + n * PER_CHUNK)), [0] * (n * PER_CHUNK - 1) + [29 + n * PER_CHUNK]]
    for worker in workers:
        worker("zero", tables=tables)
        result = worker("retrieve", req=request_id, keys=toks[:n * CHUNK], tables=tables)
        assert result["finished"] and not result["failed"] and not result["failed_recving"]
        # the stored logical state block at the end of chunk n - 1, read back at the hit's end
        stored_at = n * PER_CHUNK - 1
        check = worker("check_model", tables=[tables[0], tables[1]], seed=seed,
                       positions=[list(range(n * PER_CHUNK)), [stored_at]])
        assert check == {"equal": True, "null_untouched": True}


def test_mamba_state_at_the_hits_end_loads_byte_exact(mamba_node):
    server, made = mamba_node
    assert made[1][0].hello["pieces"] == [[4, 4, 0, 0, 0], [4, 1, 1, 1, 0]]
    seed = 21
    toks = tokens(N, seed)
    mamba_store(made[1], toks, seed)
    assert lookup(server.url, 1, "m1", toks, MAMBA_MODEL) == N * CHUNK
    mamba_load_and_check(made[1], "m1", toks, seed, N)
    # each rank's state is its own: TP=1 pieces never serve TP=2 (the full group's alone could)
    assert lookup(server.url, 2, "m2-miss", toks, MAMBA_MODEL) == 0
    mamba_store(made[2], toks, seed)
    assert lookup(server.url, 2, "m2", toks, MAMBA_MODEL) == N * CHUNK
    mamba_load_and_check(made[2], "m2", toks, seed, N)


def test_a_prompt_without_the_state_at_a_chunks_end_is_a_miss_at_that_chunk(mamba_node):
    server, made = mamba_node
    seed = 22
    toks = tokens(N, seed)
    mamba_store(made[1], toks, seed, live=[0, 1])  # the state after chunk 2 was never live
    assert lookup(server.url, 1, "m-short", toks, MAMBA_MODEL) == 2 * CHUNK
    mamba_load_and_check(made[1], "m-short", toks, seed, 2)
