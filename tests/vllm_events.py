"""vLLM's KV event structs, mirrored field by field (what a router decodes), for the tests that
check what the server publishes: vLLM 0.32's (vllm/distributed/kv_events.py, after vLLM PR
#42892: the batch is an array, the events are maps tagged by "type", optional fields included)
and the older generations (events arrays too, the tag first)."""

from __future__ import annotations

from typing import Any

import msgspec


class V32EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V32Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class V32BlockStored(V32Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class V32BlockRemoved(V32Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class V32AllBlocksCleared(V32Event, tag="AllBlocksCleared"):
    pass


class V32KVEventBatch(V32EventBatch):
    events: list[V32BlockStored | V32BlockRemoved | V32AllBlocksCleared]


# Older vLLM (before PR #42892): events are arrays too, the tag first.


class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyAllBlocksCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]
    data_parallel_rank: int | None = None


class EarlyBlockStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class EarlyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]


V32 = msgspec.msgpack.Decoder(V32KVEventBatch)
LEGACY = msgspec.msgpack.Decoder(LegacyKVEventBatch)
