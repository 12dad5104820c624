"""The async lookup's three messages and their codec (no sockets).

Scheduler -> worker: ``LookupRequestMsg`` or ``LookupCleanupMsg``; worker -> scheduler:
``LookupResponseMsg``. Each is a msgspec struct tagged by its ``type`` (the first element of a compact
msgpack array), so each side decodes with one decoder that refuses anything else.

``seq`` is the client's number for one attempt at a lookup. vLLM may ask again under the same lookup
id (a request re-scheduled after a timeout); the seq keeps a late answer of an earlier attempt from
counting for the new one, and keeps the cleanup of an earlier attempt from releasing the new one's pins.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from lmcache_core.errors import ProtocolError, clip

# Bounded like the server's messages (protocol.messages): no value on the wire is unbounded.
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
ChunkHash = Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)]
MAX_CHUNKS = 2**20
LookupId = Annotated[str, msgspec.Meta(max_length=1024)]
#: The client's answer socket: a file name (no directory) in the shared private runtime directory.
ReplyTo = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,120}\.sock$")]


class _Msg(msgspec.Struct, tag_field="type", array_like=True, forbid_unknown_fields=True,
           kw_only=True):
    pass


class LookupRequestMsg(_Msg, tag="lookup.request"):
    """Find, pin and prefetch the longest cached prefix of ``hashes``.

    ``offsets[i]`` is the end, in tokens, of chunk ``i`` (``(i + 1) * chunk_size`` for full chunks).
    ``reply_to`` names the socket the answer goes to: each client instance binds its own, so an
    answer never rides a connection left over from a client that has since closed.
    """

    lookup_id: LookupId
    seq: NonNegative
    reply_to: ReplyTo
    hashes: Annotated[list[ChunkHash], msgspec.Meta(max_length=MAX_CHUNKS)]
    offsets: Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_CHUNKS)]
    request_configs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.hashes):
            raise ValueError(
                f"offsets has {len(self.offsets)} items but hashes has {len(self.hashes)}")


class LookupCleanupMsg(_Msg, tag="lookup.cleanup"):
    """Release what attempt ``seq`` of ``lookup_id`` pinned (it was cancelled or timed out)."""

    lookup_id: LookupId
    seq: NonNegative


class LookupResponseMsg(_Msg, tag="lookup.response"):
    """Worker ``worker_id`` holds (and pinned) the first ``num_hit_tokens`` tokens of the prompt."""

    lookup_id: LookupId
    seq: NonNegative
    worker_id: NonNegative
    num_hit_tokens: NonNegative


WorkerMsg = LookupRequestMsg | LookupCleanupMsg

_encoder = msgspec.msgpack.Encoder()
_worker_decoder = msgspec.msgpack.Decoder(WorkerMsg)
_scheduler_decoder = msgspec.msgpack.Decoder(LookupResponseMsg)


def encode(msg: _Msg) -> bytes:
    """One message as msgpack bytes."""
    return _encoder.encode(msg)


def decode_worker_msg(buf: bytes | memoryview) -> WorkerMsg:
    """What a lookup server receives: a request or a cleanup; ``ProtocolError`` for anything else."""
    try:
        return _worker_decoder.decode(buf)
    except Exception as exc:  # whatever the bytes: deep nesting in request_configs is a RecursionError
        raise ProtocolError(f"bad lookup message: {clip(str(exc))}") from None


def decode_response(buf: bytes | memoryview) -> LookupResponseMsg:
    """What the lookup client receives; ``ProtocolError`` for anything that is not a response."""
    try:
        return _scheduler_decoder.decode(buf)
    except Exception as exc:
        raise ProtocolError(f"bad lookup response: {clip(str(exc))}") from None
