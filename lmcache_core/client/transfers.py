"""What a worker's store or retrieve carries, and the worker's stores and retrieves in flight.

``LoadStoreOp`` names the blocks of one vLLM request to move (and what its stores ask for:
retention, tenant, hash mode: ``store_hash_mode``). A ``Transfer`` is one store or retrieve request
sent to the server; each vLLM request it covers keeps it in its ``RequestTransfers`` until the
worker client reports the request finished. ``transfer_failure`` and ``unloaded_blocks`` read a
finished transfer's reply; ``event_handle`` is what a request carries of the worker's CUDA event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmcache_core.protocol import messages as m
from lmcache_core.transport.future import MessagingFuture


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
    one); ``block_ids`` is not used then. See ``groups.piece_blocks`` for what each group
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


def store_hash_mode(op: LoadStoreOp) -> m.HashMode:
    """What a store's chunk hashes were made from (``StoreRequest.hash_mode``, counted per model
    for ``lmcache lookup --explain``): "vllm" for vLLM's block hashes; "" for token ids, and for
    chunk hashes the caller chained from token ids itself (``LoadStoreOp.token_chain``). Token
    mode says nothing rather than "tokens" so that a server older than the field (it refuses
    unknown fields) still takes those stores; the server counts "" apart from "vllm", which is all
    ``--explain`` needs."""
    first = op.block_hashes[0] if op.block_hashes else b""
    return "" if op.token_chain or isinstance(first, int) or not op.block_hashes else "vllm"


def event_handle(event: Any) -> bytes:
    """The IPC handle of a worker's CUDA event; ``None`` (CPU) means there is nothing to wait on."""
    if event is None:
        return b""
    from lmcache_core.kv.cuda_events import export_event

    return export_event(event)


@dataclass
class Transfer:
    """One store or retrieve request in flight, covering one or more vLLM requests."""

    future: MessagingFuture[Any]
    request_ids: list[str]
    block_ids: list[int]


@dataclass
class RequestTransfers:
    """The transfers of one vLLM request, until the worker client reports it finished."""

    transfers: list[Transfer] = field(default_factory=list)


def unloaded_blocks(transfer: Transfer, blocks_in_chunk: int) -> list[int]:
    """The blocks a failed retrieve left unfilled: those of the chunks its reply names
    missing (not cached, or cut by the deadline), or all of them after an error reply
    (nothing was copied then, or what was is not trusted)."""
    if transfer.future.exception(0) is not None:
        return transfer.block_ids
    reply = transfer.future.result(0)
    if not isinstance(reply, m.RetrieveReply):
        return transfer.block_ids
    blocks: list[int] = []
    for index in reply.missing:
        chunk = transfer.block_ids[index * blocks_in_chunk:(index + 1) * blocks_in_chunk]
        if len(chunk) != blocks_in_chunk:  # an index the request did not have: trust nothing
            return transfer.block_ids
        blocks += chunk
    return blocks


def transfer_failure(transfer: Transfer) -> str | None:
    """Why a finished transfer failed (the error, or the chunks it did not move), else None."""
    exc = transfer.future.exception(0)
    if exc is not None:
        return f"{type(exc).__name__}: {exc}"
    reply = transfer.future.result(0)
    if isinstance(reply, m.RetrieveReply) and reply.missing:
        if reply.late:
            rest = len(reply.missing) - reply.late
            return (f"{len(reply.missing)} chunk(s) not loaded: {reply.late} past the load "
                    f"deadline" + (f", {rest} no longer cached" if rest else ""))
        return f"{len(reply.missing)} chunk(s) were no longer cached"
    if isinstance(reply, m.StoreReply) and reply.skipped_full:
        return f"{reply.skipped_full} chunk(s) skipped: the server's pool is full of locked chunks"
    if isinstance(reply, m.StoreReply) and reply.late:
        return f"{reply.late} chunk(s) not stored: the server took the store up past its copy_by_ns"
    return None


def all_answered(state: RequestTransfers) -> bool:
    """Whether every transfer of the request has its reply (or its error)."""
    return all(t.future.query() for t in state.transfers)
