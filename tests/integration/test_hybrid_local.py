"""Chunked-local attention (Llama 4) through the adapters, with real processes: a model of one
full-attention group and one chunked-local group of 96-token attention chunks (1.5 chunks of
64) stored at TP=2 loads byte-exact at TP=1, from memory, from a disk tier and from Redis through
another server; a load reads only the local pieces from the start of the attention chunk the hit
ends in (the part of the oldest that resuming needs; none at an attention chunk's start); a
prompt missing such a piece is a miss at that chunk."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

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

HEADS = 4
MODEL = "llama4-like"
ATTENTION = 96  # tokens of an attention chunk: 6 blocks
GROUPS = [{"kind": "full"}, {"kind": "local", "window_tokens": ATTENTION}]
LAYOUTS = ["float16:2x4x16+g0of2", "float16:2x4x16+g1of2c96"]
POOL = {"server": {"pool_size": "16MiB", "slab_size": "1MiB"}}


def engine(url: str, world_size: int) -> list[WorkerProcess]:
    made = in_parallel(*(lambda r=r: WorkerProcess(
        url, rank=r, world_size=world_size, model=MODEL, heads=HEADS // world_size, head_dim=16,
        script="hybrid_worker.py", groups=GROUPS, layers_per_group=2)
        for r in range(world_size)))
    return [w for w in made if isinstance(w, WorkerProcess)]


def local_start_block(n: int) -> int:
    """The first block a hit of ``n`` chunks needs of the local group: its attention chunk's
    start (vLLM 0.32's ``ChunkedLocalAttentionManager`` gives the null block before it)."""
    return n * CHUNK // ATTENTION * ATTENTION // BLOCK


def needed_local_chunks(n: int) -> int:
    return n - local_start_block(n) // PER_CHUNK


def store_tables(n: int, missing_local: tuple[int, ...] = ()) -> list[list[int]]:
    """Tables of a store of ``n`` chunks from block 1 (the local group's chunks ``missing_local``
    already freed: null)."""
    full = list(range(1, 1 + n * PER_CHUNK))
    local = [0 if j // PER_CHUNK in missing_local else b for j, b in enumerate(full)]
    return [full, local]


def load_tables(n: int) -> list[list[int]]:
    """A load of ``n`` chunks as vLLM allocates it: the local group real from its attention
    chunk's start only."""
    full = list(range(30, 30 + n * PER_CHUNK))
    return [full, [b if j >= local_start_block(n) else 0 for j, b in enumerate(full)]]


def store(workers: list[WorkerProcess], toks: list[int], seed: int, n: int,
          missing_local: tuple[int, ...] = ()) -> None:
    tables = store_tables(n, missing_local)
    for worker in workers:
        worker("fill_model", tables=tables, seed=seed)
        result = worker("store", req=f"store-{seed}-{n}", keys=toks, tables=tables)
        assert result["finished"] and not result["failed"], result


def load_and_check(workers: list[WorkerProcess], request_id: str, toks: list[int], seed: int,
                   n: int) -> None:
    """Each rank loads ``n`` chunks into zeroed blocks: the full group's all, the local group's
    from its attention chunk's start, byte-exact, and nothing in the null block."""
    tables = load_tables(n)
    positions = [list(range(n * PER_CHUNK)), list(range(local_start_block(n), n * PER_CHUNK))]
    for worker in workers:
        worker("zero", tables=tables)
        result = worker("retrieve", req=request_id, keys=toks[:n * CHUNK], tables=tables)
        assert result["finished"] and not result["failed"], result
        assert not result["load_errors"] and not result["failed_recving"], result
        check = worker("check_model", tables=tables, seed=seed, positions=positions)
        assert check == {"equal": True, "null_untouched": True}


def needed_pieces(n: int, stored_by: int = 2) -> int:
    """Pieces a TP=1 hit of ``n`` chunks needs, of pieces stored at TP=``stored_by``."""
    return (n + needed_local_chunks(n)) * stored_by


@pytest.fixture(scope="module")
def node(module_server: Callable[..., ServerProcess]) -> Iterator[Node]:
    yield from start_node(module_server(POOL, name="mem"), engine)


def test_the_local_group_registers_under_a_fingerprint_naming_its_attention_chunk(node):
    server, made = node
    assert made[1][0].hello["pieces"] == [[4, 4, 0, 0, 0], [4, 4, 0, 0, 6]]
    row = next(r for r in server_info(server.url).models if r.model_name == MODEL)
    assert [(g.index, g.kind, g.window_tokens, g.layout) for g in row.groups] == [
        (0, "full", 0, LAYOUTS[0]), (1, "local", ATTENTION, LAYOUTS[1])]
    seed = 30
    store(made[1], tokens(1, seed), seed, 1)
    shown = cli("inspect-chunks", "--url", server.url, "--model", MODEL, "--sort", "key")
    assert shown.code == 0, shown.err
    assert "1/2 local: attention chunks of 96" in shown.out and "0/2 full" in shown.out


@pytest.mark.parametrize("n", [5, 4, 3])  # the oldest needed piece in part, whole, none at all
def test_stored_at_tp2_a_hit_loads_byte_exact_at_tp1(node, n):
    server, made = node
    seed = 31 + n
    toks = tokens(n, seed)
    store(made[2], toks, seed, n)
    before = stats(server.url).engine.retrieved_chunks
    assert lookup(server.url, 1, f"tp1-{n}", toks, MODEL) == n * CHUNK
    load_and_check(made[1], f"tp1-{n}", toks, seed, n)
    # each group's chunks read (a chunk of two TP=2 pieces counts once)
    assert stats(server.url).engine.retrieved_chunks - before == needed_pieces(n, stored_by=1)
    assert lookup(server.url, 2, f"tp2-{n}", toks, MODEL) == n * CHUNK
    load_and_check(made[2], f"tp2-{n}", toks, seed, n)


def test_a_missing_needed_local_piece_cuts_the_hit_back_to_an_attention_chunks_start(node):
    server, made = node
    seed = 40
    toks = tokens(5, seed)
    # 320 tokens need chunk 4's local piece (from 288): gone; 256 need chunk 3's (from 192)
    store(made[1], toks, seed, 5, missing_local=(4,))
    assert lookup(server.url, 1, "cut4", toks, MODEL) == 4 * CHUNK
    load_and_check(made[1], "cut4", toks, seed, 4)
    clear(server.url)
    # chunk 3's gone too: 192 starts an attention chunk (needs nothing of the group)
    store(made[1], toks, seed, 5, missing_local=(3, 4))
    assert lookup(server.url, 1, "cut3", toks, MODEL) == 3 * CHUNK
    load_and_check(made[1], "cut3", toks, seed, 3)
    # the earlier local pieces were never needed: their loss costs nothing
    clear(server.url)
    store(made[1], toks, seed, 5, missing_local=(0, 1, 2, 3))
    assert lookup(server.url, 1, "early", toks, MODEL) == 5 * CHUNK
    load_and_check(made[1], "early", toks, seed, 5)


def peek(url: str, world_size: int, prompts: list[list[int]]) -> list[dict]:
    shown = cli("lookup", "--url", url, "--model", MODEL, "--world-size", str(world_size),
                "--tokens", "-", "--json", stdin=json.dumps(prompts))
    assert shown.code == 0, shown.err
    return list(json.loads(shown.out)["prompts"])


def test_lmcache_lookup_counts_a_local_prefix_as_its_lookup_does(node):
    server, made = node
    seed = 41
    toks = tokens(5, seed)
    store(made[1], toks, seed, 5, missing_local=(4,))
    rows = peek(server.url, 1, [toks, toks[:3 * CHUNK]])
    assert [(r["hit_chunks"], r["groups"]) for r in rows] == [(4, LAYOUTS), (3, LAYOUTS)]
    shown = cli("lookup", "--url", server.url, "--model", MODEL, "--tokens", "-",
                stdin=json.dumps(toks))
    assert shown.code == 0 and "hybrid, 2 KV-cache groups" in shown.out, shown.out
    assert f"{LAYOUTS[1]} (1/2 local: attention chunks of 96)" in shown.out, shown.out


# ---------------------------------------------------------------- disk


@pytest.fixture(scope="module")
def disk_node(module_server: Callable[..., ServerProcess], module_tmp: Path) -> Iterator[Node]:
    config = {**POOL, "disk": {"path": str(module_tmp / "disk"), "max_size": "64MiB",
                               "write_through": True}}
    yield from start_node(module_server(config, name="disk"), engine)


def test_through_the_disk_tier_only_the_needed_local_pieces_load(disk_node):
    server, made = disk_node
    seed, n = 42, 5
    toks = tokens(n, seed)
    before = stats(server.url)
    store(made[2], toks, seed, n)
    wait_until(lambda: stats(server.url).disk.written_chunks
               == before.disk.written_chunks + 2 * n * 2)
    clear(server.url)
    (row,) = peek(server.url, 1, [toks])
    assert (row["hit_chunks"], row["disk_chunks"]) == (n, n)
    assert lookup(server.url, 1, "disk1", toks, MODEL) == n * CHUNK
    assert stats(server.url).disk.loaded_chunks - before.disk.loaded_chunks == needed_pieces(n)
    load_and_check(made[1], "disk1", toks, seed, n)


# ---------------------------------------------------------------- Redis shared by two servers


@pytest.mark.redis
def test_through_redis_another_server_loads_the_local_chunks_at_tp1(make_redis, make_server):
    server_a, server_b = redis_pair(make_server, make_redis().url, POOL)
    made: list[WorkerProcess] = []
    try:
        on_a = engine(server_a.url, 2)
        on_b = engine(server_b.url, 1)
        made = on_a + on_b
        seed, n = 43, 5
        toks = tokens(n, seed)
        store(on_a, toks, seed, n)
        wait_until(lambda: stats(server_a.url).remote.written_chunks >= 2 * n * 2)
        (row,) = peek(server_b.url, 1, [toks])
        assert (row["hit_chunks"], row["remote_chunks"], row["remote"]) == (n, n, "asked")
        assert lookup(server_b.url, 1, "redis1", toks, MODEL) == n * CHUNK
        assert stats(server_b.url).remote.loaded_chunks == needed_pieces(n)
        load_and_check(on_b, "redis1", toks, seed, n)
    finally:
        for worker in made:
            worker.kill()
