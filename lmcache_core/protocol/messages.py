"""Typed msgspec messages: one request struct per op, tagged reply structs, and ErrorReply.

Requests are strict (unknown fields are refused, so a typo never silently does nothing); replies are
tagged so a client decodes ``result | ErrorReply`` from one frame, and tolerate new fields so an older
client can talk to a newer server.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from lmcache_core.keys import MAX_GROUPS, GroupKind, layout_heads
from lmcache_core.stats import ModelStats as ModelStats
from lmcache_core.stats import ServerStats as ServerStats
from lmcache_core.stats import TenantStats as TenantStats

# Every integer and length on the wire is bounded here, in the types, so msgspec refuses an
# out-of-range value while decoding (before any handler runs) and no single request can make the
# server do unbounded work or allocate unbounded memory. Lists are capped well above what a real
# engine sends, and low enough that decoding the largest one takes a few milliseconds.

#: Tensor-parallel size and rank: far above any real TP group; bounds the per-rank work of a lookup.
MAX_WORLD_SIZE = 1024
#: Keys (chunk hashes) one request may name, whatever the server's own (lower) configured limit.
MAX_KEYS = 2**20
#: Block ids one request may name (a 1M-id list decodes in ~15 ms here).
MAX_BLOCK_IDS = 2**20
#: Byte sizes and offsets of shared tensors (256 TiB).
MAX_BYTES = 2**48

#: A chunk hash on the wire: LMCache's are 32 bytes; vLLM block hashes may differ, but stay small.
ChunkHash = Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)]
ChunkHashes = Annotated[list[ChunkHash], msgspec.Meta(max_length=MAX_KEYS)]
BlockIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]],
                     msgspec.Meta(max_length=MAX_BLOCK_IDS)]
#: The worker adapter draws 63-bit random ids.
InstanceId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
WorldSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD_SIZE)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_WORLD_SIZE)]
#: Linux pids are at most 2**22 (pid_max's ceiling); 0 means "not given".
Pid = Annotated[int, msgspec.Meta(ge=0, le=2**22)]
ByteCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
Name = Annotated[str, msgspec.Meta(max_length=256)]  # model names, dtypes, host names
#: A KV layout fingerprint (``keys.layout_key``), e.g. "bfloat16:32x8x128".
LayoutName = Annotated[str, msgspec.Meta(max_length=64)]
LookupId = Annotated[str, msgspec.Meta(max_length=1024)]
#: A tenant tag (``keys.tenant_tag`` of a request's cache_salt; "" for none): lowercase hex.
TenantTag = Annotated[str, msgspec.Meta(max_length=32, pattern="^[0-9a-f]*$")]
RequestIds = Annotated[list[LookupId], msgspec.Meta(max_length=MAX_KEYS)]
#: Sessions one lookup may end before it runs (``LookupRequest.ended``).
MAX_ENDED = 4096
EndedIds = Annotated[list[LookupId], msgspec.Meta(max_length=MAX_ENDED)]
#: A CUDA IPC event or memory handle is 64 bytes; the ref-counter handle is a short file name.
IpcHandle = Annotated[bytes, msgspec.Meta(max_length=256)]
#: A load deadline: at most an hour (0: none).
DeadlineMs = Annotated[int, msgspec.Meta(ge=0, le=3_600_000)]
#: A time on the host's CLOCK_MONOTONIC, in ns (``time.monotonic_ns``; 0: none).
MonotonicNs = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
#: A retrieve's first chunk's leading blocks left unwritten (fewer than a chunk's).
SkipBlocks = Annotated[int, msgspec.Meta(ge=0, le=2**16)]
#: Parts of one retrieve: a hybrid model has a registration per KV-cache group, a few, never
#: hundreds.
MAX_RETRIEVE_PARTS = 64
Dims = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]], msgspec.Meta(max_length=8)]
#: Retention asked for by a store or a pin: a TTL of at most 30 days (at least a millisecond), and
#: an eviction priority (lower goes first).
MAX_TTL_S = 30 * 86400.0
MIN_TTL_S = 0.001
MIN_PRIORITY, MAX_PRIORITY = -100, 100
TtlSeconds = Annotated[float, msgspec.Meta(ge=MIN_TTL_S, le=MAX_TTL_S)]
Priority = Annotated[int, msgspec.Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY)]
#: What a store's chunk hashes were made from (``StoreRequest.hash_mode``).
HashMode = Literal["", "tokens", "vllm"]


class Message(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Base of every request payload.

    Fields left at their defaults are not encoded: a field added later (``RegisterKVCacheRequest.
    group``, ``LookupRequest.ended``) goes on the wire only when a client uses it, so a newer client
    keeps working against an older server (which refuses unknown fields) for everything else."""

    def num_keys(self) -> int:
        """How many chunk keys this request names (checked against the server's limit)."""
        return 0


class NoArgs(Message):
    """Payload of ops that take no arguments."""


# ---------------------------------------------------------------- KV-cache registration


class CudaIpcHandle(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What ``torch.UntypedStorage._share_cuda_()`` returns, field by field."""

    device: Annotated[int, msgspec.Meta(ge=0, le=1023)]
    handle: IpcHandle
    storage_nbytes: ByteCount
    storage_offset_bytes: ByteCount
    ref_counter_handle: IpcHandle
    ref_counter_offset: ByteCount
    event_handle: IpcHandle | None = None
    event_sync_required: bool = False


class TensorDescriptor(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where one worker tensor lives and how to view it, without sending its bytes.

    ``kind="shm"``: a POSIX shared-memory segment ``shm_name`` of ``segment_nbytes`` bytes, the
    tensor starting ``offset_bytes`` into it. ``kind="cuda"``: a CUDA IPC handle of its storage.
    """

    kind: Literal["shm", "cuda"]
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    shape: Dims
    stride: Dims
    offset_bytes: ByteCount = 0
    segment_nbytes: ByteCount = 0
    shm_name: Annotated[str, msgspec.Meta(max_length=255)] = ""
    cuda: CudaIpcHandle | None = None
    device_uuid: Annotated[str, msgspec.Meta(max_length=64)] = "cpu"


#: ``cpu_attn``: vLLM's CPU backend's tensors as allocated, whose chunks are in its block order
#: (``kv/layout.py``).
KVLayoutName = Literal["flash_attn", "flashinfer", "mla", "cpu_attn"]


#: A sliding window's or an attention chunk's tokens: far above any model's (Gemma-3's window:
#: 1024; gpt-oss's: 128; Llama 4's attention chunk: 8192).
MAX_WINDOW_TOKENS = 2**24


class KVGroup(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Which KV-cache group of a hybrid model (vLLM's ``kv_cache_groups[index]``) a registration
    holds: its kind, its block size and, for a sliding window, the window's tokens (for
    chunked-local attention, "local", its attention chunk's tokens: a multiple of the block
    size, as vLLM's are). Each group is registered on its own (its layers only) and files its
    chunks under its own fingerprint."""

    index: Annotated[int, msgspec.Meta(ge=0, lt=MAX_GROUPS)]
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_GROUPS)]
    kind: GroupKind
    block_size: Annotated[int, msgspec.Meta(ge=1, le=2**16)]
    #: A sliding window's tokens, or a chunked-local group's attention chunk size; else 0.
    window_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_WINDOW_TOKENS)] = 0

    def __post_init__(self) -> None:  # a ValueError here is a typed ProtocolError on the wire
        if self.index >= self.count:
            raise ValueError(f"group index {self.index} is outside its count {self.count}")
        if (self.kind in ("sliding", "local")) != (self.window_tokens > 0):
            raise ValueError(f"a {self.kind} group has window_tokens {self.window_tokens}: "
                             f"sliding-window and chunked-local groups need a positive window, "
                             f"others none")
        if self.kind == "local" and self.window_tokens % self.block_size:
            raise ValueError(f"a chunked-local group's attention chunk of {self.window_tokens} "
                             f"tokens is no multiple of its block size {self.block_size}")


class RegisterKVCacheRequest(Message):
    """A worker shares its per-layer KV tensors (in layer order) once, under ``instance_id``;
    ``group``: the KV-cache group of a hybrid model these layers are (None: a single-group
    model, registered as always)."""

    instance_id: InstanceId
    model_name: Name
    world_size: WorldSize
    kv_rank: Rank
    block_size: Annotated[int, msgspec.Meta(ge=1, le=2**16)]
    layout: KVLayoutName
    layers: Annotated[list[TensorDescriptor], msgspec.Meta(min_length=1, max_length=4096)]
    pid: Pid = 0
    hostname: Name = ""
    group: KVGroup | None = None

    def __post_init__(self) -> None:
        # A Mamba group's tensors hold one state per block of ``group.block_size`` tokens, shared
        # as rows (``block_size`` 1); attention groups' tensors are in tokens per block.
        group = self.group
        if group is not None and group.kind != "mamba" and group.block_size != self.block_size:
            raise ValueError(f"group {group.index}'s block size {group.block_size} is not the "
                             f"registration's {self.block_size}")


class UnregisterKVCacheRequest(Message):
    instance_id: InstanceId


# ---------------------------------------------------------------- data path


class StoreRequest(Message):
    """Copy the blocks of these chunks (``blocks_per_chunk`` ids each, in order) into the cache."""

    instance_id: InstanceId
    chunk_hashes: ChunkHashes
    block_ids: BlockIds
    event_handle: IpcHandle = b""
    request_ids: RequestIds = []
    #: Retention of these pieces (and of those already present): see engine/retention.py; pins
    #: past ``server.max_pinned`` are stored unpinned (``StoreReply.pin_refused``).
    ttl_s: TtlSeconds | None = None
    pin: bool = False
    priority: Priority = 0
    #: The tenant the pieces are stored for (``keys.tenant_tag`` of the requests' cache_salt),
    #: bounded by its ``server.tenant_quotas`` entry if any; "" for none.
    tenant: TenantTag = ""
    #: What the chunk hashes were made from, which the server cannot tell from the hashes:
    #: "vllm" (vLLM's block hashes, a chunk named by its last block's), "tokens" (the prefix
    #: chain over token ids), "" (not said). Only counted per model, for ``lmcache lookup
    #: --explain`` (a model stored in vLLM's hash mode never matches a tokens file).
    hash_mode: HashMode = ""
    #: The worker's ``time.monotonic_ns()`` past which the server must not start the copy (the
    #: worker maps its KV memory to this server, so both read one host's clock): the worker gives
    #: up on the reply at its request timeout, and vLLM then reuses the blocks of a preempted or
    #: finished request; a copy begun after that (a server stalled that long) would read another
    #: request's KV under these keys. The worker sends half its request timeout from the
    #: sending, leaving the copy the other half. 0: none (older clients).
    copy_by_ns: MonotonicNs = 0

    def num_keys(self) -> int:
        return len(self.chunk_hashes)


class RetrievePart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True,
                   omit_defaults=True):
    """One more registration's chunks in a ``RetrieveRequest`` (its fields mean what the
    request's own ``instance_id``, ``chunk_hashes``, ``block_ids`` and ``skip_blocks`` mean)."""

    instance_id: InstanceId
    chunk_hashes: ChunkHashes
    block_ids: BlockIds
    skip_blocks: SkipBlocks = 0


class RetrieveRequest(Message):
    """Copy these chunks into the given blocks; releases ``lookup_id``'s locks on them.

    ``more``: the chunks of other registrations of the same worker (a hybrid model's other
    KV-cache groups), copied after the request's own under the same lookup id, event and
    deadline, and answered in one reply, so a load of several groups costs one request on the
    server's loop and one reply, not one per group."""

    instance_id: InstanceId
    chunk_hashes: ChunkHashes
    block_ids: BlockIds
    event_handle: IpcHandle = b""
    lookup_id: LookupId = ""
    request_ids: RequestIds = []
    #: How long the server may spend copying, from when it takes the retrieve up: None for the
    #: server's ``timeouts.load_ms``, 0 for no deadline. Chunks it did not reach in time are
    #: answered in ``RetrieveReply.missing`` (and counted in ``late``).
    deadline_ms: DeadlineMs | None = None
    #: The first chunk's leading block ids that are not copied (fewer than a chunk's blocks): a
    #: sliding window's oldest piece of which resuming needs only the last blocks, the others
    #: being vLLM's null block (freed behind the window).
    skip_blocks: SkipBlocks = 0
    more: Annotated[list[RetrievePart], msgspec.Meta(max_length=MAX_RETRIEVE_PARTS)] = []

    def parts(self) -> list[RetrievePart]:
        """The request's own chunks as its first part, then ``more``."""
        return [RetrievePart(instance_id=self.instance_id, chunk_hashes=self.chunk_hashes,
                             block_ids=self.block_ids, skip_blocks=self.skip_blocks), *self.more]

    def num_keys(self) -> int:
        return len(self.chunk_hashes) + sum(len(part.chunk_hashes) for part in self.more)


class LookupRequest(Message):
    """Count the prefix of chunks every rank holds; lock them for ``lookup_id`` when ``lock``."""

    model_name: Name
    world_size: WorldSize
    lookup_id: LookupId
    chunk_hashes: ChunkHashes
    lock: bool = True
    # The KV layout fingerprint of the asking engine; None: the layouts of the registered workers
    # of this model and world size, else every layout the server holds for the model.
    layout: LayoutName | None = None
    #: Sessions the client ended since its last lookup, each released (as ``END_SESSION`` would)
    #: before this lookup runs: an end_session rides on the next lookup instead of costing a
    #: round trip of its own on the server's loop, ahead of that lookup. ``LookupReply.released``
    #: answers them, in order.
    ended: EndedIds = []

    def num_keys(self) -> int:
        # One key per rank per chunk: that is what the lookup (and a tier load) works through.
        return len(self.chunk_hashes) * self.world_size


class LookupIdRequest(Message):
    """Release what a lookup still locks (free_lookup_locks, end_session)."""

    lookup_id: LookupId


class PingRequest(Message):
    """A health probe; a worker's ``instance_id`` also refreshes its registration's liveness."""

    instance_id: InstanceId | None = None


class ClearRequest(Message):
    """Drop cached chunks: unlocked ones only, or all of them with ``force``."""

    force: bool = False


class LayoutQuery(Message):
    """A look from the shell at a model's chunks (PEEK, EXPLAIN), in ``layout`` only (as
    LookupRequest.layout); None: the registered workers' layouts, else the layouts resident for
    the model, and ``hint_layout`` beside them (the CLI's config's model shape: after a restart
    nothing is registered or resident, yet the disk holds that layout). Both are checked while
    decoding."""

    layout: LayoutName | None = None
    hint_layout: LayoutName | None = None

    def __post_init__(self) -> None:
        for name in (self.layout, self.hint_layout):
            if name is not None:
                layout_heads(name)  # ValueError (a typed ProtocolError on the wire) at once


class PeekRequest(LayoutQuery, kw_only=True):
    """How many leading chunks memory, disk and Redis hold together for ``world_size`` ranks, and
    which tier each is in: counts only. Nothing is loaded, locked, LRU-touched or counted as a
    lookup (``lmcache lookup``: an operator's look leaves the cache as it was)."""

    model_name: Name
    world_size: WorldSize
    chunk_hashes: ChunkHashes

    def num_keys(self) -> int:
        return len(self.chunk_hashes) * self.world_size


#: The tiers a listing may name: "memory" (the pool), "disk" (its index: no I/O), "remote" (a count
#: of Redis keys by pattern; Redis is never listed key by key).
TierName = Literal["memory", "disk", "remote"]
#: A Redis key pattern (``ListChunksRequest.remote_match``) is short and has few ``*``: matching a
#: glob of many ``*`` can cost a Redis before 7.0.9 exponential time (CVE-2022-36021).
MAX_MATCH_CHARS = 200
MAX_MATCH_STARS = 4
#: How long a Redis count may take at most (the CLI's request timeout is longer).
MAX_COUNT_BUDGET_MS = 5000
RemoteMatch = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MATCH_CHARS)]


class ListChunksRequest(Message):
    model_name: Name | None = None
    limit: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] = 100
    sort: Literal["age", "hits", "size", "key"] = "age"
    # The tiers to list (memory only by default, as before tiers were listed) and, for Redis, the
    # pattern counted after the server's key prefix (default: the model's keys, or all of them)
    # and the time the count may take (SCAN in steps, never KEYS; past it the count is cut short).
    tiers: Annotated[list[TierName], msgspec.Meta(min_length=1, max_length=3)] = msgspec.field(
        default_factory=lambda: ["memory"])
    remote_match: RemoteMatch | None = None
    remote_budget_ms: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT_BUDGET_MS)] = 250

    def __post_init__(self) -> None:
        match = self.remote_match
        if match is not None and match.count("*") > MAX_MATCH_STARS:
            raise ValueError(f"remote_match may hold at most {MAX_MATCH_STARS} '*', got "
                             f"{match.count('*')}")


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
    #: Block ids per chunk a store or retrieve of this registration takes (a sliding-window
    #: group's: its pieces' blocks, the chunk's last ones).
    blocks_per_chunk: int
    layout: str = ""  # the KV layout fingerprint the server files this cache's chunks under
    head_lo: int = 0  # the heads [head_lo, head_hi) of the model this rank holds
    head_hi: int = 0
    #: This server honours ``StoreRequest.copy_by_ns`` (an older one refuses the field: a client
    #: sends it only where this says so).
    copy_by: bool = False


class StoreReply(Reply):
    stored: int
    already_present: int = 0
    skipped_full: int = 0
    skipped_quota: int = 0  # not stored: the model or tenant is at its quota (server.quotas, ...)
    pin_refused: int = 0  # stored unpinned: pinning them would pass server.max_pinned
    late: int = 0  # not copied: the request reached a copy thread past its ``copy_by_ns``


class RetrieveReply(Reply):
    """``missing``: the request indexes of every chunk not copied (not cached, or not reached
    before the deadline), sorted; ``late``: how many of them were cut by the deadline. A client
    that predates ``late`` still sees every unloaded chunk in ``missing``. With
    ``RetrieveRequest.more`` the indexes run over every part's chunks in order (the request's
    own first)."""

    retrieved: int
    missing: list[int] = []
    late: int = 0

    @property
    def ok(self) -> bool:
        return not self.missing


class LookupReply(Reply):
    hit_chunks: int
    #: Per ``LookupRequest.ended`` session, the piece locks its release dropped.
    released: list[int] = []


class ReleasedReply(Reply):
    released: int


class ClearReply(Reply):
    removed: int
    kept_locked: int = 0


class ServerInfoReply(Reply):
    version: str
    url: str
    pid: int
    chunk_size: int
    uptime_s: float
    pool_bytes: int
    slab_bytes: int
    eviction: str
    stats: ServerStats
    models: list[ModelStats] = msgspec.field(default_factory=list)
    tenants: list[TenantStats] = msgspec.field(default_factory=list)  # cache_salt tenants
    http_url: str | None = None  # the HTTP listener (/metrics, /healthz, /readyz), None when off
    tiers: list[str] = msgspec.field(default_factory=list)  # lower tiers configured: disk, remote
    # The pool's pages (server.prefault): populate "pending", "running", "done", "stopped",
    # "failed" ("" from an older server); seconds it took once done; huge pages asked for; the
    # server process's resident size.
    pool_populate: str = ""
    pool_populated_bytes: int = 0
    pool_populate_s: float | None = None
    pool_huge_pages: bool = False
    rss_bytes: int = 0


class ChunkInfo(msgspec.Struct, kw_only=True):
    """One piece: heads [head_lo, head_hi) of a chunk of ``model_name`` in ``layout``."""

    chunk_hash: bytes
    model_name: str
    layout: str
    head_lo: int
    head_hi: int
    tier: str
    nbytes: int
    locks: int
    hits: int
    age_s: float
    pinned: bool = False
    expires_in_s: float | None = None  # seconds left of its TTL (None: no TTL)
    priority: int = 0


class TierTotal(msgspec.Struct, kw_only=True):
    """One tier's part of a listing: its pieces (of the model asked for) and their bytes. For
    Redis, the keys matching ``pattern`` counted by SCAN within the budget: ``complete`` False
    when the count was cut short (a lower bound) or failed (``error``); SCAN may return a key
    twice while Redis rehashes, so the count is about, not exact."""

    tier: str
    pieces: int
    nbytes: int | None = None  # None: not known (Redis keys are counted, not sized)
    complete: bool = True
    pattern: str = ""
    error: str = ""


class ChunkListReply(Reply):
    chunks: list[ChunkInfo]
    total: int  # pieces matching in the listed tiers (memory, disk), of which ``chunks`` is a part
    tiers: list[TierTotal] = msgspec.field(default_factory=list)


class PeekReply(Reply):
    """The leading chunks the tiers hold together (``hit_chunks``), each counted once, in the
    slowest tier it needs: memory, then disk, then Redis. ``remote``: "" (no Redis tier, or not
    needed), "asked", "down" (not asked: the tier is down), "timeout" (no answer within the
    lookup budget), "cut" (the prefix probes too many keys at once: it may go on further)."""

    layout: str  # the layout counted in ("" when none fits the world size)
    hit_chunks: int
    memory_chunks: int = 0
    disk_chunks: int = 0
    remote_chunks: int = 0
    remote: str = ""
    tiers: list[str] = msgspec.field(default_factory=list)  # lower tiers configured
    #: A hybrid model's KV-cache group layouts, counted together (``layout`` is "" then): a
    #: chunk counts when every group can be restored at its end, as the model's lookups count;
    #: [] while its registered workers do not cover every group (a miss, as for a lookup).
    groups: list[str] | None = None
