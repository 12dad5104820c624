"""LMCache 0.5.6's ``LMCacheMPWorkerAdapter``, unchanged, registering a GPU KV cache against a real
``lmcache serve`` (issue 24): its ``cuda`` descriptors (CUDA IPC handles of the layers' storages)
go the server's CUDA path, and a store and a retrieve with the worker's recorded events are
byte-exact. Needs CUDA (the ``gpu`` marker: skipped without it) and the lmcache package
(scripts/gpu-check runs it on a lent GPU when it is installed)."""

from __future__ import annotations

import os

import pytest
import torch
import zmq

os.environ.setdefault("LMCACHE_MP_TRANSFER_MODE", "lmcache_driven")  # the GPU default anyway
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
)

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
    lookup,
    strategy,
)

pytestmark = pytest.mark.gpu


def test_lmcache_client_gpu_store_lookup_retrieve_byte_exact(server) -> None:
    layers = {f"model.layers.{i}.attn": torch.zeros(2, NUM_BLOCKS, BLOCK, 4, 32,
                                                    dtype=torch.float16, device="cuda")
              for i in range(2)}
    worker = LMCacheMPWorkerAdapter(server.url, zmq.Context.instance(), "tiny-gpu", BLOCK,
                                    strategy(), extra_config=EXTRA)
    scheduler = LMCacheMPSchedulerAdapter([server.url], zmq.Context.instance(), "tiny-gpu",
                                          BLOCK, strategy(), extra_config=EXTRA)
    try:
        worker.register_kv_caches(layers, layout_hints={"kv_layout": "NHD"})
        gen = torch.Generator(device="cuda").manual_seed(3)
        for layer in layers.values():
            layer[:, SRC] = torch.randint(-100, 100, layer[:, SRC].shape, generator=gen,
                                          device="cuda").half()
        end = N_CHUNKS * CHUNK
        worker.submit_store_request("g-store", LoadStoreOp(token_ids=TOKENS, block_ids=[SRC],
                                                           start=0, end=end),
                                    worker.create_recorded_event())
        finished(worker, "g-store", store=True)
        assert lookup(scheduler, "g-1") == end
        worker.submit_retrieve_request("g-1", LoadStoreOp(token_ids=TOKENS, block_ids=[DST],
                                                          start=0, end=end),
                                       worker.create_recorded_event())
        finished(worker, "g-1", store=False)
        torch.cuda.synchronize()
        assert not worker.get_block_ids_with_load_errors()
        for layer in layers.values():
            assert torch.equal(layer[:, SRC], layer[:, DST])
        scheduler.end_session("g-1")
    finally:
        scheduler.shutdown()
        worker.shutdown()
