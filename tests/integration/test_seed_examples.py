"""The seeds' own "Usage Examples", run against real processes with only the import path swapped
(``lmcache`` -> ``lmcache_core``) and the url made local; then what each example leads to is checked.

* async lookup (seeds/async-lookup.txt): the client here, the server side in a spawned worker process
  with a real ``CacheEngine``; ``token_ids`` is a ``torch.Tensor``.
* mp adapter (seeds/mp-adapter.txt): both adapters here against a real ``lmcache serve``, with KV
  caches in shared memory (a CPU host, so the "cuda event" is None, as vLLM's CPU workers pass).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from blake3 import blake3

from tests import forkserver
from tests.harness import wait_until
from tests.integration.servers import ServerProcess

# ---------------------------------------------------------------------- async lookup seed

CHUNK = 64
TOKENS = [(i * 7919) % 32000 for i in range(8 * CHUNK + 5)]  # 8 complete chunks = 512 tokens
HELD = 3  # chunks the worker's engine holds
MODEL = "tiny"
ENGINE_ID = "seed"
MANUAL_ID = "req-123"  # the example's id: the engine leaves it to send_response_to_scheduler


def lookup_worker_main(conn: Connection, runtime_dir: str) -> None:
    """The example's server side, in its own process: ``LMCacheAsyncLookupServer(lmcache_engine,
    metadata)`` in front of a real engine holding the prompt's first HELD chunks. The engine answers
    every lookup itself except MANUAL_ID, which it leaves pending (as a prefetch still running
    would) until the test asks for the example's ``send_response_to_scheduler`` call."""
    from lmcache_core.engine import CacheEngine
    from lmcache_core.keys import ChunkKey, chain_hashes, opaque_layout
    from lmcache_core.lookup_client import LMCacheMetadata
    from lmcache_core.storage.pool import MemoryPool
    from lmcache_core.v1.lookup_client.lmcache_async_lookup_client import LMCacheAsyncLookupServer

    arrived = threading.Event()

    class Engine(CacheEngine):
        def async_lookup_and_prefetch(self, lookup_id: str, hashes: Sequence[bytes],
                                      offsets: Sequence[int] | None = None, pin: bool = True,
                                      request_configs: dict[str, Any] | None = None,
                                      **kw: Any) -> int | None:
            if lookup_id == MANUAL_ID:
                arrived.set()
                return None
            return super().async_lookup_and_prefetch(lookup_id, hashes, offsets, pin,
                                                     request_configs, **kw)

    lmcache_engine = Engine(MemoryPool.slots(64, 16, pin=False), CHUNK)
    keys = [ChunkKey(MODEL, opaque_layout(1), 0, 1, h)
            for h in chain_hashes(TOKENS, CHUNK)[:HELD]]
    lmcache_engine.store.finish_store(lmcache_engine.store.begin_store(keys, 64))
    metadata = LMCacheMetadata(model_name=MODEL, world_size=1, worker_id=0, engine_id=ENGINE_ID,
                               runtime_dir=runtime_dir)

    # Server side (worker process)
    server = LMCacheAsyncLookupServer(lmcache_engine, metadata)
    # Server processes requests in background thread
    conn.send("ready")
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            server.close()
            return
        if cmd == "answer":
            if not arrived.wait(10):
                conn.send("the lookup never reached the worker")
                continue
            server.send_response_to_scheduler("req-123", num_hit_tokens=512)
            conn.send("sent")
        elif cmd == "locks":
            conn.send(len(lmcache_engine.store.inspect().locks_of("req-0")))
        elif cmd == "close":
            server.close()
            conn.send({"socket_left": os.path.exists(server.socket_path)})
            return


class LookupWorker:
    def __init__(self, runtime_dir: str) -> None:
        ctx = forkserver.mp_context()  # a clean interpreter's child, as vLLM's workers are
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=lookup_worker_main, args=(child, runtime_dir), daemon=True,
                                name="seed-lookup-worker")
        self.proc.start()
        child.close()
        assert self.conn.poll(60), "the lookup worker did not start"
        assert self.conn.recv() == "ready"

    def __call__(self, cmd: str) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(15), f"no answer to {cmd!r}"
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.close()  # EOF: the worker closes its server and exits
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def poll(check: Callable[[], int | None], timeout_s: float = 10.0) -> int:
    """Call ``check`` until it answers (its answer stays put until cleared)."""
    wait_until(lambda: check() is not None, timeout_s, "no answer in time")
    result = check()
    assert result is not None
    return result


@pytest.fixture
def runtime_dir(short_tmp: Path) -> str:
    return str(short_tmp)


def test_async_lookup_seed_example(runtime_dir: str) -> None:
    from lmcache_core.lookup_client import LMCacheEngineConfig, LMCacheMetadata
    from lmcache_core.v1.lookup_client.abstract_client import LookupClientInterface
    from lmcache_core.v1.lookup_client.lmcache_async_lookup_client import (
        LMCacheAsyncLookupClient,
        LMCacheAsyncLookupServer,
    )

    assert issubclass(LMCacheAsyncLookupClient, LookupClientInterface)
    assert not issubclass(LMCacheAsyncLookupServer, LookupClientInterface)
    worker = LookupWorker(runtime_dir)
    try:
        config = LMCacheEngineConfig(chunk_size=CHUNK, lookup_timeout_ms=10_000)
        metadata = LMCacheMetadata(model_name=MODEL, world_size=1, engine_id=ENGINE_ID,
                                   runtime_dir=runtime_dir)
        token_ids = torch.tensor(TOKENS)  # the seed's lookup takes a tensor or a list
        client = LMCacheAsyncLookupClient(config, metadata)
        try:
            assert client.supports_producer_reuse() is True
            # A lookup the worker's engine answers: the tensor hashes as the list did there.
            assert client.lookup(token_ids, lookup_id="req-0") is None
            assert poll(lambda: client.lookup_cache("req-0")) == HELD * CHUNK
            assert worker("locks") == HELD  # pinned for the retrieve
            client.cancel_lookup("req-0")
            assert client.lookup_cache("req-0") == -1
            # the cancel reached the worker, which released its pins
            wait_until(lambda: not worker("locks"), what="the cancel never released the pins")

            # ---- the seed's example, client side
            client.lookup(token_ids, lookup_id="req-123")
            # Poll for result
            result = client.lookup_cache("req-123")
            # result is None while ongoing, int >= 0 when complete
            assert result is None  # the worker's engine has not answered it
            # ---- the example's server side, in the worker
            assert worker("answer") == "sent"
            result = poll(lambda: client.lookup_cache("req-123"))
            assert result == 512
            # Cleanup
            client.clear_lookup_status("req-123")
            assert client.lookup_cache("req-123") == -1
        finally:
            client.close()
        assert not os.path.exists(client.socket_path)
        assert worker("close") == {"socket_left": False}  # server.close()
    finally:
        worker.stop()


def test_lookup_client_interface_defaults() -> None:
    """A client that only implements the abstract methods gets the seed's defaults."""
    from lmcache_core.lookup_client import LookupClientInterface

    assert LookupClientInterface.__abstractmethods__ == {"lookup", "lookup_cache", "close"}
    with pytest.raises(TypeError):
        LookupClientInterface()  # type: ignore[abstract]

    class Sync(LookupClientInterface):
        def __init__(self) -> None:
            self.results: dict[str, int] = {}

        def lookup(self, token_ids: Any, lookup_id: str,
                   request_configs: dict[str, Any] | None = None) -> int | None:
            self.results[lookup_id] = len(token_ids)
            return self.results[lookup_id]

        def lookup_cache(self, lookup_id: str) -> int | None:
            return self.results.get(lookup_id, -1)

        def clear_lookup_status(self, lookup_id: str) -> None:
            self.results.pop(lookup_id, None)

        def close(self) -> None:
            self.results.clear()

    client = Sync()
    assert client.lookup([1, 2, 3], "a") == 3 and client.lookup_cache("a") == 3
    client.cancel_lookup("a")  # by default: what clear_lookup_status does
    assert client.lookup_cache("a") == -1
    assert client.supports_producer_reuse() is False


# ---------------------------------------------------------------------- mp adapter seed

BLOCK = 16
PER_CHUNK = CHUNK // BLOCK
N_CHUNKS = 3
LAYERS, HEADS, HEAD_DIM = 2, 4, 32  # the test server's slot: 2 x 2 x 64 x 4 x 32 fp16 = 64 KiB


def vllm_block_hashes(n_blocks: int, seed: int) -> list[bytes]:
    """vLLM-style block hashes: each covers its whole prefix."""
    out, prev = [], seed.to_bytes(8, "big")
    for i in range(n_blocks):
        prev = blake3(prev + i.to_bytes(4, "big")).digest()
        out.append(prev)
    return out


def wait_finished(worker_adapter: Any, request_id: str, kind: str) -> None:
    def finished() -> bool:
        stores, retrieves = worker_adapter.get_finished({request_id})
        return request_id in ((stores if kind == "store" else retrieves) or set())

    wait_until(finished, what=f"the {kind} of {request_id} never finished")


def test_mp_adapter_seed_example(server: ServerProcess) -> None:
    from lmcache_core.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPSchedulerAdapter,
        LMCacheMPWorkerAdapter,
        LoadStoreOp,
    )
    from lmcache_core.kv.share import allocate_shared_kv_caches, release_shared_kv_caches

    block_hashes = vllm_block_hashes(N_CHUNKS * PER_CHUNK, seed=5)
    hashes, ids = block_hashes, list(range(N_CHUNKS * PER_CHUNK))
    kv_cache_dict, segment = allocate_shared_kv_caches(
        LAYERS, [2, 4 * N_CHUNKS * PER_CHUNK, BLOCK, HEADS, HEAD_DIM], torch.float16)
    gen = torch.Generator().manual_seed(11)
    for layer in kv_cache_dict.values():
        layer[:, ids] = torch.randint(-100, 100, layer[:, ids].shape, generator=gen).to(layer.dtype)
    cuda_event = None  # CPU host: nothing to wait for (vLLM's CPU workers pass no event either)

    ctx = zmq.Context()
    scheduler_adapter = worker_adapter = None
    try:
        # Scheduler side: lookup KV cache matches
        scheduler_adapter = LMCacheMPSchedulerAdapter(
            server_url=server.url,
            context=ctx,
            model_name="meta-llama/Llama-3.1-8B",
            world_size=1,
            kv_rank=0,
            vllm_block_size=16,
        )

        scheduler_adapter.maybe_submit_lookup_request("req-1", block_hashes)
        result = scheduler_adapter.check_lookup_result("req-1")
        if result is not None:
            print(f"Matched {result} tokens from cache")
        assert poll(lambda: scheduler_adapter.check_lookup_result("req-1")) == 0  # nothing stored

        # Worker side: register KV caches and store
        worker_adapter = LMCacheMPWorkerAdapter(
            server_url=server.url,
            context=ctx,
            model_name="meta-llama/Llama-3.1-8B",
            world_size=1,
            kv_rank=0,
            vllm_block_size=16,
        )
        worker_adapter.register_kv_caches(kv_cache_dict)

        op = LoadStoreOp(block_hashes=hashes, block_ids=ids)
        worker_adapter.submit_store_request("req-1", op, cuda_event)

        # ---- what the example leads to: the store lands, a later lookup finds it, and a
        # retrieve into other blocks brings back the same bytes.
        wait_finished(worker_adapter, "req-1", "store")
        assert "req-1" not in worker_adapter.failed_stores
        scheduler_adapter.maybe_submit_lookup_request("req-2", block_hashes)
        assert poll(lambda: scheduler_adapter.check_lookup_result("req-2")) == N_CHUNKS * CHUNK
        other = [i + len(ids) for i in ids]
        worker_adapter.submit_retrieve_request("req-2", LoadStoreOp(hashes, other), cuda_event)
        wait_finished(worker_adapter, "req-2", "retrieve")
        assert "req-2" not in worker_adapter.failed_retrieves
        for layer in kv_cache_dict.values():
            assert torch.equal(layer[:, other], layer[:, ids])
        for request_id in ("req-1", "req-2"):
            scheduler_adapter.end_session(request_id).result(5)
        info = scheduler_adapter.mq_client.server_info()
        assert info.stats.engine.locks_held == 0

        # batched submits check that there is one op per request id, before sending anything
        for submit in (worker_adapter.batched_submit_store_requests,
                       worker_adapter.batched_submit_retrieve_requests):
            with pytest.raises(ValueError, match="2 request ids but 1 ops"):
                submit(["req-3", "req-4"], [op], cuda_event)
        assert worker_adapter.store_futures("req-3") == []
        assert worker_adapter.get_finished({"req-3", "req-4"}) == (None, None)
    finally:
        if worker_adapter is not None:
            worker_adapter.shutdown()
        if scheduler_adapter is not None:
            scheduler_adapter.close()
        release_shared_kv_caches(segment)
        ctx.destroy(linger=0)


def test_failed_requests_kept_are_bounded(server: ServerProcess, monkeypatch) -> None:
    """A long-running worker misses routinely: the failures it keeps for inspection stay bounded
    (the newest kept), instead of one entry per failed request forever."""
    from lmcache_core.client import worker as worker_client
    from lmcache_core.integration.vllm import vllm_multi_process_adapter as adapter_module
    from lmcache_core.kv.share import allocate_shared_kv_caches, release_shared_kv_caches

    monkeypatch.setattr(worker_client, "MAX_FAILURES_KEPT", 4)
    kv_cache_dict, segment = allocate_shared_kv_caches(
        LAYERS, [2, N_CHUNKS * PER_CHUNK, BLOCK, HEADS, HEAD_DIM], torch.float16)
    worker = adapter_module.LMCacheMPWorkerAdapter(server.url, None, "meta-llama/Llama-3.1-8B",
                                                   1, 0, BLOCK)
    try:
        worker.register_kv_caches(kv_cache_dict)
        ids = list(range(N_CHUNKS * PER_CHUNK))
        for i in range(10):  # chunks nobody stored: each retrieve fails (its blocks unloaded)
            request_id = f"miss-{i}"
            worker.submit_retrieve_request(
                request_id, adapter_module.LoadStoreOp(vllm_block_hashes(len(ids), 1000 + i), ids),
                None)
            wait_finished(worker, request_id, "retrieve")
        assert list(worker.failed_retrieves) == [f"miss-{i}" for i in range(6, 10)]
        assert worker.get_block_ids_with_load_errors() == set(ids)
    finally:
        worker.shutdown()
        release_shared_kv_caches(segment)
