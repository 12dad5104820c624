"""The LMCache 0.5.6 dialect's wire (lmcache_core.protocol.lmcache_wire) and its translation into
our requests (lmcache_core.server.lmcache.translate): no sockets."""

from __future__ import annotations

import msgspec
import pytest

from lmcache_core.errors import IncompatibleError
from lmcache_core.keys import chain_hashes
from lmcache_core.kv.layout import detect_layout
from lmcache_core.kv.shm import check_segment_name, parse_lmcache_segment_name
from lmcache_core.protocol import lmcache_wire as w
from lmcache_core.server.lmcache import translate as t

enc = msgspec.msgpack.encode
C = 64
TOKENS = tuple(range(3 * C + 5))


def key(**kw: object) -> dict:
    base = {"model_name": "tiny", "world_size": 1, "worker_id": 0, "token_ids": list(TOKENS),
            "start": 0, "end": 3 * C, "request_id": "r1", "cache_salt": "",
            "request_configs": None, "num_kv_readers": 1}
    return {**base, **kw}


def shm_layer(name: str = "/lmcache_kv_123_0") -> msgspec.msgpack.Ext:
    data = enc({"type": "cpu_shm", "version": 1, "shm_name": name, "nbytes": 4096,
                "metadata": {"dtype": "float16", "shape": [2, 4, 16, 1, 8],
                             "stride": [512, 128, 8, 8, 1], "storage_offset": 0,
                             "device_uuid": "cpu"}})
    return msgspec.msgpack.Ext(1, data)


@pytest.mark.parametrize(("frame", "op"), [
    (enc(24), "noop"), (enc(21), "get_chunk_size"), (enc("noop"), "noop"),
    (enc(11), "legacy_11"), (enc("subscribe_kv_events"), "subscribe_kv_events"),
    (enc(0), None), (enc(34), None), (enc(True), None), (enc("lmc.ping"), None),
    (enc("nope"), None), (b"\xc1", None), (b"", None), (enc("x" * 100), None),
])
def test_dialect_op_claims_only_lmcache_ops(frame: bytes, op: str | None) -> None:
    assert w.dialect_op(frame) == op


def test_decode_call_types_every_payload() -> None:
    call = w.decode_call([enc(5), enc(8), enc(key(worker_id=None)), enc(1)], "lookup")
    assert call.uid_frame == enc(5) and call.op == "lookup"
    k, tp = call.args
    assert isinstance(k, w.IPCCacheServerKey) and k.worker_id is None and tp == 1
    call = w.decode_call([enc(1), enc(1), enc(7), enc([shm_layer()]), enc("tiny"), enc(1),
                          enc("vllm"), enc({"kv_layout": "NHD"}), enc([])], "register_kv_cache")
    layer = call.args[1][0]
    desc = t.tensor_descriptor(layer)
    assert desc.kind == "shm" and desc.shm_name == "lmcache_kv_123_0" and desc.segment_nbytes == 4096


@pytest.mark.parametrize("frames", [
    [enc(1), enc(8), enc(key()), enc(1), enc(2)],          # one payload too many
    [enc(1), enc(8), enc(key())],                          # one too few
    [enc("uid"), enc(8), enc(key()), enc(1)],              # uid not an int
    [enc(1), enc(8), enc(key(world_size=0)), enc(1)],      # out of bounds
    [enc(1), enc(8), enc(key(token_ids=[-1])), enc(1)],    # not a uint32 token
    [enc(1), enc(8), b"\xc1", enc(1)],                     # not msgpack
    [enc(1), enc(8), enc([[[[[]]]]] * 3), enc(1)],         # wrong shape
])
def test_malformed_frames_raise_dialect_error(frames: list[bytes]) -> None:
    with pytest.raises(w.DialectError):
        w.decode_call(frames, "lookup")


def test_unserved_ops_and_other_descriptors_raise_dialect_error() -> None:
    with pytest.raises(w.DialectError):
        w.decode_call([enc(1), enc(29), enc([]), enc({})], "p2p_lookup_and_lock")
    cuda = msgspec.msgpack.Ext(1, enc({"type": "cuda", "version": 1, "handle": [0] * 8,
                                       "metadata": {}}))
    with pytest.raises(w.DialectError):
        w.decode_call([enc(1), enc(1), enc(7), enc([cuda]), enc("m"), enc(1), enc("vllm"),
                       enc({}), enc([])], "register_kv_cache")


def test_replies_echo_uid_and_op_and_omit_none() -> None:
    call = w.Call(enc(3), enc("noop"), "noop", ())
    assert w.reply_frames(call, None) == [enc(3), enc("noop")]
    assert w.reply_frames(call, (b"", True)) == [enc(3), enc("noop"), enc([b"", True])]


def test_keys_become_our_chain_hashes_and_ranges() -> None:
    k = msgspec.convert(key(start=C, end=3 * C), w.IPCCacheServerKey)
    full = chain_hashes(TOKENS, C)
    assert len(full) == 3  # the partial tail is ignored, as in LMCache
    req = t.store_request(k, 9, [list(range(12))], C, 4)
    assert req.chunk_hashes == full[1:3] and req.block_ids == list(range(8))
    look = t.lookup_request(msgspec.structs.replace(k, worker_id=None), C)
    assert look.chunk_hashes == full and look.lookup_id == "r1"  # a lookup ignores start
    ret, left_out = t.retrieve_request(k, 9, [list(range(8))], C, 4)
    assert ret.lookup_id == "r1" and ret.chunk_hashes == full[1:3] and left_out == []
    skipped, left_out = t.retrieve_request(k, 9, [list(range(8))], C, 4, skip_tokens=C + 5)
    assert skipped.chunk_hashes == full[2:3] and skipped.block_ids == [4, 5, 6, 7]
    assert left_out == full[1:2]
    with pytest.raises(ValueError, match="too few"):
        t.store_request(k, 9, [list(range(7))], C, 4)
    with pytest.raises(w.DialectError):
        t.check_range(msgspec.structs.replace(k, end=C + 1), C)
    with pytest.raises(w.DialectError):
        t.lookup_request(msgspec.structs.replace(k, num_kv_readers=0), C)


def test_lmcache_segment_names_are_admitted_for_their_pid_only() -> None:
    assert parse_lmcache_segment_name("lmcache_kv_123_0") == 123
    for bad in ("lmcache_kv_0_1", "lmcache_kv_123", "lmcache_kv_123_0x", "other_123_0",
                "lmcache_kv_99999999_0", "../lmcache_kv_1_1"):
        assert parse_lmcache_segment_name(bad) is None
    check_segment_name("lmcache_kv_123_0", 123)
    with pytest.raises(IncompatibleError):
        check_segment_name("lmcache_kv_123_0", 124)


def test_hnd_tensors_are_viewed_as_our_connector_registers_them() -> None:
    desc = t.tensor_descriptor(msgspec.convert(msgspec.msgpack.decode(shm_layer().data),
                                               w.CpuShmIPCData))
    hnd = msgspec.structs.replace(desc, shape=[2, 4, 1, 16, 8], stride=[512, 128, 128, 8, 1])
    nhd = t.view_hnd(hnd)
    assert nhd.shape == [2, 4, 16, 1, 8] and nhd.stride == [512, 128, 8, 128, 1]
    cpu = msgspec.structs.replace(desc, shape=[4, 1, 16, 16], stride=[256, 256, 16, 1])
    assert t.view_hnd(cpu) == cpu  # vLLM's CPU backend: as it is, our cpu_attn layout
    assert detect_layout(cpu.shape) == "cpu_attn"
    with pytest.raises(w.DialectError):
        t.view_hnd(msgspec.structs.replace(desc, shape=[4, 16, 8], stride=[128, 8, 1]))
    with pytest.raises(w.DialectError, match="contiguous"):  # heads not back to back in a block
        t.view_hnd(msgspec.structs.replace(cpu, shape=[4, 2, 16, 16], stride=[1024, 16, 32, 1]))


def test_a_cache_salt_seeds_the_chain_as_in_our_token_mode() -> None:
    from lmcache_core.keys import salt_prefix

    k = msgspec.convert(key(cache_salt="tenant-a"), w.IPCCacheServerKey)
    salted = t.key_hashes(k, C)
    assert salted == chain_hashes(TOKENS, C, salt_prefix("tenant-a"))
    assert salted != chain_hashes(TOKENS, C)
    assert t.key_hashes(msgspec.structs.replace(k, cache_salt=""), C) == chain_hashes(TOKENS, C)


def test_a_salted_store_is_for_its_tenant() -> None:
    from lmcache_core.keys import tenant_tag

    k = msgspec.convert(key(cache_salt="tenant-a"), w.IPCCacheServerKey)
    req = t.store_request(k, 9, [list(range(12))], C, 4)
    assert req.tenant == tenant_tag("tenant-a") and req.tenant != ""
    unsalted = t.store_request(msgspec.structs.replace(k, cache_salt=""), 9, [list(range(12))], C, 4)
    assert unsalted.tenant == ""
    msgspec.convert(msgspec.to_builtins(req), type(req))  # within the field's bounds


def test_a_stride_not_pairing_the_shape_is_a_bad_frame() -> None:
    """A 4-D HND shape with a 3-element stride made ``hnd_as_nhd`` (now ``view_hnd``) fail to
    unpack (a ValueError logged with its traceback per request); it is a malformed frame, refused
    as it is decoded."""
    data = msgspec.msgpack.decode(shm_layer().data)
    data["metadata"].update(shape=[2, 4, 16, 64], stride=[1, 1, 1])
    bad = msgspec.msgpack.Ext(1, enc(data))
    with pytest.raises(w.DialectError, match="3-element stride"):
        w.decode_call([enc(1), enc(1), enc(7), enc([bad]), enc("m"), enc(1), enc("vllm"),
                       enc({"kv_layout": "HND"}), enc([])], "register_kv_cache")


def test_plausible_uid_takes_msgpack_ints_only() -> None:
    import msgspec

    from lmcache_core.protocol.lmcache_wire import plausible_uid

    for good in (0, 7, 2**63 - 1, -5):
        assert plausible_uid(msgspec.msgpack.encode(good))
    for bad in (msgspec.msgpack.encode(True), msgspec.msgpack.encode("7"), b"\xc1", b"x" * 300_000,
                b""):
        assert not plausible_uid(bad)
