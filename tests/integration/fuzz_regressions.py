"""Requests that once broke ``lmcache serve``, replayed by ``test_fuzz.py`` on every run.

Each entry says what it broke. Frames are what a DEALER sends (``[uid, op, payload...]``); entries that
need something of the test's (a foreign shared-memory segment, the pid of an exited process) build
their frames from a ``RegressionContext``. Add every frame the fuzz suite finds here, with the date and
what happened, so it can never come back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from lmcache_core.protocol.codec import encode

DEEP_ARRAY = b"\x91" * 5000 + b"\xc0"


class RegressionContext(NamedTuple):
    """What the replaying test provides."""

    max_request_bytes: int
    foreign_shm: str  # a /dev/shm segment of "another program" (the test's), never to be touched
    foreign_nbytes: int
    dead_pid: int  # a process that has exited
    hostname: str
    own_shm: str  # a segment named as lmcache names the test process's own (it may register it)
    own_nbytes: int
    own_pid: int


@dataclass(frozen=True)
class Regression:
    name: str
    broke: str  # what it did to the server
    build: Callable[[RegressionContext], list[bytes]]
    codes: tuple[str, ...] = ()  # the ErrorReply codes it may get; () = any (an ErrorReply it must be)
    touches_foreign_shm: bool = False


def _request(op: str, payload: Any, uid: int = 1) -> list[bytes]:
    return [encode(uid), encode(op), encode(payload)]


def _str_frame(total: int) -> bytes:
    """A msgpack str32 frame of exactly ``total`` bytes."""
    return b"\xdb" + (total - 5).to_bytes(4, "big") + b"z" * (total - 5)


def foreign_layers(ctx: RegressionContext) -> list[dict[str, Any]]:
    """Two fp16 flash-attn layers (8 blocks of 16 tokens, 4 heads x 32) in the foreign segment:
    a well-formed registration of memory that is not ours."""
    layer = 2 * 8 * 16 * 4 * 32 * 2
    return [{"kind": "shm", "dtype": "float16", "shape": [2, 8, 16, 4, 32],
             "stride": [16384, 2048, 128, 32, 1], "offset_bytes": i * layer,
             "segment_nbytes": ctx.foreign_nbytes, "shm_name": ctx.foreign_shm} for i in range(2)]


def _register_foreign(ctx: RegressionContext, pid: int) -> list[bytes]:
    return _register(ctx, foreign_layers(ctx), pid)


def _register(ctx: RegressionContext, layers: list[dict[str, Any]], pid: int) -> list[bytes]:
    return _request("lmc.register_kv_cache", {
        "instance_id": 990_001, "model_name": "tiny", "world_size": 1, "kv_rank": 0, "block_size": 16,
        "layout": "flash_attn", "layers": layers, "pid": pid, "hostname": ctx.hostname})


def own_layers(ctx: RegressionContext, shape: list[int], stride: list[int]) -> list[dict[str, Any]]:
    """Two layers of the given geometry over the test's own, properly named segment: the ownership
    checks pass, so only the geometry checks stand between these and the copy code."""
    return [{"kind": "shm", "dtype": "float16", "shape": shape, "stride": stride, "offset_bytes": 0,
             "segment_nbytes": ctx.own_nbytes, "shm_name": ctx.own_shm}] * 2


REGRESSIONS: list[Regression] = [
    Regression(
        "deep op frame",
        "issue 10.1: RecursionError escaped the op decoder and killed the server loop; the process "
        "stayed up answering nothing, and SIGTERM then ended in a traceback from the waker",
        lambda ctx: [encode(1), DEEP_ARRAY, encode({})],
        codes=("bad_request", "unknown_op")),
    Regression(
        "deep uid frame", "the same nesting in the uid frame (issue 10.1's sibling)",
        lambda ctx: [DEEP_ARRAY, encode("lmc.ping"), encode({})], codes=("bad_request",)),
    Regression(
        "deep payload frame", "the same nesting in a payload frame (issue 10.1's sibling)",
        lambda ctx: [encode(1), encode("lmc.lookup"), DEEP_ARRAY], codes=("bad_request",)),
    Regression(
        "4 MiB unknown op name",
        "issue 10.3: the name went in full into the error message, was logged through rich at INFO "
        "and echoed in the reply: pings stalled 3 s and the log grew 5 MiB",
        lambda ctx: [encode(1), _str_frame(min(4 * 2**20, ctx.max_request_bytes - 64)), encode({})],
        codes=("unknown_op", "bad_request", "too_large")),
    Regression(
        "lookup world_size 1,500,000",
        "issue 10.4: one key per rank per missing chunk under the engine lock (1.8 s, +110 MiB with a "
        "disk tier); a normal lookup beside it timed out",
        lambda ctx: _request("lmc.lookup", {
            "model_name": "tiny", "world_size": 1_500_000, "lookup_id": "r",
            "chunk_hashes": [bytes([i % 256]) * 32 for i in range(64)], "lock": True}),
        codes=("bad_request",)),
    Regression(
        "register pid 2**62, foreign segment",
        "issue 10.2: os.kill(2**62, 0) raised OverflowError in the housekeeper, which then failed "
        "every second and never reaped again; 10.11: the segment named is not the server's to map",
        lambda ctx: _register_foreign(ctx, 2**62), touches_foreign_shm=True),
    Regression(
        "register foreign segment, exited pid",
        "issue 10.11: the server mapped another program's /dev/shm segment read-write and, reaping "
        "the registration of a pid that had exited, unlinked it 0.5 s later",
        lambda ctx: _register_foreign(ctx, ctx.dead_pid), touches_foreign_shm=True),
    # Found by test_fuzz.py (2026-12-01) once the fuzz registered the worker's own segment with
    # fuzzed geometry; each was a RuntimeError from torch answered as INTERNAL, with a traceback.
    Regression(
        "register dims 2**48, zero strides",
        "torch's set_() raised 'numel: integer multiplication overflow' (shape [2, 2**48, 16, 2**20, "
        "2**20], every stride 0: the byte-span check passed, the element count overflows int64)",
        lambda ctx: _register(ctx, own_layers(ctx, [2, 2**48, 16, 2**20, 2**20], [0] * 5), ctx.own_pid),
        codes=("bad_request", "incompatible")),
    Regression(
        "register 2**44 aliased blocks",
        "accepted: a KV cache of 2**44 blocks all at one address (block stride 0) over a 128 KiB "
        "segment; stores from it worked and every retrieve into it raised 'more than one element of "
        "the written-to tensor refers to a single memory location' (INTERNAL, a traceback each)",
        lambda ctx: _register(ctx, own_layers(ctx, [2, 2**44, 16, 4, 32], [0, 0, 128, 32, 1]),
                              ctx.own_pid),
        codes=("bad_request", "incompatible")),
    Regression(
        "register K and V aliased",
        "accepted: K and V planes at the same memory (plane stride 0); retrieves into it raised the "
        "same RuntimeError (INTERNAL)",
        lambda ctx: _register(ctx, own_layers(ctx, [2, 8, 16, 4, 32], [0, 2048, 128, 32, 1]),
                              ctx.own_pid),
        codes=("bad_request", "incompatible")),
]
