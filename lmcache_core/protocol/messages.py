"""Typed msgspec messages: one request struct per op, tagged reply structs, and ErrorReply.

Requests are strict (unknown fields are refused, so a typo never silently does nothing); replies are
tagged so a client decodes ``result | ErrorReply`` from one frame, and tolerate new fields so an older
client can talk to a newer server.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

#: A chunk hash on the wire: LMCache's are 32 bytes; vLLM block hashes may differ, but stay small.
ChunkHash = Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)]


class Message(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every request payload."""

    def num_keys(self) -> int:
        """How many chunk keys this request names (checked against the server's limit)."""
        return 0


class NoArgs(Message):
    """Payload of ops that take no arguments."""


# ---------------------------------------------------------------- KV-cache registration


class CudaIpcHandle(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What ``torch.UntypedStorage._share_cuda_()`` returns, field by field."""

    device: int
    handle: bytes
    storage_nbytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None = None
    event_sync_required: bool = False


class TensorDescriptor(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where one worker tensor lives and how to view it, without sending its bytes.

    ``kind="shm"``: a POSIX shared-memory segment ``shm_name`` of ``segment_nbytes`` bytes, the
    tensor starting ``offset_bytes`` into it. ``kind="cuda"``: a CUDA IPC handle of its storage.
    """

    kind: Literal["shm", "cuda"]
    dtype: str
    shape: list[int]
    stride: list[int]
    offset_bytes: int = 0
    segment_nbytes: int = 0
    shm_name: str = ""
    cuda: CudaIpcHandle | None = None
    device_uuid: str = "cpu"


KVLayoutName = Literal["flash_attn", "flashinfer", "mla"]


class RegisterKVCacheRequest(Message):
    """A worker shares its per-layer KV tensors (in layer order) once, under ``instance_id``."""

    instance_id: int
    model_name: str
    world_size: int
    kv_rank: int
    block_size: int
    layout: KVLayoutName
    layers: list[TensorDescriptor]
    pid: int = 0
    hostname: str = ""


class UnregisterKVCacheRequest(Message):
    instance_id: int


# ---------------------------------------------------------------- data path


class StoreRequest(Message):
    """Copy the blocks of these chunks (``blocks_per_chunk`` ids each, in order) into the cache."""

    instance_id: int
    chunk_hashes: list[ChunkHash]
    block_ids: list[int]
    event_handle: bytes = b""
    request_ids: list[str] = []

    def num_keys(self) -> int:
        return len(self.chunk_hashes)


class RetrieveRequest(Message):
    """Copy these chunks into the given blocks; releases ``lookup_id``'s locks on them."""

    instance_id: int
    chunk_hashes: list[ChunkHash]
    block_ids: list[int]
    event_handle: bytes = b""
    lookup_id: str = ""
    request_ids: list[str] = []

    def num_keys(self) -> int:
        return len(self.chunk_hashes)


class LookupRequest(Message):
    """Count the prefix of chunks every rank holds; lock them for ``lookup_id`` when ``lock``."""

    model_name: str
    world_size: int
    lookup_id: str
    chunk_hashes: list[ChunkHash]
    lock: bool = True

    def num_keys(self) -> int:
        return len(self.chunk_hashes)


class LookupIdRequest(Message):
    """Release what a lookup still locks (free_lookup_locks, end_session)."""

    lookup_id: str


class PingRequest(Message):
    """A health probe; a worker's ``instance_id`` also refreshes its registration's liveness."""

    instance_id: int | None = None


class ClearRequest(Message):
    """Drop cached chunks: unlocked ones only, or all of them with ``force``."""

    force: bool = False


class ListChunksRequest(Message):
    model_name: str | None = None
    limit: int = 100
    sort: Literal["age", "hits", "size", "key"] = "age"


# ---------------------------------------------------------------- replies


class Reply(msgspec.Struct, tag_field="kind", tag=str.lower, kw_only=True):
    """Base of every reply; tagged so one decoder tells a result from an ErrorReply."""


class ErrorReply(Reply):
    code: str
    message: str


class OkReply(Reply):
    pass


class PingReply(Reply):
    version: str
    chunk_size: int
    uptime_s: float
    pid: int
    registered: bool | None = None  # for a ping with an instance id: does the server know it?


class ChunkSizeReply(Reply):
    chunk_size: int


class RegisterKVCacheReply(Reply):
    chunk_bytes: int
    blocks_per_chunk: int


class StoreReply(Reply):
    stored: int
    already_present: int = 0
    skipped_full: int = 0


class RetrieveReply(Reply):
    retrieved: int
    missing: list[int] = []

    @property
    def ok(self) -> bool:
        return not self.missing


class LookupReply(Reply):
    hit_chunks: int


class ReleasedReply(Reply):
    released: int


class ClearReply(Reply):
    removed: int
    kept_locked: int = 0


class ServerStats(msgspec.Struct, kw_only=True):
    chunks: int = 0
    bytes_used: int = 0
    slots_total: int = 0
    slots_used: int = 0
    lookups: int = 0
    lookup_hit_chunks: int = 0
    lookup_miss_chunks: int = 0
    stores: int = 0
    stored_chunks: int = 0
    store_skipped_full: int = 0
    retrieves: int = 0
    retrieved_chunks: int = 0
    retrieve_missing: int = 0
    evictions: int = 0
    locks_held: int = 0
    locks_expired: int = 0
    registered_instances: int = 0
    reaped_instances: int = 0
    requests: int = 0
    errors: int = 0
    # disk tier (zeros without one)
    disk_chunks: int = 0
    disk_bytes: int = 0
    disk_loaded_chunks: int = 0
    disk_written_chunks: int = 0
    disk_write_dropped: int = 0
    disk_evicted_unsaved: int = 0
    disk_corrupt: int = 0
    disk_deleted: int = 0
    disk_errors: int = 0
    # remote (Redis/Valkey) tier (zeros without one)
    remote_loaded_chunks: int = 0
    remote_written_chunks: int = 0
    remote_write_dropped: int = 0
    remote_write_failed: int = 0
    remote_corrupt: int = 0
    remote_errors: int = 0
    remote_outages: int = 0
    remote_lookup_timeouts: int = 0
    remote_queued: int = 0
    remote_down: int = 0


class ServerInfoReply(Reply):
    version: str
    url: str
    pid: int
    chunk_size: int
    uptime_s: float
    pool_bytes: int
    slot_bytes: int
    eviction: str
    stats: ServerStats


class ChunkInfo(msgspec.Struct, kw_only=True):
    chunk_hash: bytes
    model_name: str
    world_size: int
    kv_rank: int
    tier: str
    nbytes: int
    locks: int
    hits: int
    age_s: float


class ChunkListReply(Reply):
    chunks: list[ChunkInfo]
    total: int
