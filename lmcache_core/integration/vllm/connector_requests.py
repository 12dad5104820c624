"""The connector's scheduler-side record of each request: its hash chain, blocks, lookup and stores.

Part of :mod:`.lmcache_connector`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmcache_core.integration.vllm.connector_hints import NO_HINTS, StoreHints
from lmcache_core.keys import chain_hashes, salted_prefix

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class RequestTracker:
    """What the scheduler side knows about one request."""

    request: Request
    prefix: bytes
    cacheable: bool
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    """vLLM's block ids of the request, one list per KV cache group (null id 0 where vLLM freed a
    sliding window's block or never allocated it)."""
    looked_up: bool = False
    hit_chunks: int = 0
    load: tuple[int, int] | None = None  # chunk range to load
    load_invalid: list[int] = field(default_factory=list)
    load_fails: bool = False  # a hybrid load vLLM trimmed to a partial chunk: report it failed
    load_sync: bool = False  # loaded in the step that schedules it, before its forward pass
    load_holds_last_token: bool = False
    """A synchronous load of every token the request has: vLLM was told one token fewer (it
    must compute one in the step that admits the request); the load still brings the last chunk
    whole, and the forward pass computes that token's KV again over it."""
    async_promised: bool = False  # may_load_async said yes: vLLM queued it for an async load
    state: str = "lookup"  # lookup -> (load ->) ready
    stored_chunks: int = 0  # leading chunks present on the server or being stored
    ran: bool = False  # scheduled to run since its lookup (so a later re-ask is a preemption)
    hints: StoreHints = NO_HINTS  # from its kv_transfer_params (lmcache.pin, ...)

    def ensure_hashes(self, n_chunks: int, chunk_size: int) -> list[bytes]:
        if len(self.hashes) < n_chunks:
            tokens = self.request.all_token_ids
            start = len(self.hashes)
            self.hashes += chain_hashes(list(tokens[start * chunk_size:n_chunks * chunk_size]),
                                        chunk_size, self.hashes[-1] if self.hashes else self.prefix)
        return self.hashes


def uncacheable_reason(request: Request) -> str:
    """Why the request's KV cannot be cached under its token ids ("" when it can)."""
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    return ""


def request_prefix(request: Request) -> bytes:
    """The chain's seed: LMCache's for plain requests; salted by cache_salt and LoRA otherwise."""
    parts = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(("salt", str(salt)))
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(("lora", f"{getattr(lora, 'lora_name', '')}#{getattr(lora, 'lora_int_id', '')}"))
    return salted_prefix(parts)
