"""For registry tests: a stand-in for ``kv.mapped.MappedKVCache`` (what ``KVRegistry`` and the
handlers read of a worker's mapping: its device, its chunk's bytes and blocks, whether it was
closed) and the registration request of a tiny one-layer model."""

from __future__ import annotations

import socket

from lmcache_core.protocol import messages as m


class FakeMapping:
    device = None
    chunk_bytes = 1
    blocks_per_chunk = 1

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def register_request(instance_id: int, pid: int, layer: m.TensorDescriptor,
                     hostname: str | None = None) -> m.RegisterKVCacheRequest:
    """Worker ``pid``'s registration of one ``layer`` (of model "tiny", TP=1) under
    ``instance_id``; ``hostname`` defaults to this host's."""
    return m.RegisterKVCacheRequest(
        instance_id=instance_id, model_name="tiny", world_size=1, kv_rank=0, block_size=16,
        layout="flash_attn", layers=[layer], pid=pid,
        hostname=socket.gethostname() if hostname is None else hostname)
