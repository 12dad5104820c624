"""LMCache 0.5.6's wire spoken from raw DEALER frames (``[uid, op, payloads...]``, each one msgpack
value), to a real server: what its client sends, without its client."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from lmcache_core.server.app import CacheServer
from tests.integration.servers import tiny_config

enc = msgspec.msgpack.encode
NB, BS, H, D = 32, 16, 4, 32  # TINY: 2 layers of 4 KV heads x 32, fp16; chunk 64 = 4 blocks


def call(sock: zmq.Socket, frames: list[bytes], timeout_ms: int = 5000) -> list[bytes] | None:
    """Send ``frames``; the reply, or None when none came within ``timeout_ms``."""
    sock.send_multipart(frames)
    if not sock.poll(timeout_ms):
        return None
    return sock.recv_multipart()


def dealer(url: str) -> zmq.Socket:
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    return sock


def key(request_id: str = "r", end: int = 128, **extra: Any) -> dict:
    """LMCache's key of a request of the TINY model: tokens ``[0, end)`` of 200."""
    return {"model_name": "tiny", "world_size": 1, "worker_id": None,
            "token_ids": list(range(200)), "start": 0, "end": end, "request_id": request_id,
            "cache_salt": "", "request_configs": None, "num_kv_readers": 1, **extra}


def kv_server_with(short_tmp: Path, **extra: Any
                   ) -> Iterator[tuple[CacheServer, list[np.ndarray], list[msgspec.msgpack.Ext]]]:
    """An in-process server (``tiny_config`` with ``extra``), and two NHD layers in LMCache-named
    shared memory of this process (``/lmcache_kv_<pid>_<n>``) as its ``cpu_shm`` descriptors,
    for a fixture to yield from."""
    from multiprocessing import shared_memory

    srv = CacheServer(tiny_config(short_tmp, **{"server.http_url": "http://127.0.0.1:0",
                                                **extra}))
    srv.start()
    shape, nbytes = (2, NB, BS, H, D), 2 * NB * BS * H * D * 2
    segments = [shared_memory.SharedMemory(f"lmcache_kv_{os.getpid()}_{i + 900}", create=True,
                                           size=nbytes) for i in range(2)]
    layers = [np.ndarray(shape, np.float16, buffer=seg.buf) for seg in segments]
    stride = [NB * BS * H * D, BS * H * D, H * D, D, 1]
    descs = [msgspec.msgpack.Ext(1, enc({
        "type": "cpu_shm", "version": 1, "shm_name": "/" + seg.name, "nbytes": nbytes,
        "metadata": {"dtype": "float16", "shape": list(shape), "stride": stride,
                     "storage_offset": 0, "device_uuid": "cpu"}})) for seg in segments]
    try:
        yield srv, layers, descs
    finally:
        srv.stop(2)
        del layers
        for seg in segments:
            seg.close()
            seg.unlink()
