"""Prompts, blocks and requests of the servers' TINY model (``servers.TINY``: chunks of 64
tokens, 4 blocks of 16 each), for the tests that store through a worker and ask the server."""

from __future__ import annotations

from typing import Any

from lmcache_core.keys import chain_hashes
from lmcache_core.protocol import messages as m
from lmcache_core.transport.client import MessageQueueClient
from tests.integration.servers import TINY

_TINY: dict[str, Any] = TINY
CHUNK, BLOCK = int(_TINY["chunk_size"]), 16
PER_CHUNK = CHUNK // BLOCK
_MODEL = _TINY["model"]
#: One chunk of it: K/V x layers x tokens x heads x dim x fp16 = 64 KiB.
CHUNK_BYTES = 2 * _MODEL["num_layers"] * CHUNK * _MODEL["num_kv_heads"] * _MODEL["head_dim"] * 2


def tokens(n_chunks: int, seed: int = 0) -> list[int]:
    """A prompt of ``n_chunks`` whole chunks; another ``seed``, another first chunk."""
    return [(seed * 7919 + i) % 50000 for i in range(n_chunks * CHUNK)]


def blocks(first_chunk: int, n_chunks: int) -> list[int]:
    """The worker's blocks of ``n_chunks`` chunks from chunk ``first_chunk`` on."""
    return list(range(first_chunk * PER_CHUNK, (first_chunk + n_chunks) * PER_CHUNK))


def lookup(client: MessageQueueClient, toks: list[int], lookup_id: str = "q", lock: bool = False,
           world_size: int = 1, model: str = "tiny") -> int:
    """Hit chunks of a LOOKUP of ``toks`` (token mode: their prefix chain) for ``world_size``."""
    return client.request(m.LookupRequest(
        model_name=model, world_size=world_size, lookup_id=lookup_id, lock=lock,
        chunk_hashes=chain_hashes(toks, CHUNK))).hit_chunks


def stats(client: MessageQueueClient) -> m.ServerStats:
    return client.server_info().stats
