"""The self-checking byte form of one chunk piece in a lower tier (a disk file, a Redis value).

A record is a header followed by the piece's bytes (format version 2)::

    magic "LMKV" | version u16 | flags u16 | nbytes u64 | head_lo u32 | head_hi u32
    | hash_len u16 | model_len u16 | layout_len u16 | reserved u16 (0) | payload_xxh3 u64
    | checksum 16 bytes | chunk hash | model name (utf-8) | layout (utf-8) | payload

all little-endian: the fixed part is 56 bytes. The key it names is ``ChunkKey(model name, layout,
head_lo, head_hi, chunk hash)``: KV heads ``[head_lo, head_hi)`` of the chunk. ``payload_xxh3`` is
the piece's checksum taken when it was stored (``integrity.checksum``: xxh3-64 of the payload, never
0), carried so the piece comes back into memory with it; ``checksum`` is xxh3-128 over the header
fields before it (``payload_xxh3`` included), the chunk hash, the model name and the layout. So a
flipped bit anywhere (header: ``checksum``; payload: ``payload_xxh3``), a truncated payload (the
length) or a record of another key (another piece of the same chunk, a file renamed by hand, a
Redis key collision: the key it names) is caught before a byte is served, with one pass over the
payload. The format version is in every record and in every Redis key: a reader never guesses, and
a record of another version (version 1 named ``world_size``/``kv_rank`` instead of a layout and a
head range) is a ``RecordError``, so a miss, never served.
"""

from __future__ import annotations

import struct

import xxhash

from lmcache_core.keys import ChunkKey
from lmcache_core.storage.integrity import checksum as payload_checksum

Buffer = bytes | bytearray | memoryview

MAGIC = b"LMKV"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<4sH")  # magic, version: what every version of the format starts with
# magic, version, flags, nbytes, head_lo, head_hi, hash_len, model_len, layout_len, reserved,
# payload_xxh3
_FIXED = struct.Struct("<4sHHQIIHHHHQ")
CHECKSUM_BYTES = 16
FIXED_BYTES = _FIXED.size + CHECKSUM_BYTES  # 56: what a reader needs first to learn the rest
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


def _fixed(key: ChunkKey, nbytes: int, model: bytes, layout: bytes, payload_xxh3: int) -> bytes:
    return _FIXED.pack(MAGIC, FORMAT_VERSION, 0, nbytes, key.head_lo, key.head_hi,
                       len(key.chunk_hash), len(model), len(layout), 0, payload_xxh3)


def header_bytes(key: ChunkKey) -> int:
    """Length of ``key``'s record header (the payload starts here)."""
    return (FIXED_BYTES + len(key.chunk_hash) + len(key.model_name.encode())
            + len(key.layout.encode()))


def checksum(key: ChunkKey, nbytes: int, payload_xxh3: int) -> bytes:
    """The header checksum of a record of ``key``: ``nbytes`` of payload whose checksum is
    ``payload_xxh3``."""
    model, layout = _key_fields(key)
    hasher = xxhash.xxh3_128(_fixed(key, nbytes, model, layout, payload_xxh3))
    hasher.update(key.chunk_hash)
    hasher.update(model)
    hasher.update(layout)
    return hasher.digest()[:CHECKSUM_BYTES]


def encode_header(key: ChunkKey, payload: Buffer, payload_xxh3: int = 0) -> bytes:
    """The header of a record of ``payload``; ``payload_xxh3``: its checksum when the caller
    verified it already (the piece's, from its store), else taken now (``payload`` must then not
    change until written)."""
    nbytes = memoryview(payload).nbytes
    payload_xxh3 = payload_xxh3 or payload_checksum(payload)
    model, layout = _key_fields(key)
    return b"".join((_fixed(key, nbytes, model, layout, payload_xxh3),
                     checksum(key, nbytes, payload_xxh3), key.chunk_hash, model, layout))


def encode(key: ChunkKey, payload: Buffer, payload_xxh3: int = 0) -> bytes:
    """A whole record (header + payload) in one bytes object (one copy of the payload)."""
    return b"".join((encode_header(key, payload, payload_xxh3), payload))


def encode_into(key: ChunkKey, payload: Buffer, out: bytearray, payload_xxh3: int = 0) -> int:
    """Write the record into ``out`` (grown if short: reuse it to skip fresh pages); its length."""
    header = encode_header(key, payload, payload_xxh3)
    size = len(header) + memoryview(payload).nbytes
    if len(out) < size:
        out.extend(bytes(size - len(out)))
    view = memoryview(out)
    view[:len(header)] = header
    view[len(header):size] = memoryview(payload).cast("B")
    return size


class Header:
    """A parsed header: the key it names, the payload size and checksum (``payload_xxh3``), the
    header checksum and its own length."""

    __slots__ = ("checksum", "key", "length", "nbytes", "payload_xxh3")

    def __init__(self, key: ChunkKey, nbytes: int, check: bytes, length: int,
                 payload_xxh3: int = 0) -> None:
        self.key = key
        self.nbytes = nbytes
        self.checksum = check
        self.length = length
        self.payload_xxh3 = payload_xxh3


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
    *_, nbytes, _lo, _hi, hash_len, model_len, layout_len, _reserved, _xxh3 = _FIXED.unpack_from(view)
    return FIXED_BYTES + hash_len + model_len + layout_len, nbytes


def parse_header(data: Buffer) -> Header:
    """Parse the header at the start of ``data`` (which holds at least the whole header)."""
    view = memoryview(data)
    length, nbytes = fixed_lengths(view)
    if view.nbytes < length:
        raise RecordError("record shorter than its header")
    *_, head_lo, head_hi, hash_len, model_len, layout_len, _reserved, payload_xxh3 = (
        _FIXED.unpack_from(view))
    check = bytes(view[_FIXED.size:FIXED_BYTES])
    at = FIXED_BYTES + hash_len
    chunk_hash = bytes(view[FIXED_BYTES:at])
    try:
        model = bytes(view[at:at + model_len]).decode()
        layout = bytes(view[at + model_len:length]).decode()
    except UnicodeDecodeError:
        raise RecordError("record model name or layout is not utf-8") from None
    if not hash_len or not layout_len or head_lo >= head_hi or not payload_xxh3:
        raise RecordError("record header is inconsistent")
    return Header(ChunkKey(model, layout, head_lo, head_hi, chunk_hash), nbytes, check, length,
                  payload_xxh3)


def verify(header: Header, payload: Buffer, expected: ChunkKey | None = None) -> None:
    """RecordError unless ``payload`` is the header's intact payload (of ``expected``, if given:
    the same model, layout, head range and chunk hash)."""
    if expected is not None and tuple(header.key) != tuple(expected):
        raise RecordError(f"record holds {header.key.short()}, not {expected.short()}"
                          + _differs(header.key, expected))
    if memoryview(payload).nbytes != header.nbytes:
        raise RecordError(
            f"payload is {memoryview(payload).nbytes} bytes, the header says {header.nbytes}")
    if checksum(header.key, header.nbytes, header.payload_xxh3) != header.checksum:
        raise RecordError("header checksum mismatch")
    if payload_checksum(payload) != header.payload_xxh3:
        raise RecordError("payload checksum (payload_xxh3) mismatch")


def _differs(held: ChunkKey, expected: ChunkKey) -> str:
    fields = [name for name, a, b in zip(ChunkKey._fields, held, expected, strict=True) if a != b]
    return f" ({', '.join(fields)} differ)" if fields else ""


def decode_into(data: Buffer, expected: ChunkKey, out: memoryview) -> int:
    """Verify the record ``data`` of ``expected`` and copy its payload into ``out``; its nbytes.

    The checksum is taken over ``data`` before the copy, so ``out`` is only written when valid.
    """
    return decode_checked_into(data, expected, out)[0]


def decode_checked_into(data: Buffer, expected: ChunkKey, out: memoryview) -> tuple[int, int]:
    """``decode_into``, returning ``(nbytes, payload_xxh3)``: the piece's checksum, verified."""
    view = memoryview(data)
    header = parse_header(view)
    payload = view[header.length:]
    verify(header, payload, expected)
    if header.nbytes > out.nbytes:
        raise RecordError(f"a {header.nbytes}-byte chunk does not fit a {out.nbytes}-byte slot")
    out[:header.nbytes] = payload
    return header.nbytes, header.payload_xxh3
