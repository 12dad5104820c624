"""Request-driven retention on the wire and in the connector: StoreRequest's hints, PIN/UNPIN, their
bounds, the kv_transfer_params parsing, server.max_pinned, and the worker adapter's grouping."""

from __future__ import annotations

import logging
import math

import msgspec
import pytest

from lmcache_core.config import load_config
from lmcache_core.errors import ConfigError, PinLimitError, ProtocolError, RequestTooLargeError
from lmcache_core.integration.vllm import connector_hints as hints_mod
from lmcache_core.integration.vllm.connector_hints import NO_HINTS, StoreHints, parse_hints
from lmcache_core.protocol import (
    Limits,
    RequestType,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    error_reply,
)
from lmcache_core.protocol import messages as m
from lmcache_core.protocol import pin_messages as pm


def _frames(op: str, payload: dict) -> list[bytes]:
    return [msgspec.msgpack.encode(1), msgspec.msgpack.encode(op), msgspec.msgpack.encode(payload)]


STORE = {"instance_id": 1, "chunk_hashes": [], "block_ids": []}
PIN = {"model_name": "m", "world_size": 1, "chunk_hashes": [b"h" * 32]}


@pytest.mark.parametrize(("op", "payload", "where"), [
    ("lmc.store", {**STORE, "ttl_s": 0}, "ttl_s"),
    ("lmc.store", {**STORE, "ttl_s": -1.0}, "ttl_s"),
    ("lmc.store", {**STORE, "ttl_s": 30 * 86400 + 1}, "ttl_s"),
    ("lmc.store", {**STORE, "ttl_s": math.inf}, "ttl_s"),
    ("lmc.store", {**STORE, "priority": 101}, "priority"),
    ("lmc.store", {**STORE, "priority": -101}, "priority"),
    ("lmc.store", {**STORE, "pin": 1}, "pin"),
    ("lmc.pin", {**PIN, "ttl_s": 0.0}, "ttl_s"),
    ("lmc.pin", {**PIN, "world_size": 0}, "world_size"),
    ("lmc.pin", {**PIN, "layout": "x" * 65}, "layout"),
    ("lmc.unpin", {**PIN, "chunk_hashes": [b""]}, "chunk_hashes"),
    ("lmc.pin", {**PIN, "lookup_id": "x"}, "lookup_id"),  # unknown fields are refused
])
def test_retention_fields_are_bounded(op: str, payload: dict, where: str) -> None:
    with pytest.raises(ProtocolError, match=where):
        decode_request(_frames(op, payload))


def test_store_hints_and_pins_round_trip() -> None:
    store = m.StoreRequest(instance_id=1, chunk_hashes=[b"a" * 32], block_ids=[1, 2, 3, 4],
                           ttl_s=30 * 86400.0, pin=True, priority=-100)
    assert decode_request(encode_request(1, RequestType.STORE, [store])).payload == store
    plain = decode_request(_frames("lmc.store", STORE)).payload
    assert (plain.ttl_s, plain.pin, plain.priority) == (None, False, 0)
    for op in (RequestType.PIN, RequestType.UNPIN):
        pin = pm.PinRequest(model_name="m", world_size=2, chunk_hashes=[b"a" * 32],
                           layout="bfloat16:32x8x128", ttl_s=0.5)
        decoded = decode_request(encode_request(2, op, [pin]))
        assert decoded.op is op and decoded.payload == pin
    assert RequestType.PIN.value == "lmc.pin" and RequestType.UNPIN.value == "lmc.unpin"


def test_a_pin_counts_one_key_per_rank_per_chunk() -> None:
    pin = pm.PinRequest(model_name="m", world_size=4, chunk_hashes=[b"h" * 32] * 10)
    frames = encode_request(0, RequestType.PIN, [pin])
    assert decode_request(frames, Limits(max_keys_per_request=40)).payload == pin
    with pytest.raises(RequestTooLargeError):
        decode_request(frames, Limits(max_keys_per_request=39))


def test_replies_carry_pins_and_the_typed_pin_limit_error() -> None:
    reply = m.StoreReply(stored=2, pin_refused=1)
    frames = encode_reply(b"\x01", b"", reply)
    assert decode_reply(RequestType.STORE, frames[2:]) == reply
    frames = encode_reply(b"\x01", b"", pm.PinReply(pinned=3))
    assert decode_reply(RequestType.PIN, frames[2:]) == pm.PinReply(pinned=3)
    frames = encode_reply(b"\x01", b"", pm.UnpinReply(unpinned=3))
    assert decode_reply(RequestType.UNPIN, frames[2:]) == pm.UnpinReply(unpinned=3)
    err = encode_reply(b"\x01", b"", error_reply(PinLimitError("over server.max_pinned")))
    assert msgspec.msgpack.decode(err[2]).get("code") == "pin_limit"
    with pytest.raises(PinLimitError, match="max_pinned"):
        decode_reply(RequestType.PIN, err[2:])


def test_older_clients_read_new_store_replies_and_chunk_rows() -> None:
    class OldStoreReply(m.Reply, tag="storereply"):
        stored: int

    new = m.StoreReply(stored=2, pin_refused=2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldStoreReply).stored == 2
    row = m.ChunkInfo(chunk_hash=b"h", model_name="m", layout="l", head_lo=0, head_hi=1,
                      tier="memory", nbytes=1, locks=0, hits=0, age_s=0.0)
    assert (row.pinned, row.expires_in_s, row.priority) == (False, None, 0)


# ---------------------------------------------------------------- kv_transfer_params


def test_hints_from_kv_transfer_params() -> None:
    assert parse_hints(None) is NO_HINTS and parse_hints({}) is NO_HINTS
    assert parse_hints({"do_remote_prefill": True, "lmcache.unknown": 1}) is NO_HINTS
    assert parse_hints({"lmcache.pin": True}) == StoreHints(pin=True)
    assert parse_hints({"lmcache.ttl_s": 60, "lmcache.priority": -5}) == StoreHints(
        ttl_s=60.0, priority=-5)
    assert parse_hints({"lmcache.skip_store": True}).skip_store
    assert parse_hints({"lmcache.pin": False, "lmcache.ttl_s": None}) is NO_HINTS


@pytest.mark.parametrize(("key", "value"), [
    ("lmcache.pin", "true"), ("lmcache.pin", 1), ("lmcache.skip_store", "yes"),
    ("lmcache.ttl_s", 0), ("lmcache.ttl_s", -3), ("lmcache.ttl_s", float("nan")),
    ("lmcache.ttl_s", 1e12), ("lmcache.ttl_s", True), ("lmcache.ttl_s", "60"),
    ("lmcache.priority", 101), ("lmcache.priority", 1.5), ("lmcache.priority", False),
])
def test_bad_hints_are_ignored_and_logged_once(key: str, value: object,
                                               caplog: pytest.LogCaptureFixture) -> None:
    hints_mod._logged.clear()
    with caplog.at_level(logging.WARNING, logger=hints_mod.logger.name):
        for _ in range(3):
            if key == "lmcache.priority":
                assert parse_hints({key: value}) == NO_HINTS
            else:  # the bad hint is dropped, the good one beside it kept
                assert parse_hints({key: value, "lmcache.priority": 7}) == StoreHints(priority=7)
    assert len([r for r in caplog.records if key in r.getMessage()]) == 1


def test_hints_of_a_request_without_params() -> None:
    class Req:
        kv_transfer_params = None

    assert hints_mod.request_hints(Req()) is NO_HINTS
    assert hints_mod.request_hints(object()) is NO_HINTS


# ---------------------------------------------------------------- config


def test_max_pinned_defaults_to_a_quarter_of_the_pool() -> None:
    cfg = load_config(None, {"server.pool_size": "8MiB"})
    assert cfg.server.max_pinned is None and cfg.server.max_pinned_bytes == 2 * 2**20
    cfg = load_config(None, {"server.pool_size": "8MiB", "server.max_pinned": "1MiB"})
    assert cfg.server.max_pinned_bytes == 2**20
    assert load_config(None, {"server.max_pinned": 0}).server.max_pinned_bytes == 0
    with pytest.raises(ConfigError, match="size"):
        load_config(None, {"server.max_pinned": "lots"})
