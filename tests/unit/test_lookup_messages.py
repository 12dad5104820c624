"""The async lookup's message codec and its typed config/metadata."""

from __future__ import annotations

import os
import stat

import msgspec
import pytest

from lmcache_core.config import LMCacheConfig
from lmcache_core.errors import ConfigError, ProtocolError
from lmcache_core.lookup_client import LMCacheEngineConfig, LMCacheMetadata
from lmcache_core.lookup_client.config import MAX_IPC_PATH, ensure_private_dir
from lmcache_core.lookup_client.messages import (
    LookupCleanupMsg,
    LookupRequestMsg,
    LookupResponseMsg,
    decode_response,
    decode_worker_msg,
    encode,
)

H = [bytes([i]) * 32 for i in range(3)]
R = "e.lookup-sched.1-0.sock"


def test_each_side_decodes_its_own_messages_round_trip():
    request = LookupRequestMsg(lookup_id="r", seq=7, reply_to=R, hashes=H, offsets=[16, 32, 48],
                               request_configs={"tag": "x", "n": [1, 2]})
    cleanup = LookupCleanupMsg(lookup_id="r", seq=7)
    response = LookupResponseMsg(lookup_id="r", seq=7, worker_id=1, num_hit_tokens=48)
    assert decode_worker_msg(encode(request)) == request
    assert decode_worker_msg(memoryview(encode(cleanup))) == cleanup
    assert decode_response(encode(response)) == response
    # Tagged, compact arrays: the tag comes first, no field names on the wire.
    assert msgspec.msgpack.decode(encode(cleanup)) == ["lookup.cleanup", "r", 7]
    bare = decode_worker_msg(encode(LookupRequestMsg(lookup_id="r", seq=0, reply_to=R, hashes=[],
                                                     offsets=[])))
    assert isinstance(bare, LookupRequestMsg) and bare.request_configs is None


@pytest.mark.parametrize("buf", [
    b"", b"\xc1", b"garbage", msgspec.msgpack.encode(None), msgspec.msgpack.encode({"type": "x"}),
    msgspec.msgpack.encode(["lookup.nope", "r", 1]),
    msgspec.msgpack.encode(["lookup.cleanup", "r"]),  # a field short
    msgspec.msgpack.encode(["lookup.cleanup", "r", -1]),  # negative seq
    msgspec.msgpack.encode(["lookup.cleanup", 5, 1]),  # wrong type
    msgspec.msgpack.encode(["lookup.request", "r", 1, "c.sock", [b"x"], [1, 2]]),  # 2 offsets
    msgspec.msgpack.encode(["lookup.request", "r", 1, "c.sock", [b"x" * 65], [1]]),  # long hash
    msgspec.msgpack.encode(["lookup.request", "r", 1, "c.sock", [b"x"], [-1]]),
    msgspec.msgpack.encode(["lookup.request", "r", 1, "../c.sock", [], []]),  # outside the dir
    msgspec.msgpack.encode(["lookup.request", "r", 1, "/tmp/c.sock", [], []]),
    msgspec.msgpack.encode(["lookup.request", "r", 1, "c.txt", [], []]),
])
def test_the_worker_side_refuses_anything_else_with_a_protocol_error(buf):
    with pytest.raises(ProtocolError):
        decode_worker_msg(buf)


def test_each_side_refuses_the_other_sides_messages():
    with pytest.raises(ProtocolError, match="bad lookup message"):
        decode_worker_msg(encode(LookupResponseMsg(lookup_id="r", seq=1, worker_id=0,
                                                   num_hit_tokens=0)))
    for msg in (LookupCleanupMsg(lookup_id="r", seq=1),
                LookupRequestMsg(lookup_id="r", seq=1, reply_to=R, hashes=[], offsets=[])):
        with pytest.raises(ProtocolError, match="bad lookup response"):
            decode_response(encode(msg))
    with pytest.raises(ProtocolError):
        decode_response(msgspec.msgpack.encode(["lookup.response", "r", 1, 0, -5]))


def test_metadata_picks_the_lookup_server_workers():
    assert LMCacheMetadata(model_name="m", world_size=4).server_worker_ids == (0, 1, 2, 3)
    mla = LMCacheMetadata(model_name="m", world_size=4, worker_id=1, use_mla=True)
    assert mla.server_worker_ids == (0,) and not mla.runs_lookup_server
    chosen = LMCacheMetadata(model_name="m", world_size=8, worker_id=3, use_mla=True,
                             lookup_server_worker_ids=(6, 3, 0))
    assert chosen.server_worker_ids == (0, 3, 6) and chosen.runs_lookup_server


@pytest.mark.parametrize("fields", [
    {"model_name": ""}, {"world_size": 0}, {"world_size": 2, "worker_id": 2},
    {"worker_id": -1}, {"engine_id": "a/b"}, {"engine_id": ""},
    {"lookup_server_worker_ids": ()}, {"world_size": 2, "lookup_server_worker_ids": (0, 2)},
    {"world_size": 2, "lookup_server_worker_ids": (1, 1)},
])
def test_metadata_refuses_bad_fields(fields):
    with pytest.raises(ConfigError):
        LMCacheMetadata(**{"model_name": "m", **fields})


def test_engine_config_and_from_the_toolkit_config():
    with pytest.raises(ConfigError):
        LMCacheEngineConfig(chunk_size=0)
    with pytest.raises(ConfigError):
        LMCacheEngineConfig(lookup_timeout_ms=0)
    base = msgspec.convert({"chunk_size": 64, "world_size": 2, "timeouts": {"lookup_ms": 300},
                            "model": {"name": "x", "use_mla": True}}, LMCacheConfig)
    config = LMCacheEngineConfig.from_config(base, note=1)
    assert (config.chunk_size, config.lookup_timeout_ms, config.extra_config) == (64, 300, {"note": 1})
    meta = LMCacheMetadata.from_config(base, worker_id=1, engine_id="e")
    assert (meta.model_name, meta.world_size, meta.worker_id, meta.use_mla) == ("x", 2, 1, True)
    with pytest.raises(ConfigError):
        LMCacheMetadata.from_config(base, nonsense=1)


def test_socket_paths_live_in_a_private_runtime_dir(tmp_path, monkeypatch):
    meta = LMCacheMetadata(model_name="m", world_size=2, engine_id="e1", runtime_dir=str(tmp_path))
    assert meta.scheduler_socket("7-1") == tmp_path / "e1.lookup-sched.7-1.sock"
    assert meta.worker_socket(1) == tmp_path / "e1.lookup-w1.sock"
    deep = tmp_path / ("d" * (MAX_IPC_PATH - len(str(tmp_path))))
    with pytest.raises(ConfigError, match="longer than"):
        LMCacheMetadata(model_name="m", runtime_dir=str(deep)).scheduler_socket("1")

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert LMCacheMetadata(model_name="m").runtime_path() == tmp_path / "lmcache"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert LMCacheMetadata(model_name="m").runtime_path().name == f"lmcache-{os.getuid()}"

    made = ensure_private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    assert stat.S_IMODE(os.stat(ensure_private_dir(loose)).st_mode) == 0o700
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="file"):
        ensure_private_dir(tmp_path / "file")
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(ConfigError, match="symlink"):
        ensure_private_dir(tmp_path / "link")
