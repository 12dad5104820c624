"""Fuzz frames for ``lmcache serve``: valid requests built from the message structs, then mutated.

A case is what a DEALER sends, ``[uid, op, payload...]`` (the ROUTER adds the identity). Valid requests
come from the real op table (``OPS``) and message structs: hypothesis strategies are derived from each
struct's fields through ``msgspec.inspect`` (bounds from ``Meta(ge=, le=, max_length=)`` included), so a
new op or field is fuzzed without touching this file. A seeded ``random.Random`` then mutates them:
truncation, bit flips, byte insertion and deletion, wrong types, huge and negative integers, near-limit
and over-limit sizes, unknown ops, missing and extra frames, deep nesting, msgpack length headers that
lie, and garbage. Everything is reproducible from one seed.
"""

from __future__ import annotations

import functools
import math
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import msgspec.inspect as mi
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from lmcache_core.protocol.codec import encode, encode_request
from lmcache_core.protocol.lmcache_wire import STREAM_CONTROL, frames_op
from lmcache_core.protocol.ops import OPS, RequestType

#: 5000 nested one-element arrays around a nil: this op frame killed the server loop (RecursionError).
DEEP_ARRAY = b"\x91" * 5000 + b"\xc0"
#: the same depth as one-entry maps ``{"a": {"a": ...}}``.
DEEP_MAP = b"\x81\xa1a" * 5000 + b"\xc0"
HUGE_INTS = (2**63 - 1, 2**64 - 1, -(2**63), -1, -(2**31), 2**31, 2**32, 2**62, 1_500_000)
#: LMCache 0.5.6's own op names (its clients send these or integers 1-33: its dialect, answered in
#: its own form; see ``Case.lmcache``).
LEGACY_NAMES = ("ping", "store", "retrieve", "lookup", "register_kv_cache", "end_session", "clear")
#: msgpack headers that announce far more than follows (str32, bin32, array32, map32, ext32).
LYING_HEADERS = (b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                 b"\xdf\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xdd\x7f\xff\xff\xff\xc0")
#: bytes that are not msgpack (0xc1 is never used), and extension types the server knows nothing of.
ODD_VALUES = (b"\xc1", b"\xd4\x01\x00", b"\xd6\xff\x00\x00\x00\x00", b"\xc7\x00\x05", b"\xca\x7f\xc0\x00\x00",
              b"", b"\x00" * 3, b"\xff" * 8)
#: a segment name no test creates: generated registrations must never name a real /dev/shm segment
#: (the server maps what a registration names, and unlinks it when it reaps the registration).
ABSENT_SHM_PREFIX = "lmcfuzz-absent-"
SMALL_LIST = 6  # longest list a valid request gets (long ones come from the size mutations)
SMALL_TEXT = 24


class FuzzLimits(NamedTuple):
    """The server's limits the size mutations aim at (``server.max_request_bytes`` etc.)."""

    max_request_bytes: int
    max_keys_per_request: int

    @property
    def hard_cap(self) -> int:
        """zmq's MAXMSGSIZE on the server: a bigger message drops the connection, with no reply."""
        return 4 * self.max_request_bytes


@dataclass(frozen=True)
class Case:
    """One request to send: ``frames`` after the identity, and the mutation that made it."""

    kind: str
    frames: tuple[bytes, ...]

    @property
    def size(self) -> int:
        return sum(len(f) for f in self.frames)

    @property
    def lmcache(self) -> bool:
        """LMCache's dialect (its op frame, a uid a reply can carry): its reply is LMCache's, not
        ours (for a bad request, the failure LMCache's client raises)."""
        return frames_op(self.frames) is not None

    @property
    def expects_reply(self) -> bool:
        """Every frame is answered, except a stream's credit (LMCache's protocol defines none)."""
        return frames_op(self.frames) != STREAM_CONTROL

    def describe(self, limit: int = 160) -> str:
        """The kind, frame sizes and the first bytes of each frame (for failure reports)."""
        heads = ", ".join(_short(f, limit // max(1, len(self.frames))) for f in self.frames[:6])
        more = f", ... {len(self.frames) - 6} more" if len(self.frames) > 6 else ""
        return f"{self.kind} ({len(self.frames)} frames, {self.size} bytes): [{heads}{more}]"

    def expr(self) -> str:
        """The frames as a Python expression (runs folded), for a regression case."""
        return "[" + ", ".join(frame_expr(f) for f in self.frames[:8]) + "]"


def frame_expr(frame: bytes, limit: int = 600) -> str:
    """A Python expression for ``frame`` with runs folded (``b'\\x91' * 5000 + b'\\xc0'``), short
    enough to paste into ``fuzz_regressions.py``; longer than ``limit`` characters, it is cut."""
    parts: list[str] = []
    literal = bytearray()
    i = 0
    while i < len(frame) and len(literal) + 40 * len(parts) <= limit:  # stop once it will be cut
        unit, count = _run_at(frame, i)
        if unit:
            if literal:
                parts.append(repr(bytes(literal)))
                literal.clear()
            parts.append(f"{unit!r} * {count}")
            i += len(unit) * count
        else:
            literal.append(frame[i])
            i += 1
    if literal or not parts:
        parts.append(repr(bytes(literal)))
    text = " + ".join(parts)
    if i < len(frame) or len(text) > limit:
        return f"{text[:limit]}...<cut: {len(frame)} bytes>"
    return text


def _run_at(data: bytes, start: int, min_bytes: int = 32) -> tuple[bytes, int]:
    """The shortest unit (<= 8 bytes) repeated from ``start`` over >= ``min_bytes``, and its count."""
    for size in range(1, 9):
        unit = data[start:start + size]
        if len(unit) < size:
            break
        count = 1
        while data[start + count * size:start + (count + 1) * size] == unit:
            count += 1
        if count * size >= min_bytes:
            return unit, count
    return b"", 0


def _short(frame: bytes, limit: int) -> str:
    limit = max(limit, 12)
    if len(frame) <= limit:
        return repr(frame)
    return f"{frame[:limit]!r}...<{len(frame)} bytes>"


# ---------------------------------------------------------------- strategies from the message types


def value_strategy(t: mi.Type, name: str = "") -> st.SearchStrategy[Any]:
    """Valid values of one field type, as msgspec sees it (bounds included)."""
    if name == "shm_name":
        return st.integers(0, 2**32).map(lambda n: f"{ABSENT_SHM_PREFIX}{n:x}")
    for types, build in _BUILDERS:
        if isinstance(t, types):
            return build(t)
    raise TypeError(f"no fuzz strategy for field {name!r} of type {t!r}: add one to fuzz_frames.py")


def _int_strategy(t: mi.IntType) -> st.SearchStrategy[int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**63))
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**64 - 1)
    return st.integers(lo, hi)


def _text_strategy(t: mi.StrType) -> st.SearchStrategy[str]:
    lo = t.min_length or 0
    hi = min(t.max_length if t.max_length is not None else SMALL_TEXT, max(lo, SMALL_TEXT))
    if t.pattern is not None:
        return st.from_regex(t.pattern, fullmatch=True).filter(lambda s: lo <= len(s) <= hi)
    return st.text(st.characters(codec="utf-8"), min_size=lo, max_size=hi)


def _bytes_strategy(t: mi.BytesType) -> st.SearchStrategy[bytes]:
    lo = t.min_length or 0
    hi = min(t.max_length if t.max_length is not None else 64, max(lo, 64))
    return st.binary(min_size=lo, max_size=hi)


def _list_strategy(t: mi.ListType) -> st.SearchStrategy[list[Any]]:
    lo = t.min_length or 0
    hi = min(t.max_length if t.max_length is not None else SMALL_LIST, max(lo, SMALL_LIST))
    return st.lists(value_strategy(t.item_type), min_size=lo, max_size=hi)


def struct_strategy(t: mi.StructType) -> st.SearchStrategy[dict[str, Any]]:
    """A struct as the dict its msgpack map holds: required fields always, optional ones sometimes."""
    required = {f.encode_name: value_strategy(f.type, f.name) for f in t.fields if f.required}
    optional = {f.encode_name: value_strategy(f.type, f.name) for f in t.fields if not f.required}
    return st.fixed_dictionaries(required, optional=optional)


_BUILDERS: tuple[tuple[type | tuple[type, ...], Callable[[Any], st.SearchStrategy[Any]]], ...] = (
    (mi.BoolType, lambda t: st.booleans()),
    (mi.IntType, _int_strategy),
    (mi.FloatType, lambda t: st.floats(allow_nan=False, min_value=t.ge, max_value=t.le)),
    (mi.StrType, _text_strategy),
    ((mi.BytesType, mi.ByteArrayType, mi.MemoryViewType), _bytes_strategy),
    (mi.NoneType, lambda t: st.none()),
    (mi.LiteralType, lambda t: st.sampled_from(t.values)),
    (mi.UnionType, lambda t: st.one_of([value_strategy(x) for x in t.types])),
    ((mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType), _list_strategy),
    (mi.StructType, struct_strategy),
    (mi.AnyType, lambda t: st.one_of(st.none(), st.integers(), st.text(max_size=8))),
)


class ValidRequest(NamedTuple):
    op: RequestType
    payload: msgspec.Struct


def request_strategy(op: RequestType) -> st.SearchStrategy[ValidRequest]:
    """Valid requests of ``op``: its struct's fields drawn, then built into the real struct (so
    msgspec checks the strategy honoured every bound; draws its own checks refuse are left out)."""
    cls = OPS[op].request
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)

    def build(fields: dict[str, Any]) -> ValidRequest | None:
        try:
            return ValidRequest(op, msgspec.convert(fields, cls))
        except msgspec.ValidationError:  # a check beyond the fields' bounds (a __post_init__)
            return None

    return struct_strategy(info).map(build).filter(lambda r: r is not None)  # type: ignore[return-value]


@functools.cache  # the fuzz run and the echo test draw the same corpus (seconds of hypothesis)
def valid_corpus(seed: int, per_op: int) -> tuple[ValidRequest, ...]:
    """Up to ``per_op`` valid requests of every op (fewer where hypothesis runs out of distinct
    ones), reproducibly: each op's strategy runs under a fixed hypothesis seed, with no database."""
    out: list[ValidRequest] = []
    for op in sorted(OPS, key=lambda o: o.value):

        @settings(max_examples=per_op, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @hypothesis_seed(seed)
        @given(request_strategy(op))
        def collect(request: ValidRequest) -> None:
            out.append(request)

        collect()
    return tuple(out)


# ---------------------------------------------------------------- mutations


class Mutator:
    """Turns valid requests into hostile ones; every choice comes from one seeded ``Random``."""

    def __init__(self, rng: random.Random, limits: FuzzLimits) -> None:
        self.rng = rng
        self.limits = limits
        self.uids = iter(range(1, 2**62))

    def valid_frames(self, request: ValidRequest) -> list[bytes]:
        return encode_request(next(self.uids), request.op, [request.payload])

    # -- whole-frame byte mutations

    def truncate(self, frames: list[bytes]) -> list[bytes]:
        i = self._frame_index(frames)
        frames[i] = frames[i][:self.rng.randrange(len(frames[i]))] if frames[i] else frames[i]
        return frames

    def bitflip(self, frames: list[bytes]) -> list[bytes]:
        i = self._frame_index(frames)
        data = bytearray(frames[i] or b"\x00")
        for _ in range(self.rng.choice((1, 1, 2, 3, 8))):
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        frames[i] = bytes(data)
        return frames

    def splice(self, frames: list[bytes]) -> list[bytes]:
        """Insert random or odd bytes, delete a slice, or duplicate one."""
        i = self._frame_index(frames)
        data = frames[i]
        at = self.rng.randrange(len(data) + 1)
        choice = self.rng.randrange(3)
        if choice == 0:
            extra = self.rng.choice((self.rng.randbytes(self.rng.randrange(1, 9)), *ODD_VALUES))
            frames[i] = data[:at] + extra + data[at:]
        elif choice == 1:
            frames[i] = data[:at] + data[at + self.rng.randrange(1, 9):]
        else:
            frames[i] = data[:at] + data[at:at + self.rng.randrange(1, 17)] * 2 + data[at:]
        return frames

    def _frame_index(self, frames: list[bytes]) -> int:
        return self.rng.choice((0, 1, 2, 2, 2)) if len(frames) >= 3 else self.rng.randrange(len(frames))

    # -- field mutations (on the decoded payload map)

    def wrong_type(self, frames: list[bytes]) -> list[bytes]:
        return self._set_field(frames, self._odd_value())

    def huge_int(self, frames: list[bytes]) -> list[bytes]:
        value = self.rng.choice(HUGE_INTS) + self.rng.choice((0, 0, 1, -1))
        return self._set_field(frames, value, prefer=int)

    def deep_field(self, frames: list[bytes]) -> list[bytes]:
        """A field (or a list element) replaced by nesting far past any sane depth."""
        return self._set_field(frames, _Raw(self.rng.choice((DEEP_ARRAY, DEEP_MAP, b"\x91" * 100 + b"\x01"))))

    def lying_field(self, frames: list[bytes]) -> list[bytes]:
        return self._set_field(frames, _Raw(self.rng.choice(LYING_HEADERS)))

    def extra_field(self, frames: list[bytes]) -> list[bytes]:
        payload = self._payload(frames)
        name = self.rng.choice(("x", "instance_id ", "__class__", "kind", "\x00", "a" * 300))
        payload[name] = self._odd_value()
        frames[2:] = [encode(payload)]
        return frames

    def missing_field(self, frames: list[bytes]) -> list[bytes]:
        payload = self._payload(frames)
        if payload:
            del payload[self.rng.choice(list(payload))]
        frames[2:] = [encode(payload)]
        return frames

    def _payload(self, frames: list[bytes]) -> dict[str, Any]:
        """The payload map to mutate (empty when an earlier mutation left none decodable)."""
        try:
            value = msgspec.msgpack.decode(frames[2]) if len(frames) >= 3 else {}
        except (msgspec.DecodeError, RecursionError):
            return {}
        return value if isinstance(value, dict) else {}

    def _set_field(self, frames: list[bytes], value: Any, prefer: type | None = None) -> list[bytes]:
        """Replace one field's value (or one element of a list field, or a nested struct's field)."""
        payload = self._payload(frames)
        if not payload:
            payload = {"instance_id": 0}
        holder, key = self._pick_slot(payload, prefer)
        sentinel = f"\x00fuzz-sentinel-{self.rng.getrandbits(64):x}\x00"
        holder[key] = sentinel if isinstance(value, _Raw) else value
        try:
            encoded = encode(payload)
        except (OverflowError, TypeError, ValueError):  # e.g. a float nan key: keep the frame valid
            return frames
        if isinstance(value, _Raw):
            encoded = encoded.replace(encode(sentinel), value.data)
        frames[2:] = [encoded]
        return frames

    def _pick_slot(self, payload: dict[str, Any], prefer: type | None) -> tuple[Any, Any]:
        keys = list(payload)
        if prefer is not None:
            keys = [k for k in keys if isinstance(payload[k], prefer)] or keys
        key = self.rng.choice(keys)
        value = payload[key]
        if isinstance(value, list) and value and self.rng.random() < 0.5:
            index = self.rng.randrange(len(value))
            if isinstance(value[index], dict) and value[index] and self.rng.random() < 0.7:
                return self._pick_slot(value[index], prefer)
            return value, index
        if isinstance(value, dict) and value and self.rng.random() < 0.7:
            return self._pick_slot(value, prefer)
        return payload, key

    def _odd_value(self) -> Any:
        rng = self.rng
        return rng.choice((
            None, True, False, 0.5, math.inf, -math.inf, math.nan, "", "x" * rng.randrange(1, 300),
            b"", b"\xff" * rng.randrange(1, 100), [], {}, [None], [[1, 2]], {"k": 1}, {1: 2},
            rng.choice(HUGE_INTS), -rng.randrange(1, 2**31), [-1, 2**64 - 1], ["a", b"b", 1.5],
            [b"\x00" * 65], [b""], "\ud7ff\ue000\U0010ffff",
        ))

    # -- frame-level mutations

    def unknown_op(self, frames: list[bytes]) -> list[bytes]:
        rng = self.rng
        frames += [encode({})] * (2 - len(frames))
        frames[1] = rng.choice((
            lambda: encode(rng.randrange(1, 34)),  # LMCache's integer ops
            lambda: encode(rng.choice(HUGE_INTS)),
            lambda: encode(rng.choice(LEGACY_NAMES)),
            lambda: encode("lmc." + rng.choice(LEGACY_NAMES) + rng.choice(("", "_", "x", " ", "\x00"))),
            lambda: encode(rng.randbytes(rng.randrange(0, 40)).decode("latin-1")),
            lambda: encode(rng.choice((None, True, 1.5, b"lmc.ping", ["lmc.ping"], {"op": "lmc.ping"}))),
            lambda: encode("lmc.ping").upper(),
            lambda: rng.choice((DEEP_ARRAY, DEEP_MAP, *LYING_HEADERS, *ODD_VALUES)),
        ))()
        return frames

    def bad_uid(self, frames: list[bytes]) -> list[bytes]:
        rng = self.rng
        frames[0] = rng.choice((
            lambda: encode(rng.choice((None, "1", 1.5, b"\x01", [1], {"uid": 1}, True))),
            lambda: encode(rng.choice(HUGE_INTS)),
            lambda: rng.choice((DEEP_ARRAY, DEEP_MAP, *LYING_HEADERS, *ODD_VALUES)),
            lambda: rng.randbytes(rng.randrange(0, 32)),
            lambda: encode("u" * rng.randrange(100, 5000)),
        ))()
        return frames

    def frame_count(self, frames: list[bytes]) -> list[bytes]:
        """1, 2 (no payload), 4 or 50 frames; one empty frame is the closest zmq gets to none."""
        n = self.rng.choice((1, 1, 2, 2, 4, 4, 50))
        if n <= len(frames):
            out = frames[:n]
            return out if self.rng.random() < 0.8 else [b""] * n
        extra = self.rng.choice((frames[-1], encode({}), b"", DEEP_ARRAY, encode(None)))
        return frames + [extra] * (n - len(frames))

    def deep_frame(self, frames: list[bytes]) -> list[bytes]:
        i = self.rng.randrange(len(frames))
        depth = self.rng.choice((5000, 5000, 20_000, 100_000))
        frames[i] = self.rng.choice((b"\x91" * depth + b"\xc0", b"\x81\xa1a" * depth + b"\xc0",
                                     b"\xdc\x00\x01" * depth + b"\x01"))
        return frames

    def garbage(self, frames: list[bytes]) -> list[bytes]:
        rng = self.rng
        n = rng.choice((1, 2, 3, 3, 3, 4))
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(n)]

    def lying_frame(self, frames: list[bytes]) -> list[bytes]:
        frames[self._frame_index(frames)] = self.rng.choice(LYING_HEADERS)
        return frames

    # -- sizes near and over the server's limits

    def near_limit(self, frames: list[bytes]) -> list[bytes]:
        """Total size just under ``max_request_bytes``: a long string in one frame."""
        return self._fill_to(frames, self.limits.max_request_bytes - self.rng.randrange(0, 64))

    def over_limit(self, frames: list[bytes]) -> list[bytes]:
        """Just over ``max_request_bytes`` (a TOO_LARGE reply), but under zmq's hard cap."""
        lo = self.limits.max_request_bytes + 1
        target = self.rng.choice((lo, lo + self.rng.randrange(1, 64), 2 * lo, self.limits.hard_cap - 64))
        return self._fill_to(frames, target)

    def over_cap(self, frames: list[bytes]) -> list[bytes]:
        """Over zmq's MAXMSGSIZE: the server drops the connection; no reply is expected."""
        return self._fill_to(frames, self.limits.hard_cap + 1 + self.rng.randrange(0, 64))

    def _fill_to(self, frames: list[bytes], total: int) -> list[bytes]:
        where = self.rng.choice(("op", "payload", "uid", "extra"))
        rest = total - sum(len(f) for f in frames)
        if where == "extra" or len(frames) < 3:
            return [*frames, b"\x00" * max(0, rest)]
        index = {"uid": 0, "op": 1, "payload": 2}[where]
        if where == "payload" and self.rng.random() < 0.5:
            return self._fill_payload_field(frames, total)
        frames[index] = _str_frame(max(0, rest + len(frames[index])))
        return frames

    def _fill_payload_field(self, frames: list[bytes], total: int) -> list[bytes]:
        """Grow one string field of the payload (or a new one) until the request weighs ``total``."""
        payload = self._payload(frames)
        key = self.rng.choice([k for k, v in payload.items() if isinstance(v, str)] or ["x"])
        payload[key] = ""
        base = len(frames[0]) + len(frames[1]) + len(encode(payload))
        payload[key] = "y" * max(0, total - base - 4)  # str32's header is 4 bytes more than ""'s
        frames[2:] = [encode(payload)]
        return frames

    def key_lists(self, frames: list[bytes]) -> list[bytes]:
        """A hash list of exactly ``max_keys_per_request`` entries, or one more."""
        payload = self._payload(frames)
        n = self.limits.max_keys_per_request + self.rng.choice((0, 1, -1, 1000))
        size = self.rng.choice((1, 32, 64))
        blob = self.rng.randbytes(size * max(0, n))  # one draw: a draw per hash took 0.4 s a case
        payload["chunk_hashes"] = [blob[i:i + size] for i in range(0, len(blob), size)]
        if "block_ids" in payload and self.rng.random() < 0.5:
            payload["block_ids"] = list(range(4 * max(0, n)))
        frames[2:] = [encode(payload)]
        return frames


@dataclass(frozen=True)
class _Raw:
    """Bytes to splice in place of a field value, as they are (not re-encoded)."""

    data: bytes


def _str_frame(total: int) -> bytes:
    """A msgpack str frame of exactly ``total`` bytes (>= 6): an unknown op name, a huge uid."""
    if total < 6:
        return encode("x" * max(0, total - 1))
    return b"\xdb" + (total - 5).to_bytes(4, "big") + b"z" * (total - 5)


# ---------------------------------------------------------------- the case stream

#: (mutation, weight): how often each kind appears among the generated cases.
MUTATIONS: tuple[tuple[str, float], ...] = (
    ("valid", 14), ("truncate", 10), ("bitflip", 10), ("splice", 8), ("wrong_type", 10),
    ("huge_int", 8), ("deep_field", 2), ("lying_field", 2), ("extra_field", 4), ("missing_field", 4),
    ("unknown_op", 8), ("bad_uid", 5), ("frame_count", 5), ("deep_frame", 2), ("garbage", 4),
    ("lying_frame", 2), ("key_lists", 1), ("near_limit", 0.3), ("over_limit", 0.3),
)
OVER_CAP_EVERY = 5000  # one over-MAXMSGSIZE message per this many cases (each costs a reconnect)


class Hints(NamedTuple):
    """What the server knows (a registered instance id, its model name...), so that a share of the
    requests gets past "unknown id" into the copy paths. ``values``: field name -> values to use,
    at any depth; ``repair(payload, rng)`` may then make the payload consistent (e.g. block ids)."""

    values: dict[str, tuple[Any, ...]]
    repair: Callable[[dict[str, Any], random.Random], None] | None = None
    share: float = 0.35  # of the requests built on known values
    skip_ops: frozenset[RequestType] = frozenset()  # e.g. unregister: it would undo what it hints at


def _apply_hints(value: Any, hints: Hints, rng: random.Random) -> None:
    if isinstance(value, dict):
        for key in list(value):
            if key in hints.values and rng.random() < 0.9:
                value[key] = rng.choice(hints.values[key])
            else:
                _apply_hints(value[key], hints, rng)
    elif isinstance(value, list):
        for item in value[:8]:
            _apply_hints(item, hints, rng)


def generate_cases(seed: int, count: int, limits: FuzzLimits, hints: Hints | None = None,
                   corpus_per_op: int = 80) -> Iterator[Case]:
    """``count`` cases from ``seed``: valid requests (hypothesis, seeded), some given known values,
    mutated by a seeded Random."""
    corpus = valid_corpus(seed, corpus_per_op)
    rng = random.Random(seed)
    mutator = Mutator(rng, limits)
    names = [name for name, _ in MUTATIONS]
    weights = [w for _, w in MUTATIONS]
    for i in range(count):
        kind = "over_cap" if i % OVER_CAP_EVERY == OVER_CAP_EVERY - 1 else rng.choices(names, weights)[0]
        request = rng.choice(corpus)
        frames = mutator.valid_frames(request)
        if hints is not None and rng.random() < hints.share and request.op not in hints.skip_ops:
            frames = _hinted(frames, hints, rng)
            kind = f"known+{kind}"
        if not kind.endswith("valid"):
            frames = getattr(mutator, kind.removeprefix("known+"))(frames)
            if rng.random() < 0.1:  # now and then a second mutation on top
                frames = getattr(mutator, rng.choice(names[1:17]))(frames)
        yield Case(kind, tuple(frames or [b""]))


def _hinted(frames: list[bytes], hints: Hints, rng: random.Random) -> list[bytes]:
    payload = msgspec.msgpack.decode(frames[2])
    _apply_hints(payload, hints, rng)
    if hints.repair is not None:
        hints.repair(payload, rng)
    return [frames[0], frames[1], encode(payload)]


def default_seed() -> int:
    """``LMCACHE_FUZZ_SEED`` if set (to replay or explore), else a fixed seed: CI is reproducible."""
    return int(os.environ.get("LMCACHE_FUZZ_SEED", "20250610"))


# ---------------------------------------------------------------- worst single requests


def field_bound(op: RequestType, field: str, default: int) -> int:
    """The largest valid value of an int field (its ``le``/``lt``), or ``default`` if unbounded."""
    info = mi.type_info(OPS[op].request)
    assert isinstance(info, mi.StructType)
    for f in info.fields:
        if f.name == field and isinstance(f.type, mi.IntType):
            if f.type.le is not None:
                return f.type.le
            if f.type.lt is not None:
                return f.type.lt - 1
    return default


def worst_cases(limits: FuzzLimits) -> list[Case]:
    """The heaviest single requests we know of against these limits, one of each kind."""
    big, keys = limits.max_request_bytes, limits.max_keys_per_request
    hashes = [i.to_bytes(32, "big") for i in range(keys)]

    def req(op: RequestType, payload: Any, uid: int = 7) -> tuple[bytes, ...]:
        return (encode(uid), encode(op.value), encode(payload))

    lookup = {"model_name": "tiny", "lookup_id": "worst", "chunk_hashes": hashes, "lock": True}
    max_world = field_bound(RequestType.LOOKUP, "world_size", 2**31)
    store = {"instance_id": 2**62, "chunk_hashes": [h * 2 for h in hashes],
             "block_ids": list(range(4 * keys)), "event_handle": b""}
    store_size = len(encode(store))
    store["request_ids"] = ["r" * 1000] * max(0, (big - store_size - 4096) // 1003)
    return [
        Case("op name of 1 MiB", (encode(1), _str_frame(2**20), encode({}))),
        Case("op name near the limit", (encode(1), _str_frame(big - 64), encode({}))),
        Case("uid near the limit", (_str_frame(big - 64), encode("lmc.ping"), encode({}))),
        Case("5000-deep op frame", (encode(1), DEEP_ARRAY, encode({}))),
        Case("5000-deep uid frame", (DEEP_ARRAY, encode("lmc.ping"), encode({}))),
        Case("100000-deep payload", (encode(1), encode("lmc.lookup"), b"\x91" * 100_000 + b"\xc0")),
        Case("lookup world_size 2**31, max keys", req(RequestType.LOOKUP, {**lookup, "world_size": 2**31})),
        Case(f"lookup world_size {max_world} (largest valid), max keys",
             req(RequestType.LOOKUP, {**lookup, "world_size": max_world})),
        Case(f"lookup world_size {max_world}, {max(1, keys // max_world)} hashes (the most keys accepted)",
             req(RequestType.LOOKUP, {**lookup, "world_size": max_world,
                                      "chunk_hashes": hashes[:max(1, keys // max_world)]})),
        Case("lookup world_size 1,500,000", req(RequestType.LOOKUP, {**lookup, "world_size": 1_500_000})),
        Case("register 4096 layers", req(RequestType.REGISTER_KV_CACHE, {
            "instance_id": 3, "model_name": "tiny", "world_size": 1, "kv_rank": 0, "block_size": 16,
            "layout": "flash_attn", "pid": 1, "layers": [{
                "kind": "shm", "dtype": "float16", "shape": [2, 2**40, 16, 4, 32], "stride": [0] * 5,
                "shm_name": f"{ABSENT_SHM_PREFIX}{i}"} for i in range(4096)]})),
        Case("lookup max keys + 1", req(RequestType.LOOKUP, {**lookup, "world_size": 1,
                                                              "chunk_hashes": [*hashes, b"x"]})),
        Case("near-limit store, bogus instance id", req(RequestType.STORE, store)),
        Case("list_chunks limit 2**31-1", req(RequestType.LIST_CHUNKS, {"limit": 2**31 - 1})),
        Case("array32 header claiming 2**32-1 items", (encode(1), encode("lmc.lookup"), LYING_HEADERS[2])),
        Case("50 frames near the limit", (encode(1), encode("lmc.ping"),
                                          *[b"\x00" * ((big - 64) // 48)] * 48)),
        Case("over the hard cap (no reply)",
             (encode(1), encode("lmc.ping"), b"\x00" * (limits.hard_cap + 1))),
    ]


def chunked(items: Sequence[Case] | Iterator[Case], size: int) -> Iterator[list[Case]]:
    batch: list[Case] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
