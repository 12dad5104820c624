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
    """A single-group model's block ids of the chunks (empty with ``group_block_ids``)."""
    invalid_block_ids: list[int] = field(default_factory=list)
    """Blocks vLLM counts as loaded that this load cannot fill (reported as load errors;
    single-group models only)."""
    group_block_ids: list[list[int]] | None = None
    """A hybrid model's block ids of the chunks, one list per KV cache group (``C / B_g`` ids per
    chunk, null ids included: the worker client takes each group's piece blocks of them)."""
    first_chunk: int = 0
    """The request's chunk the first of these is: a chunked-local group's load needs the
    chunks from its attention chunk's start, which the position of the load's end tells."""
    fail: bool = False
    """A hybrid load that cannot be done as vLLM counts it: reported failed (vLLM recomputes)."""
    sync: bool = False
    """A load the step's forward pass reads (vLLM was told it is synchronous): the worker waits
    for it before the forward and reports it only by its failed blocks, never as received."""
    ttl_s: float | None = None
    pin: bool = False
    priority: int = 0
    """A store's retention (the request's ``kv_transfer_params`` hints); loads leave them unset."""
    cache_salt: str | None = None
    """A store's tenant: the request's cache_salt (the worker client sends its ``keys.tenant_tag`` for
    ``server.tenant_quotas``; the hashes already include it)."""


class LMCacheConnectorMetadata(KVConnectorMetadata):
    """One step's loads and stores, and the requests vLLM preempted in it."""

    def __init__(self) -> None:
        self.loads: list[TransferSpec] = []
        self.stores: list[TransferSpec] = []
        self.preempted: set[str] = set()
        self.window_stores: bool = False
        """Some store reads sliding-window blocks, which vLLM may free and reuse from the next
        step on: the worker waits for those stores before that step's forward pass."""
        self.idle: bool = False
        """The step computes nothing (no token scheduled): with loads in flight, the worker waits
        for one to land before reporting (bounded by the load deadline) instead of returning at
        once, so vLLM does not spin through empty steps polling it, taking a core from the
        server's copy, and schedules the loaded request in the very next step."""

    def __repr__(self) -> str:
        loads = [(s.request_id, len(s.chunk_hashes)) for s in self.loads]
        stores = [(s.request_id, len(s.chunk_hashes)) for s in self.stores]
        return (f"LMCacheConnectorMetadata(loads={loads}, stores={stores}, "
                f"preempted={sorted(self.preempted)}, idle={self.idle})")


def per_block_hashes(chunk_hashes: list[bytes], blocks_per_chunk: int) -> list[bytes]:
    """The clients' ``block_hashes`` form: each chunk's hash at its last block (others unused)."""
    out = [b""] * (len(chunk_hashes) * blocks_per_chunk)
    out[blocks_per_chunk - 1::blocks_per_chunk] = chunk_hashes
    return out
