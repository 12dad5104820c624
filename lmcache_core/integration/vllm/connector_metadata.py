"""What the connector's scheduler side sends its worker side each step: loads, stores, preemptions.

Part of :mod:`.lmcache_connector`, which re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class TransferSpec:
    """Whole chunks of one request: their hashes (one per chunk) and vLLM block ids."""

    request_id: str
    chunk_hashes: list[bytes]
    block_ids: list[int]
    invalid_block_ids: list[int] = field(default_factory=list)
    """Blocks vLLM counts as loaded that this load cannot fill (reported as load errors)."""
    ttl_s: float | None = None
    pin: bool = False
    priority: int = 0
    """A store's retention (the request's ``kv_transfer_params`` hints); loads leave them unset."""
    cache_salt: str | None = None
    """A store's tenant: the request's cache_salt (the adapter sends its ``keys.tenant_tag`` for
    ``server.tenant_quotas``; the hashes already include it)."""


class LMCacheConnectorMetadata(KVConnectorMetadata):
    """One step's loads and stores, and the requests vLLM preempted in it."""

    def __init__(self) -> None:
        self.loads: list[TransferSpec] = []
        self.stores: list[TransferSpec] = []
        self.preempted: set[str] = set()

    def __repr__(self) -> str:
        loads = [(s.request_id, len(s.chunk_hashes)) for s in self.loads]
        stores = [(s.request_id, len(s.chunk_hashes)) for s in self.stores]
        return f"LMCacheConnectorMetadata(loads={loads}, stores={stores}, preempted={sorted(self.preempted)})"


def per_block_hashes(chunk_hashes: list[bytes], blocks_per_chunk: int) -> list[bytes]:
    """The adapters' ``block_hashes`` form: each chunk's hash at its last block (others unused)."""
    out = [b""] * (len(chunk_hashes) * blocks_per_chunk)
    out[blocks_per_chunk - 1::blocks_per_chunk] = chunk_hashes
    return out
