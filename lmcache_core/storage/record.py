"""The self-checking byte form of one chunk in a lower tier (a disk file, a Redis value).

A record is a header followed by the chunk's bytes::

    magic "LMKV" | version u16 | flags u16 | nbytes u64 | world_size u32 | kv_rank u32
    | hash_len u16 | model_len u16 | checksum 16 bytes | chunk hash | model name (utf-8) | payload

all little-endian. ``checksum`` is the first 16 bytes of blake3 over the header fields before it,
the chunk hash, the model name and the payload, so a flipped bit anywhere, a truncated payload or a
record of another key (a file renamed by hand, a Redis key collision) is caught before a byte is
served. The format version is in every record and in every Redis key: a reader never guesses.
"""

from __future__ import annotations

import struct

from blake3 import blake3

from lmcache_core.keys import ChunkKey

Buffer = bytes | bytearray | memoryview

MAGIC = b"LMKV"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHQIIHH")  # magic, version, flags, nbytes, world, rank, hash_len, model_len
CHECKSUM_BYTES = 16
FIXED_BYTES = _FIXED.size + CHECKSUM_BYTES  # 44: what a reader needs first to learn the rest


class RecordError(ValueError):
    """A record is not a well-formed, intact record of the expected key."""


def header_bytes(key: ChunkKey) -> int:
    """Length of ``key``'s record header (the payload starts here)."""
    return FIXED_BYTES + len(key.chunk_hash) + len(key.model_name.encode())


def checksum(key: ChunkKey, nbytes: int, payload: Buffer) -> bytes:
    """The record checksum of ``payload`` stored under ``key``."""
    model = key.model_name.encode()
    hasher = blake3(_FIXED.pack(MAGIC, FORMAT_VERSION, 0, nbytes, key.world_size, key.kv_rank,
                                len(key.chunk_hash), len(model)))
    hasher.update(key.chunk_hash)
    hasher.update(model)
    hasher.update(payload)
    return hasher.digest(CHECKSUM_BYTES)


def encode_header(key: ChunkKey, payload: Buffer) -> bytes:
    """The header of a record of ``payload`` (checksummed now, so ``payload`` must not change)."""
    nbytes = memoryview(payload).nbytes
    model = key.model_name.encode()
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, nbytes, key.world_size, key.kv_rank,
                        len(key.chunk_hash), len(model))
    return b"".join((fixed, checksum(key, nbytes, payload), key.chunk_hash, model))


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
    """From the first ``FIXED_BYTES``: (header length, payload length); RecordError if not a record."""
    view = memoryview(fixed)
    if view.nbytes < FIXED_BYTES:
        raise RecordError(f"record shorter than its {FIXED_BYTES}-byte fixed header")
    magic, version, _flags, nbytes, _world, _rank, hash_len, model_len = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise RecordError("not an lmcache chunk record (bad magic)")
    if version != FORMAT_VERSION:
        raise RecordError(f"record format version {version}, this build reads {FORMAT_VERSION}")
    return FIXED_BYTES + hash_len + model_len, nbytes


def parse_header(data: Buffer) -> Header:
    """Parse the header at the start of ``data`` (which holds at least the whole header)."""
    view = memoryview(data)
    length, nbytes = fixed_lengths(view)
    if view.nbytes < length:
        raise RecordError("record shorter than its header")
    _m, _v, _f, _n, world, rank, hash_len, model_len = _FIXED.unpack_from(view)
    check = bytes(view[_FIXED.size:FIXED_BYTES])
    chunk_hash = bytes(view[FIXED_BYTES:FIXED_BYTES + hash_len])
    try:
        model = bytes(view[FIXED_BYTES + hash_len:length]).decode()
    except UnicodeDecodeError:
        raise RecordError("record model name is not utf-8") from None
    if len(model.encode()) != model_len or not hash_len:
        raise RecordError("record header is inconsistent")
    return Header(ChunkKey(model, world, rank, chunk_hash), nbytes, check, length)


def verify(header: Header, payload: Buffer, expected: ChunkKey | None = None) -> None:
    """RecordError unless ``payload`` is the header's intact payload (of ``expected``, if given)."""
    if expected is not None and tuple(header.key) != tuple(expected):
        raise RecordError(f"record holds {header.key.short()}, not {expected.short()}")
    if memoryview(payload).nbytes != header.nbytes:
        raise RecordError(
            f"payload is {memoryview(payload).nbytes} bytes, the header says {header.nbytes}")
    if checksum(header.key, header.nbytes, payload) != header.checksum:
        raise RecordError("checksum mismatch")


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
