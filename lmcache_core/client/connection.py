"""One engine process's connection to ``lmcache serve``: what its scheduler and worker clients share.

``Connection`` holds the ZMQ client of one server, the model's identity (name, world size, rank),
the server's chunk size (asked once, when connecting) and the block arithmetic between vLLM's
blocks and the server's chunks (``chunk_hashes``); the default timeouts of both clients; and the
two helpers of LMCache's API that take a bare ``MessageQueueClient`` (``send_lmcache_request``,
``get_lmcache_chunk_size``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

from lmcache_core.errors import LMCacheTimeoutError, ServerUnreachableError
from lmcache_core.keys import chain_hashes, salt_prefix, striding_block_hashes
from lmcache_core.protocol import messages as m
from lmcache_core.protocol import ops
from lmcache_core.protocol.ops import RequestType
from lmcache_core.transport.client import MessageQueueClient
from lmcache_core.transport.future import MessagingFuture

#: The one logger of both clients: the module name LMCache's adapters log under (and ours did
#: before they moved here), so logging configured for it still applies.
LOGGER_NAME = "lmcache_core.integration.vllm.vllm_multi_process_adapter"

DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_LOOKUP_TIMEOUT_S = 2.0
DEFAULT_HEARTBEAT_S = 5.0


def send_lmcache_request(mq_client: MessageQueueClient, request_type: RequestType,
                         payloads: list[Any]) -> MessagingFuture[Any]:
    """Send one request; the future resolves to its reply struct or raises the server's error."""
    return mq_client.submit_request(request_type, payloads)


def get_lmcache_chunk_size(mq_client: MessageQueueClient) -> int:
    """Ask the server its chunk size; ``ServerUnreachableError`` naming the url if it is silent."""
    future = mq_client.submit(ops.GET_CHUNK_SIZE, m.NoArgs(), mq_client.connect_timeout_s)
    try:
        reply = future.result(mq_client.connect_timeout_s + 1.0)
    except LMCacheTimeoutError:
        raise ServerUnreachableError(
            f"no lmcache server answered at {mq_client.server_url} within "
            f"{mq_client.connect_timeout_s:g}s (start one with: lmcache serve -c <config.yaml>)"
        ) from None
    return reply.chunk_size


def chunk_hashes(block_hashes: Sequence[Any], blocks_in_chunk: int, chunk_size: int,
                 cache_salt: str | None = None) -> list[bytes]:
    """Chunk hashes from vLLM block hashes (strided) or from token ids (prefix-chain hashed,
    from the salt's seed)."""
    if not block_hashes:
        return []
    if isinstance(block_hashes[0], int):
        return chain_hashes(block_hashes, chunk_size, salt_prefix(cache_salt))
    # vLLM's block hashes are bytes already: kept as they are (a copy each cost ~0.1 us).
    return [h if type(h) is bytes else bytes(h)
            for h in striding_block_hashes(block_hashes, blocks_in_chunk)]


class Connection:
    """A client's connection to one server: the ZMQ client, the model's identity, the server's
    chunk size and the block arithmetic. Connecting asks the server its chunk size: a silent server
    raises ``ServerUnreachableError``, a chunk size that is no multiple of ``vllm_block_size``
    ``ValueError`` (the socket is closed either way)."""

    def __init__(self, server_url: str, context: zmq.Context[Any], model_name: str,
                 world_size: int, kv_rank: int, vllm_block_size: int,
                 connect_timeout_s: float, request_timeout_s: float, name: str) -> None:
        if not 0 <= kv_rank < world_size:
            raise ValueError(f"kv_rank {kv_rank} must be in [0, world_size={world_size})")
        self.model_name = model_name
        self.world_size = world_size
        self.kv_rank = kv_rank
        self.vllm_block_size = vllm_block_size
        self.mq_client = MessageQueueClient(server_url, context, request_timeout_s=request_timeout_s,
                                            connect_timeout_s=connect_timeout_s, name=name)
        try:
            self.chunk_size = get_lmcache_chunk_size(self.mq_client)
            if vllm_block_size <= 0 or self.chunk_size % vllm_block_size:
                raise ValueError(
                    f"the lmcache chunk size {self.chunk_size} (server {server_url}) is not a "
                    f"multiple of the vLLM block size {vllm_block_size}")
        except BaseException:
            self.mq_client.close()
            raise
        self.blocks_in_chunk = self.chunk_size // vllm_block_size

    def chunk_hashes(self, block_hashes: Sequence[Any], cache_salt: str | None = None
                     ) -> list[bytes]:
        return chunk_hashes(block_hashes, self.blocks_in_chunk, self.chunk_size, cache_salt)

    def num_blocks_per_chunk(self) -> int:
        return self.blocks_in_chunk

