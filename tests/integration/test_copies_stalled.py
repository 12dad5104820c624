"""GPU copies that do not finish in time (``CopyStream.synchronize`` raises CopiesStalledError)
cannot be cancelled and may land later, so the request's memory stays held and the server stops
(supervisor: a non-zero exit, to be restarted). The CUDA stream is stood in for: the copies run
on the CPU, then the wait for them is made to time out."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lmcache_core.errors import CopiesStalledError, LMCacheError
from lmcache_core.kv.shm import SHM_DIR, SharedSegment, pid_namespace
from lmcache_core.kv.tensors import contiguous_stride
from lmcache_core.protocol import messages as m
from lmcache_core.server.app import CacheServer
from lmcache_core.transport.client import MessageQueueClient
from tests.integration.servers import tiny_config

SHAPE = [2, 8, 16, 4, 32]  # flash_attn, float16, TINY's model: 2 chunks of 4 blocks per layer
LAYER_BYTES = 2 * 8 * 16 * 4 * 32 * 2


class StalledStream:
    """Runs the body's copies, then reports them not done in time (as a stuck GPU would)."""

    @contextmanager
    def run(self, _event_handle: bytes = b"", _timeout_s: float = 0.0) -> Iterator[None]:
        yield
        self.synchronize()

    def synchronize(self, _timeout_s: float = 0.0) -> None:
        raise CopiesStalledError("the server's copies did not complete within 0.1s")


@pytest.fixture
def served(short_tmp: Path) -> Iterator[tuple[CacheServer, MessageQueueClient, int]]:
    name = f"lmcache-{os.getpid()}-{pid_namespace()}-{secrets.token_hex(6)}"
    SharedSegment.create(name, 2 * LAYER_BYTES).close()
    srv = CacheServer(tiny_config(short_tmp))
    srv.start()
    client = MessageQueueClient(srv.url, request_timeout_s=10)
    try:
        descs = [m.TensorDescriptor(kind="shm", dtype="float16", shape=SHAPE,
                                    stride=contiguous_stride(SHAPE), offset_bytes=i * LAYER_BYTES,
                                    segment_nbytes=2 * LAYER_BYTES, shm_name=name)
                 for i in range(2)]
        client.request(m.RegisterKVCacheRequest(
            instance_id=7, model_name="tiny", world_size=1, kv_rank=0, block_size=16,
            layout="flash_attn", layers=descs, pid=os.getpid(), hostname=socket.gethostname()))
        yield srv, client, 7
    finally:
        client.close()
        srv.stop(2)
        os.unlink(f"{SHM_DIR}/{name}")


def stall(srv: CacheServer, instance_id: int) -> None:
    with srv.registry.lease(instance_id) as reg:
        reg.copy_stream = StalledStream()  # type: ignore[assignment]


def test_a_stalled_store_keeps_its_slots_and_stops_the_server(served: Any) -> None:
    srv, client, instance_id = served
    stall(srv, instance_id)
    with pytest.raises(LMCacheError, match="did not complete"):
        client.request(m.StoreRequest(instance_id=instance_id, chunk_hashes=[b"s" * 32],
                                      block_ids=[0, 1, 2, 3]))
    assert srv.supervisor.failed and "GPU copies stalled" in (srv.supervisor.failure or "")
    assert srv.wait(1)  # what `lmcache serve` waits on: it then exits non-zero
    stats = srv.engine.snapshot()
    assert stats.engine.chunks == 0 and srv.pool.bytes_allocated > 0  # not visible, not reusable


def test_a_stalled_retrieve_keeps_its_pieces_held_and_stops_the_server(served: Any) -> None:
    srv, client, instance_id = served
    key = secrets.token_bytes(32)
    assert client.request(m.StoreRequest(instance_id=instance_id, chunk_hashes=[key],
                                         block_ids=[0, 1, 2, 3])).stored == 1
    stall(srv, instance_id)
    with pytest.raises(LMCacheError, match="did not complete"):
        client.request(m.RetrieveRequest(instance_id=instance_id, chunk_hashes=[key],
                                         block_ids=[4, 5, 6, 7]))
    assert srv.supervisor.failed
    [piece] = srv.engine.store.inspect().pieces.values()
    assert piece.readers == 1  # still read: never evicted, its slot never handed out again
