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
    MAX_MESSAGE_CHARS,
    LMCacheError,
    ProtocolError,
    RequestTooLargeError,
    UnknownOperationError,
    clip,
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
#: A uid is one msgpack int (at most 9 bytes); an op is a short name. Longer frames are refused
#: unread, and never echoed back in full.
MAX_UID_FRAME = 9
MAX_OP_FRAME = 64
#: What stands in a reply for a uid or op frame too long to echo.
_NIL = b"\xc0"
_decode_uid = msgspec.msgpack.Decoder(int).decode


class RequestHead(NamedTuple):
    """A request's frames checked for size and shape, its op known, its payload not yet decoded
    (decoding a large payload is left to the thread that serves it)."""

    uid_frame: bytes
    op_frame: bytes
    op: RequestType
    payload_frame: bytes

    @property
    def size(self) -> int:
        return len(self.uid_frame) + len(self.op_frame) + len(self.payload_frame)


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
    """The request id of a frame (an int; anything else is a protocol error)."""
    if len(frame) > MAX_UID_FRAME:
        raise ProtocolError(f"uid frame of {len(frame)} bytes; a uid is one msgpack int")
    try:
        return _decode_uid(frame)
    except Exception as exc:  # any decode failure is the client's bad frame
        raise ProtocolError(f"uid frame must hold one msgpack int: {clip(str(exc))}") from None


def decode_request(frames: Sequence[bytes], limits: Limits | None = None) -> DecodedRequest:
    """Parse ``[uid, op, payload]`` (the ROUTER identity already removed) into a typed request."""
    limits = limits or DEFAULT_LIMITS
    head = decode_head(frames, limits)
    return DecodedRequest(head.uid_frame, head.op_frame, head.op, decode_payload(head, limits))


def decode_head(frames: Sequence[bytes], limits: Limits) -> RequestHead:
    """Check a request's frame count, size, uid and op: cheap, whatever the frames hold.

    Raises only ``ProtocolError`` (or a subclass)."""
    if len(frames) != 3:
        raise ProtocolError(f"a request is 3 frames [uid, op, payload], got {len(frames)}")
    uid_frame, op_frame, payload_frame = frames
    size = len(uid_frame) + len(op_frame) + len(payload_frame)
    if size > limits.max_request_bytes:
        raise RequestTooLargeError(
            f"request is {size} bytes; the server accepts at most {limits.max_request_bytes}")
    decode_uid(uid_frame)
    return RequestHead(uid_frame, op_frame, _decode_op(op_frame), payload_frame)


def decode_payload(head: RequestHead, limits: Limits) -> Message:
    """The typed payload of a request whose head was checked. Raises only ``ProtocolError``.

    The decoders are typed, so nesting is bounded by the message types and every integer and
    length is checked against its bounds while decoding; anything else (even a ``RecursionError``
    or ``MemoryError``) still becomes a protocol error rather than escaping to the server loop."""
    op = head.op
    try:
        payload: Message = _request_decoders[op].decode(head.payload_frame)
    except Exception as exc:  # ValidationError is a DecodeError; the rest too
        raise ProtocolError(f"bad {op.value} payload: {clip(str(exc))}") from None
    if payload.num_keys() > limits.max_keys_per_request:
        raise RequestTooLargeError(
            f"{op.value} names {payload.num_keys()} chunk keys; the server accepts at most "
            f"{limits.max_keys_per_request} per request")
    return payload


def _decode_op(op_frame: bytes) -> RequestType:
    if len(op_frame) > MAX_OP_FRAME:
        raise UnknownOperationError(
            f"unknown op: a {len(op_frame)}-byte op frame (this server serves short lmc.* names)")
    try:
        name = _decode_any(op_frame)  # at most MAX_OP_FRAME bytes: nesting is bounded too
    except Exception as exc:  # whatever the bytes were
        raise ProtocolError(f"op frame is not msgpack: {clip(str(exc))}") from None
    if not isinstance(name, str):
        raise UnknownOperationError(
            f"unknown op {clip(repr(name))}: this server serves lmc.* string ops")
    try:
        return _ops_by_name[name]
    except KeyError:
        raise UnknownOperationError(f"unknown op {clip(repr(name))}") from None


def rejection_frames(frames: Sequence[bytes], exc: LMCacheError) -> list[bytes]:
    """The reply to a request that could not be parsed: its uid frame echoed only when it holds
    one msgpack int, its op frame only when it holds one short msgpack str or int (an op name or
    id, known or not), a nil in the place of either otherwise, then the error. Nothing else of a
    frame the server could not read goes back (random bytes in the op's place were echoed whole)."""
    uid = frames[0] if frames and _holds(frames[0], MAX_UID_FRAME, int) else _NIL
    op = frames[1] if len(frames) > 1 and _holds(frames[1], MAX_OP_FRAME, (str, int)) else _NIL
    return encode_reply(uid, op, error_reply(exc))


def _holds(frame: bytes, max_bytes: int, kind: type | tuple[type, ...]) -> bool:
    """Whether ``frame`` is one msgpack value of ``kind`` (bool is no int), at most ``max_bytes``."""
    if not frame or len(frame) > max_bytes:
        return False
    try:
        value = _decode_any(frame)
    except Exception:  # whatever the bytes were
        return False
    return isinstance(value, kind) and not isinstance(value, bool)


def encode_reply(uid_frame: bytes, op_frame: bytes, reply: Reply) -> list[bytes]:
    """The frames answering one request: its own uid and op bytes, then the reply."""
    return [uid_frame, op_frame, _encoder.encode(reply)]


def error_reply(exc: LMCacheError) -> ErrorReply:
    """The wire form of ``exc``; its message clipped, so no client input is echoed whole."""
    return ErrorReply(code=exc.code.value, message=clip(str(exc), 4 * MAX_MESSAGE_CHARS))


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
