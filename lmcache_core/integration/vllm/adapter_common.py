"""What both seed adapters share: their timeouts, the server's chunk size, the KV cache description,
``LoadStoreOp`` and the connection (client, chunk size, block arithmetic) each adapter owns.

Part of :mod:`.vllm_multi_process_adapter`, which re-exports every public name defined here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import zmq

from lmcache_core.errors import LMCacheTimeoutError, ServerUnreachableError
from lmcache_core.keys import chain_hashes, salt_prefix, striding_block_hashes
from lmcache_core.protocol import messages as m
from lmcache_core.protocol import ops
from lmcache_core.protocol.ops import RequestType
from lmcache_core.transport.client import MessageQueueClient
from lmcache_core.transport.future import MessagingFuture

if TYPE_CHECKING:
    import torch

DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_LOOKUP_TIMEOUT_S = 2.0
DEFAULT_HEARTBEAT_S = 5.0


class KVCache(NamedTuple):
    """A worker's KV caches as the server needs to see them: layout, block size, descriptors."""

    layout: m.KVLayoutName
    block_size: int
    layers: list[m.TensorDescriptor]


def wrap_kv_caches(kv_caches: dict[str, torch.Tensor]) -> KVCache:
    """Describe per-layer KV tensors for registration (CUDA IPC handles or shared-memory names).

    CPU tensors that are not in shared memory yet are moved there in place."""
    from lmcache_core.kv.share import describe_kv_caches

    layout, block_size, layers = describe_kv_caches(kv_caches)
    return KVCache(layout, block_size, layers)


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


@dataclass
class LoadStoreOp:
    """The blocks of one request to store or retrieve.

    ``block_hashes``: vLLM block hashes, one per block (each chunk is named by its last block's
    hash), or the request's token ids from token 0 (hashed into chunks). ``block_ids``: the vLLM
    blocks, from the same start. Only whole chunks are stored or retrieved; a partial tail is left.
    ``cache_salt``: the request's salt, which seeds the chain in token mode (requests with
    different salts never share chunks); ignored there in hash mode (vLLM's block hashes include
    it). In both modes a store's salt names its tenant (``keys.tenant_tag``: server.tenant_quotas).
    ``ttl_s``, ``pin``, ``priority``: retention of the stored chunks (``StoreRequest``'s fields;
    stores only, ignored by retrieves).
    ``group_block_ids``: for a worker registered with KV-cache groups (a hybrid model), one list
    per group: that group's block ids over the same tokens as ``block_hashes`` (from the same
    start, ``chunk_size / block_size`` of the group per chunk; vLLM's null block 0 where it has
    one); ``block_ids`` is not used then. See ``adapter_groups.piece_blocks`` for what each group
    moves. ``first_chunk``: the request's chunk the op's first is (what a chunked-local group
    loads depends on where the load ends in the request; 0: from the request's start).
    ``token_chain``: ``block_hashes`` are chunk hashes the caller chained from token ids
    (``keys.chain_hashes``, LMCache's token mode), each at its chunk's last block, not vLLM's
    block hashes: what its stores say they were made from (``store_hash_mode``).
    """

    block_hashes: list[bytes]
    block_ids: list[int]
    cache_salt: str | None = None
    ttl_s: float | None = None
    pin: bool = False
    priority: int = 0
    group_block_ids: list[list[int]] | None = None
    first_chunk: int = 0
    token_chain: bool = False

    @property
    def retention(self) -> tuple[float | None, bool, int]:
        return self.ttl_s, self.pin, self.priority


def _chunk_hashes(block_hashes: Sequence[Any], blocks_in_chunk: int, chunk_size: int,
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


def store_hash_mode(op: LoadStoreOp) -> m.HashMode:
    """What a store's chunk hashes were made from (``StoreRequest.hash_mode``, counted per model
    for ``lmcache lookup --explain``): "vllm" for vLLM's block hashes; "" for token ids, and for
    chunk hashes the caller chained from token ids itself (``LoadStoreOp.token_chain``). Token
    mode says nothing rather than "tokens" so that a server older than the field (it refuses
    unknown fields) still takes those stores; the server counts "" apart from "vllm", which is all
    ``--explain`` needs."""
    first = op.block_hashes[0] if op.block_hashes else b""
    return "" if op.token_chain or isinstance(first, int) or not op.block_hashes else "vllm"


class _Connection:
    """What both adapters share: the client, the chunk size and the block arithmetic."""

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
        return _chunk_hashes(block_hashes, self.blocks_in_chunk, self.chunk_size, cache_salt)

    def num_blocks_per_chunk(self) -> int:
        return self.blocks_in_chunk

