"""Frames <-> messages, with no sockets: ``[uid, op, payload...]`` -> ``[uid, op, reply]``.

Every frame is one msgpack value, as in LMCache's multi-process wire (its reference §2). The uid and op
frames of a reply are the request's own bytes, echoed unchanged, so a client matches replies by uid and
checks the op. This module is the single place that decodes untrusted bytes; it raises only
``ProtocolError`` and its subclasses, each of which the server answers with an ``ErrorReply``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from lmcache_core.errors import (
    LMCacheError,
    ProtocolError,
    RequestTooLargeError,
    UnknownOperationError,
    error_from_code,
)
from lmcache_core.protocol.messages import ErrorReply, Message, Reply
from lmcache_core.protocol.ops import OPS, RequestType

_encoder = msgspec.msgpack.Encoder()
_decode_any = msgspec.msgpack.Decoder().decode
_request_decoders = {op: msgspec.msgpack.Decoder(spec.request) for op, spec in OPS.items()}
_reply_decoders = {
    op: msgspec.msgpack.Decoder(spec.reply | ErrorReply) for op, spec in OPS.items()
}
_ops_by_name = {op.value: op for op in RequestType}


class Limits(NamedTuple):
    """What one request may weigh; larger ones get a TOO_LARGE error, never a crash."""

    max_request_bytes: int = 16 * 2**20
    max_keys_per_request: int = 65536


DEFAULT_LIMITS = Limits()


class DecodedRequest(NamedTuple):
    uid_frame: bytes
    op_frame: bytes
    op: RequestType
    payload: Message


def encode(value: Any) -> bytes:
    """One msgpack value (structs become maps keyed by field name)."""
    return _encoder.encode(value)


def encode_request(uid: int, op: RequestType, payloads: Sequence[Any]) -> list[bytes]:
    """The frames a DEALER sends: uid, op name, then one frame per payload."""
    return [_encoder.encode(uid), _encoder.encode(op.value), *(_encoder.encode(p) for p in payloads)]


def decode_uid(frame: bytes) -> int:
    """The request id of a reply frame (an int; anything else is a protocol error)."""
    try:
        uid = _decode_any(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"uid frame is not msgpack: {exc}") from exc
    if not isinstance(uid, int) or isinstance(uid, bool):
        raise ProtocolError(f"uid frame must hold an int, got {type(uid).__name__}")
    return uid


def decode_request(frames: Sequence[bytes], limits: Limits | None = None) -> DecodedRequest:
    """Parse ``[uid, op, payload]`` (the ROUTER identity already removed) into a typed request."""
    if len(frames) < 2:
        raise ProtocolError(f"a request needs at least [uid, op] frames, got {len(frames)}")
    limits = limits or DEFAULT_LIMITS
    uid_frame, op_frame, *payload_frames = frames
    size = sum(len(f) for f in frames)
    if size > limits.max_request_bytes:
        raise RequestTooLargeError(
            f"request is {size} bytes; the server accepts at most {limits.max_request_bytes}")
    op = _decode_op(op_frame)
    if len(payload_frames) != 1:
        raise ProtocolError(f"{op.value} takes exactly 1 payload frame, got {len(payload_frames)}")
    try:
        payload = _request_decoders[op].decode(payload_frames[0])
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ProtocolError(f"bad {op.value} payload: {exc}") from exc
    if payload.num_keys() > limits.max_keys_per_request:
        raise RequestTooLargeError(
            f"{op.value} names {payload.num_keys()} chunks; the server accepts at most "
            f"{limits.max_keys_per_request} per request")
    return DecodedRequest(uid_frame, op_frame, op, payload)


def _decode_op(op_frame: bytes) -> RequestType:
    try:
        name = _decode_any(op_frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"op frame is not msgpack: {exc}") from exc
    if not isinstance(name, str):
        raise UnknownOperationError(f"unknown op {name!r}: this server serves lmc.* string ops")
    try:
        return _ops_by_name[name]
    except KeyError:
        raise UnknownOperationError(f"unknown op {name!r}") from None


def encode_reply(uid_frame: bytes, op_frame: bytes, reply: Reply) -> list[bytes]:
    """The frames answering one request: its own uid and op bytes, then the reply."""
    return [uid_frame, op_frame, _encoder.encode(reply)]


def error_reply(exc: LMCacheError) -> ErrorReply:
    return ErrorReply(code=exc.code.value, message=str(exc))


def decode_reply(op: RequestType, frames: Sequence[bytes]) -> Reply:
    """A reply's result, or the server's error raised as the matching ``LMCacheError``."""
    if len(frames) != 1:
        raise ProtocolError(f"a {op.value} reply has 1 result frame, got {len(frames)}")
    try:
        reply = _reply_decoders[op].decode(frames[0])
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad {op.value} reply: {exc}") from exc
    if isinstance(reply, ErrorReply):
        raise error_from_code(reply.code, reply.message)
    return reply


def decode_error_reply(frames: Sequence[bytes]) -> LMCacheError | None:
    """If the last frame is an ErrorReply (e.g. to a request the server could not parse), rebuild it."""
    if not frames:
        return None
    try:
        reply = msgspec.msgpack.decode(frames[-1], type=ErrorReply)
    except msgspec.DecodeError:
        return None
    return error_from_code(reply.code, reply.message)
