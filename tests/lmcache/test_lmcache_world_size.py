"""World size 2 through LMCache 0.5.6's own adapters, unchanged, against a real ``lmcache serve``:
two worker adapters (worker ids 0 and 1, each registering its own CPU KV cache with distinct bytes)
store the same tokens, LMCache's scheduler adapter looks them up, and each rank retrieves exactly
its own bytes."""

from __future__ import annotations

import os
import urllib.request

import pytest
import torch
import zmq

os.environ.setdefault("LMCACHE_MP_TRANSFER_MODE", "lmcache_driven")  # CPU: SHM, server-driven
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
)

from tests.integration.servers import ServerProcess
from tests.lmcache.clients import (
    BLOCK,
    CHUNK,
    DST,
    EXTRA,
    N_CHUNKS,
    NUM_BLOCKS,
    SRC,
    TOKENS,
    finished,
    strategy,
    until,
)

WORLD = 2


@pytest.fixture(scope="module")
def workers(server):
    out = []
    for rank in range(WORLD):  # each rank's 4 KV heads of the model's 8
        layers = {f"model.layers.{i}.attn": torch.zeros(2, NUM_BLOCKS, BLOCK, 4, 32,
                                                        dtype=torch.float16) for i in range(2)}
        adapter = LMCacheMPWorkerAdapter(server.url, zmq.Context.instance(), "tiny", BLOCK,
                                         strategy(rank, WORLD), extra_config=EXTRA)
        adapter.register_kv_caches(layers, layout_hints={"kv_layout": "NHD"})
        out.append((adapter, layers))
    yield out
    for adapter, _ in out:
        adapter.shutdown()


@pytest.fixture(scope="module")
def scheduler(server):
    adapter = LMCacheMPSchedulerAdapter([server.url], zmq.Context.instance(), "tiny", BLOCK,
                                        strategy(0, WORLD), extra_config=EXTRA)
    yield adapter
    adapter.shutdown()


def locks_held(server: ServerProcess) -> int:
    """The server's ``lmcache_lookup_locks`` gauge, scraped from its ``/metrics``."""
    with urllib.request.urlopen(server.http_url() + "/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return int(float(next(line.split()[1] for line in lines
                          if line.startswith("lmcache_lookup_locks "))))


def test_each_rank_retrieves_its_own_bytes(server, workers, scheduler):
    end = N_CHUNKS * CHUNK
    assert scheduler.lmcache_tokens_per_chunk == CHUNK
    for rank, (adapter, layers) in enumerate(workers):
        gen = torch.Generator().manual_seed(100 + rank)
        for layer in layers.values():
            layer[:, SRC] = torch.randint(-100, 100, layer[:, SRC].shape, generator=gen).half()
        op = LoadStoreOp(token_ids=TOKENS, block_ids=[SRC], start=0, end=end)
        adapter.submit_store_request(f"store-{rank}", op, adapter.create_recorded_event())
        finished(adapter, f"store-{rank}", store=True)
    first = workers[0][1]["model.layers.0.attn"][:, SRC]
    assert not torch.equal(first, workers[1][1]["model.layers.0.attn"][:, SRC])  # distinct

    scheduler.maybe_submit_lookup_request("req-ws", TOKENS)
    assert until(lambda: scheduler.check_lookup_result("req-ws"), "lookup") == end
    assert locks_held(server) == WORLD * N_CHUNKS  # each rank's piece of each chunk
    for rank, (adapter, _) in enumerate(workers):
        op = LoadStoreOp(token_ids=TOKENS, block_ids=[DST], start=0, end=end)
        adapter.submit_retrieve_request("req-ws", op, adapter.create_recorded_event())
        finished(adapter, "req-ws", store=False)
        assert not adapter.get_block_ids_with_load_errors()
        assert locks_held(server) == (WORLD - 1 - rank) * N_CHUNKS  # its own went
    for _, layers in workers:
        for layer in layers.values():
            assert torch.equal(layer[:, SRC], layer[:, DST])  # byte-exact, its own rank's
    scheduler.end_session("req-ws")


def test_a_chunk_one_rank_lacks_is_no_hit(server, workers, scheduler):
    """A chunk counts only when every rank's piece is there (LMCache's fan-out lookup)."""
    adapter, _ = workers[0]
    tokens = [t + 3 for t in TOKENS]
    op = LoadStoreOp(token_ids=tokens, block_ids=[SRC], start=0, end=N_CHUNKS * CHUNK)
    adapter.submit_store_request("store-half", op, adapter.create_recorded_event())
    finished(adapter, "store-half", store=True)
    scheduler.maybe_submit_lookup_request("req-half", tokens)
    assert until(lambda: scheduler.check_lookup_result("req-half") is not None, "lookup")
    assert scheduler.check_lookup_result("req-half") == 0
    scheduler.end_session("req-half")
