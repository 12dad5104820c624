"""One server for a whole node: chunks shared across tensor-parallel sizes, several models and
dtypes side by side, never a chunk of another layout. Real server, real worker processes."""

from __future__ import annotations

import pytest

from tests.integration.chunks import BLOCK, CHUNK, PER_CHUNK, blocks, tokens
from tests.integration.cross_tp import HEADS, load_and_check, server_info, store
from tests.integration.cross_tp import lookup as shared_lookup
from tests.integration.servers import WorkerProcess

pytestmark = pytest.mark.server_config({"server": {"pool_size": "16MiB", "slab_size": "1MiB"}})


def group(url: str, world_size: int, model: str = "xtp", **spec: object) -> list[WorkerProcess]:
    """The ranks of one engine of ``world_size`` (each holds HEADS / world_size heads)."""
    heads = 1 if spec.get("mla") else HEADS // world_size
    return [WorkerProcess(url, rank=r, world_size=world_size, model=model, heads=heads,
                          **spec) for r in range(world_size)]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engines(server):
    made = {w: group(server.url, w) for w in (1, 2, 4)}
    yield made
    for workers in made.values():
        for worker in workers:
            worker.close()


def lookup(url: str, world_size: int, request_id: str, toks: list[int],
           model: str = "xtp") -> int:
    return shared_lookup(url, world_size, request_id, toks, model)


@pytest.mark.parametrize(("stored_by", "read_by"), [(2, 1), (1, 2), (1, 4), (2, 4), (4, 1)])
def test_chunks_stored_at_one_tp_size_load_byte_exact_at_another(server, engines, stored_by,
                                                                  read_by):
    seed = 10 * stored_by + read_by
    toks = tokens(3, seed)
    store(engines[stored_by], toks, seed, 3)
    request_id = f"x{stored_by}{read_by}"
    assert lookup(server.url, read_by, request_id, toks) == 3 * CHUNK
    load_and_check(engines[read_by], request_id, toks, seed, 3)


def test_a_lookup_does_not_count_a_chunk_missing_a_ranks_heads(server, engines):
    toks = tokens(2, 99)
    store(engines[2][:1], toks, 99, 2)  # rank 0 of TP=2 only: heads 0-3
    assert lookup(server.url, 2, "half2", toks) == 0
    assert lookup(server.url, 1, "half1", toks) == 0
    store(engines[4][2:3], toks, 99, 2)  # rank 2 of TP=4: heads 4-5; 6-7 still missing
    assert lookup(server.url, 1, "half1b", toks) == 0
    store(engines[4][3:], toks, 99, 2)  # rank 3 of TP=4: now every head is there
    assert lookup(server.url, 1, "whole1", toks) == 2 * CHUNK
    load_and_check(engines[1], "whole1", toks, 99, 2)  # from three pieces of two TP sizes


def test_another_dtype_or_shape_under_the_same_model_name_never_loads(server, engines, make_worker):
    """Same model name, same bytes per chunk, another dtype: never served (wrong tokens)."""
    toks = tokens(2, 7)
    store(engines[1], toks, 7, 2)
    bf16 = make_worker(server.url, model="xtp", heads=HEADS, dtype="bfloat16")
    reshaped = make_worker(server.url, model="xtp", heads=HEADS // 2, head_dim=64)
    for worker in (bf16, reshaped):
        worker("fill", blocks=blocks(8, 2), seed=5)
        before = worker("digest", blocks=blocks(8, 2))["digest"]
        result = worker("retrieve", req="other", keys=toks, blocks=blocks(8, 2))
        assert result["load_errors"] == blocks(8, 2)
        assert worker("digest", blocks=blocks(8, 2))["digest"] == before  # untouched


def test_two_models_of_different_shapes_and_dtypes_share_one_server(server, engines):
    other = group(server.url, 2, model="other", layers=3, head_dim=16, dtype="bfloat16")
    try:
        toks_a, toks_b = tokens(2, 31), tokens(2, 32)
        store(engines[1], toks_a, 31, 2)
        store(other, toks_b, 32, 2)
        assert lookup(server.url, 2, "a", toks_a) == 2 * CHUNK
        assert lookup(server.url, 2, "b", toks_b, model="other") == 2 * CHUNK
        assert lookup(server.url, 2, "ab", toks_b) == 0  # model names keep them apart
        load_and_check(engines[2], "a", toks_a, 31, 2)
        load_and_check(other, "b", toks_b, 32, 2)
        models = {row.model_name: row for row in server_info(server.url).models}
        assert models["other"].layouts == ["bfloat16:3x8x16"]
        assert models["other"].registered == 2 and models["other"].pieces >= 4
        assert "float16:2x8x32" in models["xtp"].layouts
    finally:
        for worker in other:
            worker.close()


def test_cpu_engines_share_chunks_in_their_block_order_across_tp_sizes(server, engines):
    """vLLM's CPU backend's tensors (``cpu_attn``): chunks in the engine's block order, pieces of
    head ranges across TP sizes byte-exact, under a fingerprint that names the block size, so
    an engine of the canonical order (a GPU layout) under the same model name never loads them."""
    cpu = {w: group(server.url, w, model="xtp", cpu_attn=True) for w in (1, 2)}
    try:
        for stored_by, read_by, seed in ((2, 1, 61), (1, 2, 62), (1, 1, 63)):
            toks = tokens(2, seed)
            store(cpu[stored_by], toks, seed, 2)
            assert lookup(server.url, read_by, f"c{seed}", toks) == 2 * CHUNK
            load_and_check(cpu[read_by], f"c{seed}", toks, seed, 2)
        models = {row.model_name: row for row in server_info(server.url).models}
        assert f"float16:2x8x32b{BLOCK}" in models["xtp"].layouts
        gpu = engines[1][0]  # flash-attn tensors, the same model and shape
        gpu("fill", blocks=blocks(8, 2), seed=5)
        before = gpu("digest", blocks=blocks(8, 2))["digest"]
        result = gpu("retrieve", req="canonical", keys=tokens(2, 63), blocks=blocks(8, 2))
        assert result["load_errors"] == blocks(8, 2)
        assert gpu("digest", blocks=blocks(8, 2))["digest"] == before  # untouched
    finally:
        for workers in cpu.values():
            for worker in workers:
                worker.close()


def test_mla_pieces_serve_every_tp_size(server):
    made = {w: group(server.url, w, model="mla", mla=True, head_dim=64) for w in (1, 2)}
    try:
        toks = tokens(2, 41)
        store(made[2], toks, 41, 2)  # both ranks store the same latent: one piece
        stats = server_info(server.url)
        assert {r.model_name: r.pieces for r in stats.models}["mla"] == 2
        assert lookup(server.url, 1, "mla1", toks, model="mla") == 2 * CHUNK
        load_and_check(made[1], "mla1", toks, 41, 2)
        assert lookup(server.url, 2, "mla2", toks, model="mla") == 2 * CHUNK
        held = server_info(server.url).stats.engine.locks_held
        # every rank reads the one piece: the first rank's retrieve leaves the locks to the other
        load_and_check(made[2][:1], "mla2", toks, 41, 2)
        assert server_info(server.url).stats.engine.locks_held == held
        load_and_check(made[2][1:], "mla2", toks, 41, 2)
        assert server_info(server.url).stats.engine.locks_held == held - 2
    finally:
        for workers in made.values():
            for worker in workers:
                worker.close()


def test_a_model_quota_bounds_its_share_and_spares_the_others(tmp_path, make_server, make_worker):
    piece = 2 * 2 * CHUNK * HEADS * 32 * 2  # layers x K/V x tokens x heads x dim x fp16
    srv = make_server({"server": {"pool_size": "4MiB", "slab_size": "1MiB",
                                  "quotas": {"capped": 3 * piece}}})
    capped = make_worker(srv.url, model="capped", heads=HEADS)
    free = make_worker(srv.url, model="free", heads=HEADS)
    store([free], tokens(4, 51), 51, 4)
    store([capped], tokens(5, 52), 52, 5)  # 5 pieces against a quota of 3
    models = {row.model_name: row for row in server_info(srv.url).models}
    assert models["capped"].quota_bytes == 3 * piece
    assert models["capped"].bytes_used <= 3 * piece
    assert models["free"].bytes_used == 4 * piece  # untouched by the other's quota
    assert lookup(srv.url, 1, "f", tokens(4, 51), model="free") == 4 * CHUNK


def test_eviction_runs_across_models_of_different_piece_sizes(tmp_path, make_server, make_worker):
    """Model a's pieces fill two of four slabs; model b's larger pieces then need three: a's
    least recently used slab goes whole (the tail of its prefix), and what stays of both is
    byte-exact."""
    srv = make_server({"server": {"pool_size": "2MiB", "slab_size": "512KiB"}})
    small = make_worker(srv.url, model="a", heads=4, num_blocks=128)  # 64 KiB pieces
    large = make_worker(srv.url, model="b", layers=3, heads=8, head_dim=16,
                        dtype="bfloat16", num_blocks=128)  # 96 KiB pieces
    toks_a, toks_b = tokens(16, 61), tokens(12, 62)
    small("fill_model", blocks=blocks(0, 16), seed=61)
    assert small("store", req="a", keys=toks_a, blocks=blocks(0, 16))["finished"]
    large("fill_model", blocks=blocks(0, 12), seed=62)
    result = large("store", req="b", keys=toks_b, blocks=blocks(0, 12))
    assert result["finished"] and not result["failed"], result
    assert lookup(srv.url, 1, "b", toks_b, model="b") == 12 * CHUNK
    assert lookup(srv.url, 1, "a", toks_a, model="a") == 8 * CHUNK  # its tail slab went
    stats = server_info(srv.url).stats
    assert stats.engine.evictions == 8 and stats.engine.pool_slabs_free == 0
    for worker, request_id, toks, n in ((large, "b", toks_b, 12),
                                        (small, "a", toks_a[:8 * CHUNK], 8)):
        target = list(range(64, 64 + n * PER_CHUNK))
        worker("zero", blocks=target)
        result = worker("retrieve", req=request_id, keys=toks, blocks=target)
        assert result["finished"] and not result["load_errors"], result
        want = worker("digest", blocks=blocks(0, n))["digest"]
        assert worker("digest", blocks=target)["digest"] == want


def test_a_retrieve_with_a_bad_block_id_writes_nothing(server, engines):
    """Chunk 0 held whole (TP=1), chunk 1 as TP=2 pieces: the copies go chunk by chunk, and the
    pieces' path checks ids as it copies, so an out-of-range id for chunk 1 used to leave chunk
    0 written before the request failed. The ids are checked whole first."""
    toks = tokens(2, 88)
    store(engines[1], toks[:CHUNK], 88, 1)
    store(engines[2], toks, 88, 2)
    assert lookup(server.url, 1, "bad-ids", toks) == 2 * CHUNK
    (worker,) = engines[1]
    target = blocks(8, 1)
    worker("zero", blocks=target)
    before = worker("digest", blocks=target)["digest"]
    result = worker("retrieve", req="bad-ids", keys=toks, blocks=target + [10_000] * PER_CHUNK)
    assert result["finished"] and result["failed"], result
    assert worker("digest", blocks=target)["digest"] == before
