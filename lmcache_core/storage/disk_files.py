"""The disk tier's chunk files themselves: their names, the scan that finds them in a directory, and
reading and writing one whole file (``lmcache_core.storage.disk`` keeps the index, the cap and the
writer thread, and decides what to do when a file is bad).

A file holds one ``record`` (header with key, size and xxh3 checksums, then the payload) and is
named ``<hash hex>.<head_lo>-<head_hi>.<tag>.lmkv`` (``file_name``); a write goes to a temp name
(``TMP_PREFIX``) in the same directory first and is renamed over the final name, so a reader never
sees half a file.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from blake3 import blake3

from lmcache_core.keys import ChunkKey
from lmcache_core.storage import record

SUFFIX = ".lmkv"
TMP_PREFIX = ".tmp-"
_HEAD_READ = 4096  # one read covers any usual header (48 bytes + hash + model name + layout)


class DiskFile:
    """One indexed chunk file: its name, header length, payload bytes, file size, and when it was
    written (wall clock; at a re-index, its mtime: when it was last written or read)."""

    __slots__ = ("header_len", "mtime", "name", "nbytes", "size")

    def __init__(self, name: str, header_len: int, nbytes: int, size: int,
                 mtime: float | None = None) -> None:
        self.name = name
        self.header_len = header_len
        self.nbytes = nbytes
        self.size = size
        self.mtime = time.time() if mtime is None else mtime


def file_name(key: ChunkKey) -> str:
    """``<hash hex>.<head_lo>-<head_hi>.<tag>.lmkv``, ``tag`` the first 12 hex digits of
    blake3(model name 0x00 layout): readable, and unique per key (the header holds the key itself,
    and a file whose header names another key than its name is dropped at the scan)."""
    tag = blake3(key.model_name.encode() + b"\0" + key.layout.encode()).hexdigest(6)
    return f"{key.chunk_hash.hex()}.{key.head_lo}-{key.head_hi}.{tag}{SUFFIX}"


def scan(path: Path, on_bad: Callable[[str, record.RecordError], None]
         ) -> list[tuple[float, ChunkKey, DiskFile]]:
    """The chunk files in ``path`` from their headers, oldest mtime first. Leftover temp files (a
    crash mid-write) are deleted; a bad file (size or name not matching its header, a bad header)
    is passed to ``on_bad``, then deleted; a file that vanishes meanwhile is skipped."""
    found: list[tuple[float, ChunkKey, DiskFile]] = []
    for dirent in os.scandir(path):
        name = dirent.name
        if name.startswith(TMP_PREFIX):
            unlink(path / name)  # a write that never got renamed: a crash mid-write
            continue
        if not name.endswith(SUFFIX) or not dirent.is_file(follow_symlinks=False):
            continue
        try:
            stat = dirent.stat(follow_symlinks=False)
            key, meta = read_meta(path, name, stat.st_size, stat.st_mtime)
        except record.RecordError as exc:
            on_bad(name, exc)
            unlink(path / name)
            continue
        except OSError:
            continue  # vanished meanwhile
        found.append((stat.st_mtime, key, meta))
    found.sort(key=lambda item: item[0])
    return found


def read_meta(path: Path, name: str, size: int,
              mtime: float | None = None) -> tuple[ChunkKey, DiskFile]:
    """The key file ``name`` (``size`` bytes, modified at ``mtime``) holds, and its ``DiskFile``,
    from its header; RecordError if the header is bad or does not match the file's size or name."""
    with open(path / name, "rb") as f:
        head = f.read(_HEAD_READ)
        length, _ = record.fixed_lengths(head)
        if length > len(head):  # a long model name or layout
            head += f.read(length - len(head))
    header = record.parse_header(head)
    if size != header.length + header.nbytes:
        raise record.RecordError(
            f"file is {size} bytes, its header says {header.length + header.nbytes} (truncated?)")
    if file_name(header.key) != name:
        raise record.RecordError(f"file name does not match the key it holds ({header.key.short()})")
    return header.key, DiskFile(name, header.length, header.nbytes, size, mtime)


def read_payload(path: Path, meta: DiskFile, key: ChunkKey, out: memoryview) -> int:
    """Read file ``meta``'s payload into ``out`` and verify it against ``key`` and its checksums;
    returns its ``payload_xxh3`` (the piece's checksum). RecordError if the file is short, long,
    changed since it was indexed or corrupt; OSError (FileNotFoundError when it is gone) if it
    cannot be read."""
    with open(path, "rb", buffering=0) as f:
        head = f.read(meta.header_len)
        header = record.parse_header(head)
        payload = out[:header.nbytes]
        if header.nbytes != meta.nbytes:
            raise record.RecordError("the header changed since the file was indexed")
        got = _read_fully(f, payload)
        if got != header.nbytes:
            raise record.RecordError(
                f"payload is {got} bytes, the header says {header.nbytes} (truncated)")
        if f.read(1):
            raise record.RecordError("file is longer than its header says")
        record.verify(header, payload, key)
        return header.payload_xxh3


def write_file(tmp: Path, final: Path, header: bytes, payload: memoryview) -> None:
    """Write ``header`` then ``payload`` to ``tmp``, then rename it over ``final`` (atomic); OSError
    if that fails (``tmp`` may be left behind: the caller unlinks it)."""
    with open(tmp, "wb", buffering=0) as f:
        _write_fully(f, memoryview(header))
        _write_fully(f, payload)
    os.replace(tmp, final)


def _read_fully(f: object, out: memoryview) -> int:
    readinto = f.readinto  # type: ignore[attr-defined]
    got = 0
    while got < out.nbytes:
        n = readinto(out[got:])
        if not n:
            break
        got += n
    return got


def _write_fully(f: object, data: memoryview) -> None:
    write = f.write  # type: ignore[attr-defined]
    done = 0
    while done < data.nbytes:
        done += write(data[done:])


def unlink(path: Path) -> None:
    """Delete ``path``; quiet if it is already gone."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def iter_files(path: Path) -> Iterator[Path]:
    """The chunk files under ``path`` (for tools and tests)."""
    return (p for p in sorted(path.iterdir()) if p.name.endswith(SUFFIX))
