"""The worker adapter's bookkeeping of stores and retrieves in flight, and the reading of their outcome.

A ``_Transfer`` is one store or retrieve request sent to the server; each vLLM request it covers
keeps it in its ``_RequestState`` until the adapter reports the request finished.
``transfer_failure`` and ``unloaded_blocks`` read a finished transfer's reply. Part of
:mod:`.vllm_multi_process_adapter`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmcache_core.protocol import messages as m
from lmcache_core.transport.future import MessagingFuture


def _event_handle(event: Any) -> bytes:
    """The IPC handle of a worker's CUDA event; ``None`` (CPU) means there is nothing to wait on."""
    if event is None:
        return b""
    from lmcache_core.kv.cuda_events import export_event

    return export_event(event)


@dataclass
class _Transfer:
    """One store or retrieve request in flight, covering one or more vLLM requests."""

    future: MessagingFuture[Any]
    request_ids: list[str]
    block_ids: list[int]


@dataclass
class _RequestState:
    transfers: list[_Transfer] = field(default_factory=list)
    failure: str | None = None


def unloaded_blocks(transfer: _Transfer, blocks_in_chunk: int) -> list[int]:
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


def transfer_failure(transfer: _Transfer) -> str | None:
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
    return None
