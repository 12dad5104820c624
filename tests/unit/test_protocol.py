import msgspec
import pytest

from lmcache_core.errors import (
    NotRegisteredError,
    ProtocolError,
    RequestTooLargeError,
    UnknownOperationError,
)
from lmcache_core.protocol import (
    OPS,
    Limits,
    RequestType,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    error_reply,
)
from lmcache_core.protocol import explain_messages as em
from lmcache_core.protocol import messages as m
from lmcache_core.protocol import pin_messages as pm

SAMPLES: dict[RequestType, m.Message] = {
    RequestType.PING: m.PingRequest(instance_id=7),
    RequestType.GET_CHUNK_SIZE: m.NoArgs(),
    RequestType.REGISTER_KV_CACHE: m.RegisterKVCacheRequest(
        instance_id=1, model_name="m", world_size=2, kv_rank=1, block_size=16, layout="flash_attn",
        layers=[m.TensorDescriptor(kind="shm", dtype="bfloat16", shape=[2, 8, 16, 4, 32],
                                   stride=[16384, 2048, 128, 32, 1], shm_name="seg",
                                   segment_nbytes=65536)]),
    RequestType.UNREGISTER_KV_CACHE: m.UnregisterKVCacheRequest(instance_id=1),
    RequestType.STORE: m.StoreRequest(instance_id=1, chunk_hashes=[b"a" * 32],
                                      block_ids=[1, 2, 3, 4], request_ids=["r"]),
    RequestType.RETRIEVE: m.RetrieveRequest(instance_id=1, chunk_hashes=[b"a" * 32],
                                            block_ids=[1, 2, 3, 4], lookup_id="r"),
    RequestType.LOOKUP: m.LookupRequest(model_name="m", world_size=2, lookup_id="r",
                                        chunk_hashes=[b"a" * 32, b"b" * 32]),
    RequestType.FREE_LOOKUP_LOCKS: m.LookupIdRequest(lookup_id="r"),
    RequestType.END_SESSION: m.LookupIdRequest(lookup_id="r"),
    RequestType.CLEAR: m.ClearRequest(force=True),
    RequestType.SERVER_INFO: m.NoArgs(),
    RequestType.LIST_CHUNKS: m.ListChunksRequest(model_name="m", limit=5, sort="hits"),
    RequestType.PIN: pm.PinRequest(model_name="m", world_size=2, chunk_hashes=[b"a" * 32],
                                  ttl_s=60.0),
    RequestType.UNPIN: pm.PinRequest(model_name="m", world_size=2, chunk_hashes=[b"a" * 32]),
    RequestType.PEEK: m.PeekRequest(model_name="m", world_size=2, chunk_hashes=[b"a" * 32],
                                    hint_layout="bfloat16:32x8x128"),
    RequestType.EXPLAIN: em.ExplainRequest(model_name="m", world_size=2, probes=[b"a" * 32],
                                           hint_layout="bfloat16:32x8x128"),
}


def test_every_op_has_a_sample_and_round_trips():
    assert set(SAMPLES) == set(OPS) == set(RequestType)
    for uid, (op, payload) in enumerate(SAMPLES.items()):
        frames = encode_request(uid, op, [payload])
        decoded = decode_request(frames)
        assert decoded.op is op and decoded.payload == payload
        assert msgspec.msgpack.decode(decoded.uid_frame) == uid


def test_reply_round_trip_and_typed_errors():
    frames = encode_reply(b"\x01", b"\xa3op", m.LookupReply(hit_chunks=3))
    assert frames[:2] == [b"\x01", b"\xa3op"]
    assert decode_reply(RequestType.LOOKUP, frames[2:]) == m.LookupReply(hit_chunks=3)
    err = encode_reply(b"\x01", b"", error_reply(NotRegisteredError("instance 9 unknown")))
    with pytest.raises(NotRegisteredError, match="instance 9 unknown"):
        decode_reply(RequestType.STORE, err[2:])
    with pytest.raises(ProtocolError):
        decode_reply(RequestType.STORE, [b"\xc1"])


def test_op_frames_are_strings_in_our_namespace():
    # LMCache 0.5.6 uses int ids 1-33 and bare snake_case names; ours must not collide.
    for op in RequestType:
        assert op.value.startswith("lmc.")


@pytest.mark.parametrize(("frames", "error"), [
    ([], ProtocolError),
    ([b"\x00"], ProtocolError),
    ([b"\x00", b"\xc1", b"\x80"], ProtocolError),                       # op frame not msgpack
    ([b"\x00", msgspec.msgpack.encode(6), b"\x80"], UnknownOperationError),  # LMCache legacy id
    ([b"\x00", msgspec.msgpack.encode("store"), b"\x80"], UnknownOperationError),
    ([b"\x00", msgspec.msgpack.encode("lmc.nope"), b"\x80"], UnknownOperationError),
    ([b"\x00", msgspec.msgpack.encode("lmc.ping")], ProtocolError),      # missing payload
    ([b"\x00", msgspec.msgpack.encode("lmc.ping"), b"\x80", b"\x80"], ProtocolError),
    ([b"\x00", msgspec.msgpack.encode("lmc.lookup"), msgspec.msgpack.encode({"x": 1})],
     ProtocolError),
    ([b"\x00", msgspec.msgpack.encode("lmc.lookup"),
      msgspec.msgpack.encode({"model_name": 1, "world_size": 1, "lookup_id": "a",
                              "chunk_hashes": []})], ProtocolError),     # wrong type
    ([b"\x00", msgspec.msgpack.encode("lmc.clear"), b"garbage!"], ProtocolError),
])
def test_malformed_requests_raise_typed_errors(frames, error):
    with pytest.raises(error):
        decode_request(frames)


def test_limits():
    many = m.LookupRequest(model_name="m", world_size=1, lookup_id="x",
                           chunk_hashes=[b"h" * 32] * 11)
    frames = encode_request(0, RequestType.LOOKUP, [many])
    assert decode_request(frames, Limits(max_keys_per_request=11)).payload == many
    with pytest.raises(RequestTooLargeError, match="at most 10 per request"):
        decode_request(frames, Limits(max_keys_per_request=10))
    with pytest.raises(RequestTooLargeError, match="bytes"):
        decode_request(frames, Limits(max_request_bytes=100))


NESTED = b"\x91" * 5000 + b"\xc0"  # 5000 nested arrays: killed the loop with a RecursionError


def _request(op: str, payload: object) -> list[bytes]:
    return [msgspec.msgpack.encode(1), msgspec.msgpack.encode(op), msgspec.msgpack.encode(payload)]


@pytest.mark.parametrize("frames", [
    [NESTED, msgspec.msgpack.encode("lmc.ping"), msgspec.msgpack.encode({})],
    [b"\x01", NESTED, msgspec.msgpack.encode({})],
    [b"\x01", msgspec.msgpack.encode("lmc.ping"), NESTED],
    [b"\x01", msgspec.msgpack.encode("lmc.store"), b"\x81\xabinstance_id" + NESTED],
    [b"\x01", msgspec.msgpack.encode("lmc.ping")],                        # no payload frame
    [b"\x01", msgspec.msgpack.encode("lmc.ping"), b"\x80", b"\x80"],      # an extra frame
    [msgspec.msgpack.encode("uid"), msgspec.msgpack.encode("lmc.ping"), b"\x80"],
    [msgspec.msgpack.encode(1.5), msgspec.msgpack.encode("lmc.ping"), b"\x80"],
])
def test_hostile_frames_are_protocol_errors(frames):
    """Whatever the bytes, decoding raises a ProtocolError, never anything that could escape the
    server loop (RecursionError, OverflowError, ...)."""
    with pytest.raises(ProtocolError):
        decode_request(frames)


@pytest.mark.parametrize(("op", "payload", "where"), [
    ("lmc.lookup", {"model_name": "m", "world_size": 1_500_000, "lookup_id": "l",
                    "chunk_hashes": []}, "world_size"),
    ("lmc.lookup", {"model_name": "m", "world_size": 0, "lookup_id": "l", "chunk_hashes": []},
     "world_size"),
    ("lmc.lookup", {"model_name": "m" * 300, "world_size": 1, "lookup_id": "l",
                    "chunk_hashes": []}, "model_name"),
    ("lmc.register_kv_cache", {**msgspec.to_builtins(SAMPLES[RequestType.REGISTER_KV_CACHE]),
                               "pid": 2**62}, "pid"),
    ("lmc.register_kv_cache", {**msgspec.to_builtins(SAMPLES[RequestType.REGISTER_KV_CACHE]),
                               "kv_rank": -1}, "kv_rank"),
    ("lmc.register_kv_cache", {**msgspec.to_builtins(SAMPLES[RequestType.REGISTER_KV_CACHE]),
                               "layers": []}, "layers"),
    ("lmc.store", {"instance_id": -1, "chunk_hashes": [], "block_ids": []}, "instance_id"),
    ("lmc.store", {"instance_id": 1, "chunk_hashes": [], "block_ids": [2**40]}, "block_ids"),
    ("lmc.store", {"instance_id": 1, "chunk_hashes": [], "block_ids": [0] * (2**20 + 1)},
     "block_ids"),
    ("lmc.retrieve", {"instance_id": 1, "chunk_hashes": [b""], "block_ids": []}, "chunk_hashes"),
    ("lmc.retrieve", {"instance_id": 1, "chunk_hashes": [], "block_ids": [],
                      "deadline_ms": 3_600_001}, "deadline_ms"),
    ("lmc.retrieve", {"instance_id": 1, "chunk_hashes": [], "block_ids": [], "deadline_ms": -1},
     "deadline_ms"),
    ("lmc.list_chunks", {"limit": -1}, "limit"),
    ("lmc.ping", {"instance_id": 2**64 - 1}, "instance_id"),
])
def test_every_wire_integer_and_length_is_bounded(op, payload, where):
    with pytest.raises(ProtocolError, match=where):
        decode_request(_request(op, payload))


REGISTER = msgspec.to_builtins(SAMPLES[RequestType.REGISTER_KV_CACHE])
SLIDING = {"index": 1, "count": 3, "kind": "sliding", "block_size": 16, "window_tokens": 1024}
LOCAL = {"index": 1, "count": 2, "kind": "local", "block_size": 16, "window_tokens": 8192}


def test_a_registration_names_its_kv_cache_group():
    registration = {**REGISTER, "group": SLIDING}
    decoded = decode_request(_request("lmc.register_kv_cache", registration)).payload
    assert decoded.group == m.KVGroup(index=1, count=3, kind="sliding", block_size=16,
                                      window_tokens=1024)
    assert SAMPLES[RequestType.REGISTER_KV_CACHE].group is None  # a single-group model
    local = decode_request(_request("lmc.register_kv_cache", {**REGISTER, "group": LOCAL}))
    assert local.payload.group == m.KVGroup(index=1, count=2, kind="local", block_size=16,
                                            window_tokens=8192)  # Llama 4's attention chunk


@pytest.mark.parametrize(("group", "where"), [
    ({**SLIDING, "index": 3}, "outside its count"),
    ({**SLIDING, "index": 64, "count": 64}, "index"),
    ({**SLIDING, "count": 65}, "count"),
    ({**SLIDING, "window_tokens": 0}, "sliding group .* need a positive window"),
    ({**LOCAL, "window_tokens": 0}, "local group .* need a positive window"),
    ({**LOCAL, "window_tokens": 8200}, "attention chunk of 8200 tokens is no multiple of its "
                                       "block size 16"),
    ({**LOCAL, "window_tokens": 2**24 + 16}, "window_tokens"),
    ({**LOCAL, "kind": "mamba"}, "others none"),
    ({**SLIDING, "kind": "full"}, "others none"),
    ({**SLIDING, "window_tokens": 2**24 + 1}, "window_tokens"),
    ({**SLIDING, "block_size": 32}, "not the registration's 16"),
    ({**SLIDING, "block_size": 0}, "block_size"),
    ({**SLIDING, "kind": "chunked"}, "kind"),
    ({**SLIDING, "extra": 1}, "extra"),
])
def test_a_group_descriptor_is_bounded_and_consistent(group, where):
    with pytest.raises(ProtocolError, match=where):
        decode_request(_request("lmc.register_kv_cache", {**REGISTER, "group": group}))


def test_a_lookup_counts_one_key_per_rank_per_chunk():
    lookup = m.LookupRequest(model_name="m", world_size=8, lookup_id="x",
                             chunk_hashes=[b"h" * 32] * 100)
    frames = encode_request(0, RequestType.LOOKUP, [lookup])
    assert decode_request(frames, Limits(max_keys_per_request=800)).payload == lookup
    with pytest.raises(RequestTooLargeError, match="800 chunk keys"):
        decode_request(frames, Limits(max_keys_per_request=799))


def test_client_input_is_never_echoed_whole():
    """A 4 MiB op name once went whole into the log and the reply (11 s of pings stalled)."""
    from lmcache_core.errors import MAX_MESSAGE_CHARS
    from lmcache_core.protocol.codec import rejection_frames

    huge = [b"\x01", msgspec.msgpack.encode("x" * 4 * 2**20), b"\x80"]
    with pytest.raises(UnknownOperationError) as info:
        decode_request(huge)
    assert len(str(info.value)) < MAX_MESSAGE_CHARS
    reply = rejection_frames(huge, info.value)
    assert sum(map(len, reply)) < 1000 and reply[1] == b"\xc0"  # the op frame is not echoed
    unknown_field = _request("lmc.ping", {"y" * 2**20: 1})
    with pytest.raises(ProtocolError) as info:
        decode_request(unknown_field)
    assert len(error_reply(info.value).message) < 4 * MAX_MESSAGE_CHARS


@pytest.mark.parametrize("uid", [
    msgspec.msgpack.encode(b"u" * 2**20),  # a 1 MiB bin: over MAX_UID_FRAME, refused unread
    msgspec.msgpack.encode("a uid"),  # short, but a str: no uid
    b"\xc1" * 9,  # 9 bytes (a uid's most), no msgpack at all
    b"\x01\x02",  # two msgpack values
    b"",
], ids=["oversized", "str", "not-msgpack", "two-values", "empty"])
def test_an_untrusted_uid_frame_is_answered_with_a_nil_in_its_place(uid: bytes) -> None:
    """The reply to a request whose uid frame is no msgpack int echoes none of that frame, not
    even a cut of it: a nil stands in its place (the op, one short msgpack str, still goes back)."""
    from lmcache_core.protocol.codec import MAX_UID_FRAME, rejection_frames

    frames = [uid, msgspec.msgpack.encode("lmc.ping"), msgspec.msgpack.encode({})]
    with pytest.raises(ProtocolError) as info:
        decode_request(frames)
    reply = rejection_frames(frames, info.value)
    assert reply[0] == msgspec.msgpack.encode(None) and len(reply[0]) <= MAX_UID_FRAME
    assert reply[1] == frames[1]
    assert msgspec.msgpack.decode(reply[2], type=m.ErrorReply).code == "bad_request"
    assert sum(map(len, reply)) < 1000


def test_no_pickle_anywhere():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    for path in [*root.glob("lmcache_core/**/*.py"), *root.glob("lmcache_cli/**/*.py")]:
        text = path.read_text()
        assert "import pickle" not in text and "from pickle" not in text, path


def test_an_older_client_reads_a_late_retrieve_as_missing_chunks():
    """RetrieveReply.late is new: a client decoding the reply without it still finds every
    unloaded chunk (late ones included) in ``missing``, so it never takes a cut load as whole."""

    class OldRetrieveReply(m.Reply, tag="retrievereply"):
        retrieved: int
        missing: list[int] = []

    new = m.RetrieveReply(retrieved=2, missing=[2, 3], late=2)
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldRetrieveReply)
    assert old.missing == [2, 3] and not new.ok


def test_a_retrieve_with_parts_round_trips_counts_every_key_and_is_bounded():
    """``RetrieveRequest.more``: other registrations' chunks in one request. Its keys count
    against the server's limit; more than ``MAX_RETRIEVE_PARTS`` parts, a part with a field
    of its own kind it does not have, or a negative skip are refused at decode."""
    part = m.RetrievePart(instance_id=2, chunk_hashes=[b"b" * 32] * 3, block_ids=[5] * 6,
                          skip_blocks=1)
    request = m.RetrieveRequest(instance_id=1, chunk_hashes=[b"a" * 32], block_ids=[1, 2],
                                lookup_id="r", more=[part])
    frames = encode_request(0, RequestType.RETRIEVE, [request])
    assert decode_request(frames).payload == request
    assert request.num_keys() == 4
    assert [p.instance_id for p in request.parts()] == [1, 2]
    with pytest.raises(RequestTooLargeError, match="at most 3 per request"):
        decode_request(frames, Limits(max_keys_per_request=3))
    # a request without parts encodes as before: an older server reads it
    plain = m.RetrieveRequest(instance_id=1, chunk_hashes=[b"a" * 32], block_ids=[1, 2])
    assert b"more" not in msgspec.msgpack.encode(plain)
    base = {"instance_id": 1, "chunk_hashes": [b"a" * 32], "block_ids": [1, 2]}
    good = {"instance_id": 2, "chunk_hashes": [], "block_ids": []}
    for more in ([good] * (m.MAX_RETRIEVE_PARTS + 1), [{**good, "lookup_id": "x"}],
                 [{**good, "skip_blocks": -1}], [{"instance_id": 2}]):
        with pytest.raises(ProtocolError):
            decode_request(_request("lmc.retrieve", {**base, "more": more}))


def test_an_explain_is_bounded_checks_its_layouts_and_its_reply_round_trips():
    """``lmc.explain``: at most ``MAX_EXPLAIN_PROBES`` probes (at least one), each a chunk hash;
    a layout that is no fingerprint, an unknown field or a bad world size are refused at decode.
    A store's ``hash_mode`` is one of three, and left off the wire when not said."""
    probes = [b"a" * 32] * em.MAX_EXPLAIN_PROBES
    most = em.ExplainRequest(model_name="m", world_size=1, probes=probes, layout="float16:2x4x32")
    assert decode_request(encode_request(0, RequestType.EXPLAIN, [most])).payload == most
    base = {"model_name": "m", "world_size": 1, "probes": [b"a" * 32]}
    for bad in ({"probes": [*probes, b"a" * 32]}, {"probes": []}, {"probes": [b""]},
                {"probes": [b"a" * 65]}, {"layout": "float16:2x4"}, {"hint_layout": "x"},
                {"world_size": 0}, {"chunk_hashes": [b"a" * 32]}):
        with pytest.raises(ProtocolError, match=r"lmc\.explain"):
            decode_request(_request("lmc.explain", {**base, **bad}))
    reply = em.ExplainReply(holders=[em.ProbeHolder(probe=0, model_name="m", layout="l",
                                                    tier="disk", heads=[(0, 2)])],
                            pieces=3, hash_modes={"vllm": 2}, remote="cut", cut=True,
                            registered=[em.RegisteredShape(layout="l", world_size=2, workers=2)],
                            tenants=[em.TenantPieces(tenant="ab", pieces=3)])
    frames = encode_reply(b"\x01", b"\x00", reply)
    assert decode_reply(RequestType.EXPLAIN, frames[2:]) == reply
    store = {"instance_id": 1, "chunk_hashes": [], "block_ids": []}
    assert b"hash_mode" not in msgspec.msgpack.encode(m.StoreRequest(**store))  # type: ignore[arg-type]
    assert decode_request(_request("lmc.store", {**store, "hash_mode": "vllm"})).payload == \
        m.StoreRequest(**store, hash_mode="vllm")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        decode_request(_request("lmc.store", {**store, "hash_mode": "blocks"}))
