"""The self-checking byte form of one chunk piece in a lower tier (a disk file, a Redis value).

A record is a header followed by the piece's bytes (format version 2)::

    magic "LMKV" | version u16 | flags u16 | nbytes u64 | head_lo u32 | head_hi u32
    | hash_len u16 | model_len u16 | layout_len u16 | reserved u16 (0) | checksum 16 bytes
    | chunk hash | model name (utf-8) | layout (utf-8) | payload

all little-endian: the fixed part is 48 bytes. The key it names is ``ChunkKey(model name, layout,
head_lo, head_hi, chunk hash)``: KV heads ``[head_lo, head_hi)`` of the chunk. ``checksum`` is the
first 16 bytes of blake3 over the header fields before it, the chunk hash, the model name, the
layout and the payload, so a flipped bit anywhere, a truncated payload or a record of another key
(another piece of the same chunk, a file renamed by hand, a Redis key collision) is caught before a
byte is served. The format version is in every record and in every Redis key: a reader never
guesses, and a record of another version (version 1 named ``world_size``/``kv_rank`` instead of a
layout and a head range) is a ``RecordError``, so a miss, never served.
"""

from __future__ import annotations

import struct

from blake3 import blake3

from lmcache_core.keys import ChunkKey

Buffer = bytes | bytearray | memoryview

MAGIC = b"LMKV"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<4sH")  # magic, version: what every version of the format starts with
# magic, version, flags, nbytes, head_lo, head_hi, hash_len, model_len, layout_len, reserved
_FIXED = struct.Struct("<4sHHQIIHHHH")
CHECKSUM_BYTES = 16
FIXED_BYTES = _FIXED.size + CHECKSUM_BYTES  # 48: what a reader needs first to learn the rest
_U16 = 2**16
_U32 = 2**32


class RecordError(ValueError):
    """A record is not a well-formed, intact record of the expected key."""


def _key_fields(key: ChunkKey) -> tuple[bytes, bytes]:
    """The key's model name and layout as bytes; ValueError for a key no record can hold."""
    model = key.model_name.encode()
    layout = key.layout.encode()
    if not 0 <= key.head_lo < key.head_hi < _U32:
        raise ValueError(f"head range [{key.head_lo}, {key.head_hi}) is not a record's")
    if not 0 < len(key.chunk_hash) < _U16 or not 0 < len(layout) < _U16 or len(model) >= _U16:
        raise ValueError("chunk hash, layout or model name too long (or empty) for a record")
    return model, layout


def _fixed(key: ChunkKey, nbytes: int, model: bytes, layout: bytes) -> bytes:
    return _FIXED.pack(MAGIC, FORMAT_VERSION, 0, nbytes, key.head_lo, key.head_hi,
                       len(key.chunk_hash), len(model), len(layout), 0)


def header_bytes(key: ChunkKey) -> int:
    """Length of ``key``'s record header (the payload starts here)."""
    return (FIXED_BYTES + len(key.chunk_hash) + len(key.model_name.encode())
            + len(key.layout.encode()))


def checksum(key: ChunkKey, nbytes: int, payload: Buffer) -> bytes:
    """The record checksum of ``payload`` stored under ``key``."""
    model, layout = _key_fields(key)
    hasher = blake3(_fixed(key, nbytes, model, layout))
    hasher.update(key.chunk_hash)
    hasher.update(model)
    hasher.update(layout)
    hasher.update(payload)
    return hasher.digest(CHECKSUM_BYTES)


def encode_header(key: ChunkKey, payload: Buffer) -> bytes:
    """The header of a record of ``payload`` (checksummed now, so ``payload`` must not change)."""
    nbytes = memoryview(payload).nbytes
    model, layout = _key_fields(key)
    return b"".join((_fixed(key, nbytes, model, layout), checksum(key, nbytes, payload),
                     key.chunk_hash, model, layout))


def encode(key: ChunkKey, payload: Buffer) -> bytes:
    """A whole record (header + payload) in one bytes object (one copy of the payload)."""
    return b"".join((encode_header(key, payload), payload))


def encode_into(key: ChunkKey, payload: Buffer, out: bytearray) -> int:
    """Write the record into ``out`` (grown if short: reuse it to skip fresh pages); its length."""
    header = encode_header(key, payload)
    size = len(header) + memoryview(payload).nbytes
    if len(out) < size:
        out.extend(bytes(size - len(out)))
    view = memoryview(out)
    view[:len(header)] = header
    view[len(header):size] = memoryview(payload).cast("B")
    return size


class Header:
    """A parsed header: the key it names, the payload size, the checksum and its own length."""

    __slots__ = ("checksum", "key", "length", "nbytes")

    def __init__(self, key: ChunkKey, nbytes: int, check: bytes, length: int) -> None:
        self.key = key
        self.nbytes = nbytes
        self.checksum = check
        self.length = length


def fixed_lengths(fixed: Buffer) -> tuple[int, int]:
    """From the first ``FIXED_BYTES``: (header length, payload length); RecordError if not a record
    of this format version."""
    view = memoryview(fixed)
    if view.nbytes < _PREFIX.size:
        raise RecordError(f"record shorter than its {FIXED_BYTES}-byte fixed header")
    magic, version = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise RecordError("not an lmcache chunk record (bad magic)")
    if version != FORMAT_VERSION:
        raise RecordError(f"record format version {version}, this build reads {FORMAT_VERSION}")
    if view.nbytes < FIXED_BYTES:
        raise RecordError(f"record shorter than its {FIXED_BYTES}-byte fixed header")
    *_, nbytes, _lo, _hi, hash_len, model_len, layout_len, _reserved = _FIXED.unpack_from(view)
    return FIXED_BYTES + hash_len + model_len + layout_len, nbytes


def parse_header(data: Buffer) -> Header:
    """Parse the header at the start of ``data`` (which holds at least the whole header)."""
    view = memoryview(data)
    length, nbytes = fixed_lengths(view)
    if view.nbytes < length:
        raise RecordError("record shorter than its header")
    *_, head_lo, head_hi, hash_len, model_len, layout_len, _reserved = _FIXED.unpack_from(view)
    check = bytes(view[_FIXED.size:FIXED_BYTES])
    at = FIXED_BYTES + hash_len
    chunk_hash = bytes(view[FIXED_BYTES:at])
    try:
        model = bytes(view[at:at + model_len]).decode()
        layout = bytes(view[at + model_len:length]).decode()
    except UnicodeDecodeError:
        raise RecordError("record model name or layout is not utf-8") from None
    if not hash_len or not layout_len or head_lo >= head_hi:
        raise RecordError("record header is inconsistent")
    return Header(ChunkKey(model, layout, head_lo, head_hi, chunk_hash), nbytes, check, length)


def verify(header: Header, payload: Buffer, expected: ChunkKey | None = None) -> None:
    """RecordError unless ``payload`` is the header's intact payload (of ``expected``, if given:
    the same model, layout, head range and chunk hash)."""
    if expected is not None and tuple(header.key) != tuple(expected):
        raise RecordError(f"record holds {header.key.short()}, not {expected.short()}"
                          + _differs(header.key, expected))
    if memoryview(payload).nbytes != header.nbytes:
        raise RecordError(
            f"payload is {memoryview(payload).nbytes} bytes, the header says {header.nbytes}")
    if checksum(header.key, header.nbytes, payload) != header.checksum:
        raise RecordError("checksum mismatch")


def _differs(held: ChunkKey, expected: ChunkKey) -> str:
    fields = [name for name, a, b in zip(ChunkKey._fields, held, expected, strict=True) if a != b]
    return f" ({', '.join(fields)} differ)" if fields else ""


def decode_into(data: Buffer, expected: ChunkKey, out: memoryview) -> int:
    """Verify the record ``data`` of ``expected`` and copy its payload into ``out``; its nbytes.

    The checksum is taken over ``data`` before the copy, so ``out`` is only written when valid.
    """
    view = memoryview(data)
    header = parse_header(view)
    payload = view[header.length:]
    verify(header, payload, expected)
    if header.nbytes > out.nbytes:
        raise RecordError(f"a {header.nbytes}-byte chunk does not fit a {out.nbytes}-byte slot")
    out[:header.nbytes] = payload
    return header.nbytes
