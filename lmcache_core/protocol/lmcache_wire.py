"""LMCache 0.5.6's multi-process wire as a second dialect of our socket: frames and payloads.

No I/O, no torch. LMCache's clients send ``[uid, op, payload_1, ..., payload_n]`` where ``op`` is a
msgpack int (its frozen legacy id, 1-33) or a snake_case name, and one msgpack frame per contract
parameter; a reply is ``[uid, op]`` for a void result or ``[uid, op, result]``, with the request's
own uid and op bytes echoed (reference ``lmcache-mp-wire.md`` §2-§3). Our own ops are ``lmc.*``
strings, so :meth:`LMCacheWire.claim` tells the two apart from the frames alone; the server's
request pipeline then treats either dialect's request alike (``transport.routes.Wire``).

The structs mirror LMCache's payloads field by field (maps keyed by field name; unknown fields
ignored, as LMCache's decoder does) and are bounded like ours in :mod:`messages`: every int and
length. :func:`decode_call` raises :class:`DialectError` for anything malformed or unserved;
LMCache's own server answers such a request with silence (its client waits out its timeout);
ours answers at once with what LMCache's client takes as a failure (:func:`failure_frames`).
The one frame its protocol defines no reply to is a stream's credit (``STREAM_CONTROL``).
What LMCache's requests mean in our terms (keys, block ids, tensors) is the server's
(``server/lmcache/translate.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from lmcache_core.errors import (
    MAX_MESSAGE_CHARS,
    LMCacheError,
    ProtocolError,
    RequestTooLargeError,
    clip,
)
from lmcache_core.protocol import messages as m

#: LMCache's frozen legacy op ids (its ``wire.py``); the names are the ops themselves.
LEGACY_IDS: dict[int, str] = {
    1: "register_kv_cache", 2: "unregister_kv_cache", 3: "register_q_cache",
    4: "unregister_q_cache", 5: "store_q", 6: "store", 7: "retrieve", 8: "lookup",
    9: "query_prefetch_status", 10: "wait_prefetch_status", 12: "free_lookup_locks",
    13: "end_session", 14: "register_kv_cache_engine_driven_context",
    15: "unregister_kv_cache_engine_driven_context", 16: "prepare_store", 17: "commit_store",
    18: "prepare_retrieve", 19: "commit_retrieve", 20: "clear", 21: "get_chunk_size", 22: "ping",
    23: "report_block_allocation", 24: "noop", 25: "cb_register_rope", 26: "cb_unregister_rope",
    27: "cb_retrieve_pre_computed", 28: "cb_unified_lookup", 29: "p2p_lookup_and_lock",
    30: "p2p_query_lookup_results", 31: "p2p_unlock_objects", 32: "get_experimental",
    33: "cb_protocol_handshake",
}
#: Names LMCache sends only as strings.
STRING_ONLY = frozenset({"cb_reorder_plan", "subscribe_kv_events", "server_module_call"})
OP_NAMES = frozenset(LEGACY_IDS.values()) | STRING_ONLY
#: LMCache's engine-driven transfer (the worker gathers KV into CPU chunks itself; its reply
#: advertises the whole pool as one shared segment, or the data travels pickled): not served.
ENGINE_DRIVEN = frozenset({
    "register_kv_cache_engine_driven_context", "unregister_kv_cache_engine_driven_context",
    "prepare_store", "commit_store", "prepare_retrieve", "commit_retrieve"})
#: The one frame LMCache's protocol defines no reply to: a stream's credit or its cancel
#: (``[uid, b"", b"ack" | b"cancel"]``, an empty op frame; its ``mq.py``). Its op name here.
STREAM_CONTROL = "stream_control"
#: What a failure reply's op frame starts with (see :func:`failure_frames`).
FAILURE_PREFIX = "lmcache serve: "
ENGINE_DRIVEN_REFUSAL = (
    "LMCache's engine-driven transfer is not served (it hands every client the whole pool, or "
    "pickles the KV); start vLLM with LMCACHE_MP_TRANSFER_MODE=lmcache_driven")
#: The longest op frame either form takes (a msgpack str of the longest name).
MAX_OP_FRAME = 48
#: LMCache's request ids, model names and salts are short; these bounds are far above real ones.
MAX_TOKENS = 2**22
MAX_GROUPS = 64

_decode_any = msgspec.msgpack.Decoder().decode
_encoder = msgspec.msgpack.Encoder()

Name = Annotated[str, msgspec.Meta(max_length=256)]
RequestId = Annotated[str, msgspec.Meta(max_length=1024)]
InstanceId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TokenIds = Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)], ...],
                     msgspec.Meta(max_length=MAX_TOKENS)]
TokenIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
BlockIdGroups = Annotated[list[m.BlockIds], msgspec.Meta(max_length=MAX_GROUPS)]
EventHandle = Annotated[bytes, msgspec.Meta(max_length=256)]
Small = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


class DialectError(ProtocolError):
    """A malformed LMCache frame or one this server does not serve: answered as a failure."""


class IPCCacheServerKey(msgspec.Struct, kw_only=True):
    """LMCache's ``IPCCacheServerKey`` (a map keyed by field name)."""

    model_name: Name
    world_size: m.WorldSize
    worker_id: m.Rank | None
    token_ids: TokenIds
    start: TokenIndex
    end: TokenIndex
    request_id: RequestId
    cache_salt: Annotated[str, msgspec.Meta(max_length=128)] = ""
    request_configs: dict[Name, Any] | None = None
    num_kv_readers: Annotated[int, msgspec.Meta(ge=0, le=m.MAX_WORLD_SIZE)] = 0


class TensorMetadata(msgspec.Struct, forbid_unknown_fields=True):
    """LMCache's ``ipc_wire.TensorMetadata``."""

    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    shape: m.Dims
    stride: m.Dims
    storage_offset: m.ByteCount
    device_uuid: Annotated[str, msgspec.Meta(max_length=64)]

    def __post_init__(self) -> None:
        # Checked as it is decoded (a bad frame, answered as one): every view of the tensor
        # (``view_hnd``, the mapping) pairs each dim with its stride.
        if len(self.stride) != len(self.shape):
            raise ValueError(f"shape {self.shape} with a {len(self.stride)}-element stride")


class CpuShmIPCData(msgspec.Struct, tag="cpu_shm", tag_field="type", forbid_unknown_fields=True,
                    kw_only=True):
    """LMCache's ``cpu_shm`` descriptor: a tensor in POSIX shared memory ``shm_name``."""

    version: Literal[1]
    metadata: TensorMetadata
    shm_name: Annotated[str, msgspec.Meta(min_length=2, max_length=201)]
    nbytes: m.ByteCount


IpcBytes = Annotated[bytes, msgspec.Meta(max_length=256)]


class CudaIPCData(msgspec.Struct, tag="cuda", tag_field="type", forbid_unknown_fields=True,
                  kw_only=True):
    """LMCache's ``cuda`` descriptor: its ``handle`` is ``torch.UntypedStorage._share_cuda_()`` of
    the tensor's storage, as is ours (``messages.CudaIpcHandle``): (device, handle, storage bytes,
    storage offset bytes, ref-counter file, ref-counter offset, event handle, event sync)."""

    version: Literal[1]
    metadata: TensorMetadata
    handle: tuple[Annotated[int, msgspec.Meta(ge=0, le=1023)], IpcBytes | None, m.ByteCount,
                  m.ByteCount, IpcBytes | None, m.ByteCount, IpcBytes | None, bool]


#: LMCache's other CUDA descriptors: raw driver IPC (its ``lmcache.mp.isolated_ipc``) and VMM
#: exports whose file descriptors travel out of band (its ``lmcache.mp.use_vmm_api``). Neither maps
#: onto torch's storage IPC, the CUDA path this server opens: refused, saying so.
UNSERVED_CUDA = {
    "cuda_raw": "cuda_raw KV descriptors (LMCache's lmcache.mp.isolated_ipc) are not served: "
                "start vLLM without isolated_ipc, so LMCache sends CUDA IPC (cuda) descriptors",
    "cuda_vmm": "cuda_vmm KV descriptors (LMCache's lmcache.mp.use_vmm_api) are not served: "
                "start vLLM without use_vmm_api, so LMCache sends CUDA IPC (cuda) descriptors",
}


class EngineGroupInfo(msgspec.Struct, kw_only=True):
    engine_group_id: Small
    layer_indices: Annotated[tuple[Small, ...], msgspec.Meta(max_length=4096)] = ()
    tokens_per_block: Small = 0
    sw_size_tokens: Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)] = -1
    extra_object_group_tag: Small = 0
    recurrent_state: bool = False


class LayoutHints(msgspec.Struct, kw_only=True):
    """LMCache's ``LayoutHints`` TypedDict (every key optional)."""

    kv_layout: Annotated[str, msgspec.Meta(max_length=16)] | None = None
    num_kv_heads: Small | None = None
    tokens_per_block: Small | None = None
    kv_list_layout: Annotated[str, msgspec.Meta(max_length=16)] | None = None
    head_dim: Small | None = None


_decode_layer = msgspec.msgpack.Decoder(CpuShmIPCData | CudaIPCData).decode
_decode_tag = msgspec.msgpack.Decoder(dict[str, Any]).decode


def _ext_hook(code: int, data: memoryview) -> Any:
    """LMCache sends each ``DeviceIPCWrapper`` as msgpack ext type 1 holding a tagged struct."""
    if code != 1:
        raise DialectError(f"unexpected msgpack ext type {code}")
    try:
        return _decode_layer(data)
    except msgspec.DecodeError as exc:
        why = f"unsupported KV descriptor: {clip(str(exc))}"
    unserved = None
    with contextlib.suppress(Exception):  # which descriptor it is, for the message
        unserved = UNSERVED_CUDA.get(_decode_tag(data).get("type"))  # type: ignore[arg-type]
    raise DialectError(unserved or why)


ShmLayers = Annotated[list[Any], msgspec.Meta(min_length=1, max_length=4096)]

#: Each served op's payload types, in LMCache's contract order (§3 of the reference).
PAYLOADS: dict[str, tuple[Any, ...]] = {
    "noop": (),
    "get_chunk_size": (),
    "get_experimental": (),
    "ping": (InstanceId | None,),
    "register_kv_cache": (InstanceId, ShmLayers, Name, m.WorldSize, Name, LayoutHints,
                          Annotated[list[EngineGroupInfo], msgspec.Meta(max_length=MAX_GROUPS)]),
    "unregister_kv_cache": (InstanceId,),
    "store": (IPCCacheServerKey, InstanceId, BlockIdGroups, EventHandle),
    "retrieve": (IPCCacheServerKey, InstanceId, BlockIdGroups, EventHandle, TokenIndex),
    "lookup": (IPCCacheServerKey, Small),
    "query_prefetch_status": (RequestId,),
    "wait_prefetch_status": (RequestId, Annotated[float, msgspec.Meta(ge=0, le=3600)]),
    "free_lookup_locks": (IPCCacheServerKey, Small),
    "end_session": (RequestId,),
    "clear": (bool,),
    "report_block_allocation": (InstanceId, Name, Any),
}
_decoders = {op: [msgspec.msgpack.Decoder(t, ext_hook=_ext_hook) for t in types]
             for op, types in PAYLOADS.items()}


class Call(NamedTuple):
    """One decoded LMCache request: its frames to echo, its op name, its typed payloads."""

    uid_frame: bytes
    op_frame: bytes
    op: str
    args: tuple[Any, ...]


def dialect_op(op_frame: bytes) -> str | None:
    """LMCache's op name when ``op_frame`` is one of its ops (an int 1-33 or a name); else None
    (our ``lmc.*`` ops and garbage are left to our own codec)."""
    if not op_frame or len(op_frame) > MAX_OP_FRAME:
        return None
    try:
        op = _decode_any(op_frame)
    except Exception:  # not msgpack: our codec answers it
        return None
    if isinstance(op, bool):
        return None
    if isinstance(op, int):
        return LEGACY_IDS.get(op, f"legacy_{op}") if 1 <= op <= 33 else None
    return op if isinstance(op, str) and op in OP_NAMES else None


def frames_op(frames: Sequence[bytes]) -> str | None:
    """LMCache's op name when ``frames`` (``[uid, op, payloads...]``) are an LMCache request whose
    reply can be addressed (its uid a msgpack int), or a stream's credit frame
    (``STREAM_CONTROL``); else None (ours, or frames our codec answers with a typed error)."""
    if len(frames) < 2:
        return None
    if frames[1] == b"" and len(frames) == 3 and frames[2] in (b"ack", b"cancel"):
        op: str | None = STREAM_CONTROL
    else:
        op = dialect_op(frames[1])  # first: our own requests (every one) end here
    return op if op is not None and plausible_uid(frames[0]) else None


def plausible_uid(frame: bytes) -> bool:
    """Whether ``frame`` holds a msgpack int, as a request's uid frame must (at most 9 bytes)."""
    if len(frame) > 9:
        return False
    try:
        uid = _decode_any(frame)
    except Exception:  # DecodeError and the like: the client's frame
        return False
    return isinstance(uid, int) and not isinstance(uid, bool)


def decode_call(frames: Sequence[bytes], op: str) -> Call:
    """``[uid, op, payloads...]`` of op ``op`` (from :func:`dialect_op`) into a typed call."""
    if len(frames) < 2 or not plausible_uid(frames[0]):
        raise DialectError("a request is [uid, op, payloads...] with a msgpack int uid")
    if op in ENGINE_DRIVEN:  # refused whatever its payloads: not read
        return Call(frames[0], frames[1], op, ())
    decoders = _decoders.get(op)
    if decoders is None:
        raise DialectError(f"LMCache op {op!r} is not served by this server")
    payloads = frames[2:]
    if len(payloads) != len(decoders):
        raise DialectError(f"{op} takes {len(decoders)} payload frame(s), got {len(payloads)}")
    try:
        args = tuple(d.decode(p) for d, p in zip(decoders, payloads, strict=True))
    except Exception as exc:  # ValidationError, DecodeError, RecursionError...: the client's frame
        raise DialectError(f"bad {op} payload: {clip(str(exc), MAX_MESSAGE_CHARS)}") from None
    return Call(frames[0], frames[1], op, args)


def reply_frames(call: Call, result: Any) -> list[bytes]:
    """LMCache's reply: ``[uid, op]`` for None, else ``[uid, op, result]`` (op echoed as sent)."""
    if result is None:
        return [call.uid_frame, call.op_frame]
    return [call.uid_frame, call.op_frame, _encoder.encode(result)]


def failure_frames(uid_frame: bytes, op_frame: bytes, op: str, why: str) -> list[bytes]:
    """What LMCache's client takes as a failure of ``op``, sent at once (its own server sends
    nothing, and its client waits out its 300 s timeout).

    A store or retrieve: ``(b"", False)``, in-band as LMCache's server answers the failures it
    expects (the request recomputes). A lookup: its ack (a status asked for it is then that of
    an unknown request, 0 hits); a prefetch status: 0 hits (vLLM's scheduler raises on any
    other failure of those). Any other op: a reply naming another op, ``FAILURE_PREFIX + why``,
    which LMCache's client raises at once as ``ValueError("Response operation '...' does not
    match request '<op>'")`` (its ``mq.py: process_inbound``): the message reaches the caller."""
    if op in ("store", "retrieve"):
        return [uid_frame, op_frame, _encoder.encode((b"", False))]
    if op == "lookup":
        return [uid_frame, op_frame]
    if op in ("query_prefetch_status", "wait_prefetch_status"):
        return [uid_frame, op_frame, _encoder.encode(0)]
    return [uid_frame, _encoder.encode(FAILURE_PREFIX + clip(why, 4 * MAX_MESSAGE_CHARS))]


def is_failure_op(op_frame: bytes) -> bool:
    """Whether a reply's op frame is a failure's (:func:`failure_frames`)."""
    if len(op_frame) > 4 * MAX_MESSAGE_CHARS:
        return False
    try:
        op = _decode_any(op_frame)
    except Exception:  # not msgpack: not one of ours
        return False
    return isinstance(op, str) and op.startswith(FAILURE_PREFIX)




class LMCacheHead(NamedTuple):
    """An LMCache request claimed by its frames (uid a msgpack int, op one of LMCache's), its
    payload frames not yet decoded: the server pipeline's head of an LMCache request."""

    uid_frame: bytes
    op_frame: bytes
    op: str
    frames: tuple[bytes, ...]  # all of them, uid and op included (``decode_call`` reads them)

    @property
    def size(self) -> int:
        return sum(map(len, self.frames))


class LMCacheWire:
    """LMCache's dialect as the server pipeline sees a wire (``transport.routes.Wire``): claims
    its requests, decodes their payloads into a :class:`Call`, encodes results and failures."""

    name = "lmcache"

    def __init__(self, max_request_bytes: int) -> None:
        self.max_request_bytes = max_request_bytes

    @staticmethod
    def claim(frames: Sequence[bytes]) -> LMCacheHead | None:
        """The head of an LMCache request (None: not LMCache's). Never raises: a request too large
        is claimed all the same, and refused by :meth:`check` in LMCache's own form."""
        op = frames_op(frames)
        return None if op is None else LMCacheHead(frames[0], frames[1], op, tuple(frames))

    def check(self, head: LMCacheHead) -> None:
        if head.size > self.max_request_bytes:
            raise RequestTooLargeError(f"a {head.size}-byte request; at most "
                                       f"{self.max_request_bytes}")

    @staticmethod
    def decode(head: LMCacheHead) -> Call:
        return decode_call(head.frames, head.op)

    @staticmethod
    def reply(head: LMCacheHead, result: Any) -> list[bytes]:
        """``[uid, op]`` for None, else ``[uid, op, result]`` (op echoed as sent)."""
        if result is None:
            return [head.uid_frame, head.op_frame]
        return [head.uid_frame, head.op_frame, _encoder.encode(result)]

    @staticmethod
    def error(head: LMCacheHead, exc: LMCacheError) -> list[bytes]:
        """LMCache's failure of ``head.op`` (:func:`failure_frames`), naming ``exc``."""
        return failure_frames(head.uid_frame, head.op_frame, head.op, f"{head.op}: {exc}")
