"""LMCache 0.5.6's ``LMCacheMPSchedulerAdapter`` / ``LMCacheMPWorkerAdapter``, unchanged, against a
real ``lmcache serve``; then the same chunks through this project's adapters (one blake3 chain)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import zmq
from blake3 import blake3

os.environ.setdefault("LMCACHE_MP_TRANSFER_MODE", "lmcache_driven")  # CPU: SHM, server-driven
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
)

from lmcache_core.integration.vllm import vllm_multi_process_adapter as ours
from tests.integration.servers import WorkerProcess
from tests.lmcache.clients import (
    BLOCK,
    CHUNK,
    DST,
    EXTRA,
    N_CHUNKS,
    NUM_BLOCKS,
    PER_CHUNK,
    SRC,
    TOKENS,
    finished,
    lookup,
    strategy,
    until,
)


@pytest.fixture(scope="module")
def worker(server):
    layers = {f"model.layers.{i}.attn": torch.zeros(2, NUM_BLOCKS, BLOCK, 4, 32, dtype=torch.float16)
              for i in range(2)}
    adapter = LMCacheMPWorkerAdapter(server.url, zmq.Context.instance(), "tiny", BLOCK, strategy(),
                                     extra_config=EXTRA)
    adapter.register_kv_caches(layers, layout_hints={"kv_layout": "NHD"})
    yield adapter, layers
    adapter.shutdown()


@pytest.fixture(scope="module")
def scheduler(server):
    adapter = LMCacheMPSchedulerAdapter([server.url], zmq.Context.instance(), "tiny", BLOCK,
                                        strategy(), extra_config=EXTRA)
    yield adapter
    adapter.shutdown()


def test_lmcache_client_store_lookup_retrieve_byte_exact(worker, scheduler):
    adapter, layers = worker
    assert scheduler.lmcache_tokens_per_chunk == CHUNK  # get_chunk_size
    gen = torch.Generator().manual_seed(3)
    for layer in layers.values():
        layer[:, SRC] = torch.randint(-100, 100, layer[:, SRC].shape, generator=gen).half()
    end = N_CHUNKS * CHUNK
    op = LoadStoreOp(token_ids=TOKENS, block_ids=[SRC], start=0, end=end)
    adapter.submit_store_request("req-store", op, adapter.create_recorded_event())
    finished(adapter, "req-store", store=True)
    time.sleep(0.05)

    assert lookup(scheduler, "req-1") == end  # token mode: every complete chunk
    op = LoadStoreOp(token_ids=TOKENS, block_ids=[DST], start=0, end=end)
    adapter.submit_retrieve_request("req-1", op, adapter.create_recorded_event())
    finished(adapter, "req-1", store=False)
    assert not adapter.get_block_ids_with_load_errors()
    for layer in layers.values():
        assert torch.equal(layer[:, SRC], layer[:, DST])
    scheduler.end_session("req-1")

    assert lookup(scheduler, "req-other") == end
    scheduler.free_lookup_locks(TOKENS, 0, end, "req-other")
    scheduler.end_session("req-other")


def test_retrieve_leaves_skipped_whole_chunks_unwritten(worker, scheduler):
    adapter, layers = worker
    end = N_CHUNKS * CHUNK
    for layer in layers.values():
        layer[:, DST] = 0
    assert lookup(scheduler, "req-skip") == end
    op = LoadStoreOp(token_ids=TOKENS, block_ids=[DST], start=0, end=end,
                     skip_first_n_tokens=CHUNK)  # vLLM's prefix cache holds the first chunk
    adapter.submit_retrieve_request("req-skip", op, adapter.create_recorded_event())
    finished(adapter, "req-skip", store=False)
    assert not adapter.get_block_ids_with_load_errors()
    for layer in layers.values():
        assert not layer[:, DST[:PER_CHUNK]].any()
        assert torch.equal(layer[:, SRC[PER_CHUNK:]], layer[:, DST[PER_CHUNK:]])
    scheduler.end_session("req-skip")


def test_a_miss_is_zero_and_a_prefix_counts(scheduler):
    other = [t + 1 for t in TOKENS]
    scheduler.maybe_submit_lookup_request("req-miss", other)
    assert until(lambda: scheduler.check_lookup_result("req-miss") is not None, "lookup")
    assert scheduler.check_lookup_result("req-miss") == 0
    scheduler.end_session("req-miss")
    scheduler.maybe_submit_lookup_request("req-salted", TOKENS, cache_salt="another-tenant")
    assert until(lambda: scheduler.check_lookup_result("req-salted") is not None, "lookup")
    assert scheduler.check_lookup_result("req-salted") == 0  # stored without a salt
    scheduler.end_session("req-salted")


def test_chunks_stored_by_lmcache_are_hits_for_our_adapters(server, worker):
    _adapter, layers = worker
    ours_scheduler = ours.LMCacheMPSchedulerAdapter(server.url, zmq.Context.instance(), "tiny", 1,
                                                    0, BLOCK)
    ours_worker = WorkerProcess(server.url, num_blocks=NUM_BLOCKS)
    try:
        end = N_CHUNKS * CHUNK
        ours_scheduler.maybe_submit_lookup_request("ours-1", TOKENS)
        hit = until(lambda: ours_scheduler.check_lookup_result("ours-1"), "our lookup")
        assert hit == end
        got = ours_worker("retrieve", req="ours-1", keys=TOKENS[:end], blocks=DST)
        assert got["finished"] and not got["failed"] and not got["load_errors"]
        # byte-exact: our worker's blocks hold what LMCache's worker stored
        hasher = blake3()
        for layer in layers.values():
            hasher.update(layer[:, SRC].contiguous().view(torch.uint8).numpy().tobytes())
        assert ours_worker("digest", blocks=DST)["digest"] == hasher.hexdigest()
        ours_scheduler.end_session("ours-1")
    finally:
        ours_worker.close()
        ours_scheduler.close()


def test_a_store_for_a_dropped_registration_fails_at_once(server, worker):
    """The server dropped the registration (here: through our own op, as a reap would): the
    store is answered not ok at once, so the client does not wait for its timeout."""
    from lmcache_core.protocol import messages as m
    from lmcache_core.transport.client import MessageQueueClient

    adapter, _layers = worker
    with MessageQueueClient(server.url, connect_timeout_s=2) as client:
        client.request(m.UnregisterKVCacheRequest(instance_id=adapter.instance_id))
    op = LoadStoreOp(token_ids=[t + 5 for t in TOKENS], block_ids=[SRC], start=0, end=CHUNK)
    started = time.monotonic()
    adapter.submit_store_request("req-dropped", op, adapter.create_recorded_event())
    finished(adapter, "req-dropped", store=True)
    assert time.monotonic() - started < 5
    assert "LMCache store answered not ok" in server.log()  # (b"", False): LMCache logs it
