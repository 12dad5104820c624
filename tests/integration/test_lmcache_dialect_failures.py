"""LMCache 0.5.6's wire on a real in-process server: every request is answered at once (a bad or
unserved one with what LMCache's client takes as a failure), except a stream's credit, to which
its protocol defines no reply; what a client can make go wrong costs a few log lines, never one
per request."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest

from lmcache_core.transport.routes import Route
from tests.integration.dialect import call, dealer, enc, key

#: Where LMCache's requests are logged: the pipeline's error boundary, and its front end.
DIALECT_LOGGERS = ("lmcache_core.transport.server", "lmcache_core.server.lmcache.front")


def set_levels(caplog: pytest.LogCaptureFixture) -> None:
    for name in DIALECT_LOGGERS:
        caplog.set_level(logging.INFO, logger=name)


def failure(reply: list[bytes]) -> bool:
    """Whether ``reply`` is a failure LMCache's client raises: ``[uid, op]`` naming another op,
    ours (its ``process_inbound``: ``ValueError("Response operation ... does not match")``)."""
    from lmcache_core.protocol import lmcache_wire as w

    return len(reply) == 2 and w.is_failure_op(reply[1])


def _dialect_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name in DIALECT_LOGGERS]


def test_bad_hnd_registers_are_bad_frames_and_cost_few_lines(kv_server, caplog) -> None:
    srv, _, _ = kv_server
    set_levels(caplog)
    layer = msgspec.msgpack.Ext(1, enc({"type": "cpu_shm", "version": 1, "metadata": {
        "dtype": "float16", "shape": [2, 4, 16, 64], "stride": [1, 1, 1], "storage_offset": 0,
        "device_uuid": "cpu"}, "shm_name": "/lmcache_kv_1_0", "nbytes": 100}))
    sock = dealer(srv.url)
    try:
        for uid in range(60):
            sock.send_multipart([enc(uid), enc(1), enc(7), enc([layer]), enc("tiny"), enc(1),
                                 enc("vllm"), enc({"kv_layout": "HND"}), enc([])])
        uids = []
        for _ in range(60):  # each answered as a failure (its client raises at once), in any
            assert sock.poll(5000)  # order: registrations are served on the copy threads
            reply = sock.recv_multipart()
            assert failure(reply), reply
            uids.append(msgspec.msgpack.decode(reply[0]))
        assert sorted(uids) == list(range(60))
        assert call(sock, [enc(99), enc(24)]) == [enc(99), enc(24), enc("OK")]
    finally:
        sock.close(0)
    records = _dialect_records(caplog)
    assert records and not any(r.exc_info for r in records)  # refused, not failed
    assert len(records) <= 20


def test_unexpected_failures_are_logged_rationed(kv_server, caplog, monkeypatch) -> None:
    srv, _, _ = kv_server
    set_levels(caplog)

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("a bug any client can reach")

    monkeypatch.setitem(srv.transport.routes, "noop", Route(broken))
    sock = dealer(srv.url)
    try:
        for uid in range(60):
            sock.send_multipart([enc(uid), enc(24)])
        for uid in range(60):
            assert sock.poll(5000)
            reply = sock.recv_multipart()
            assert reply[0] == enc(uid) and failure(reply), reply
            assert "RuntimeError" in msgspec.msgpack.decode(reply[1])
        assert call(sock, [enc(99), enc(21)]) == [enc(99), enc(21), enc(64)]  # still serving
    finally:
        sock.close(0)
    failed = [r for r in _dialect_records(caplog) if r.exc_info]
    assert 1 <= len(failed) <= 20  # with their traceback, but not one per request


def test_keys_over_the_request_limit_are_refused_before_hashing(kv_server, monkeypatch) -> None:
    """TINY allows 1000 keys (chunks) per request: a key whose tokens up to ``end`` make more is
    refused unhashed (a lookup acknowledged with 0 hits, a store or retrieve in-band, any other
    op as a failure), not chain-hashed
    on the loop thread (a 4 MiB frame of token ids took ~0.2 s there, stalling every client)."""
    from lmcache_core.server.lmcache import translate

    srv, _, descs = kv_server
    hashed: list[int] = []
    chain = translate.chain_hashes

    def counted(tokens: Any, *args: Any) -> list[bytes]:
        hashed.append(len(tokens))
        return chain(tokens, *args)

    monkeypatch.setattr(translate, "chain_hashes", counted)
    over = {"token_ids": list(range(1001 * 64)), "end": 1001 * 64}
    sock = dealer(srv.url)
    try:
        assert call(sock, [enc(1), enc(1), enc(7), enc(descs), enc("tiny"), enc(1), enc("vllm"),
                           enc({}), enc([])]) == [enc(1), enc(1)]
        assert call(sock, [enc(2), enc(8), enc({**key("big"), **over}), enc(1)]) == \
            [enc(2), enc(8)]
        assert call(sock, [enc(3), enc(9), enc("big")]) == [enc(3), enc(9), enc(0)]
        stored = {**key("s", worker_id=0), **over}
        assert call(sock, [enc(4), enc(6), enc(stored), enc(7), enc([list(range(8))]),
                           enc(b"")]) == [enc(4), enc(6), enc([b"", False])]
        assert call(sock, [enc(5), enc(7), enc(stored), enc(7), enc([list(range(8))]), enc(b""),
                           enc(0)]) == [enc(5), enc(7), enc([b"", False])]
        reply = call(sock, [enc(6), enc(12), enc({**key("big"), **over}), enc(1)])
        assert reply is not None and failure(reply)  # free_lookup_locks hashes its key too
        assert hashed == []
        # At the limit: served.
        at = {"token_ids": list(range(1000 * 64)), "end": 1000 * 64}
        assert call(sock, [enc(7), enc(8), enc({**key("ok"), **at}), enc(1)]) == [enc(7), enc(8)]
        assert hashed == [1000 * 64]
    finally:
        sock.close(0)


def test_a_long_prompts_lookup_is_decoded_and_hashed_off_the_loop_thread(kv_server, monkeypatch) -> None:
    """A lookup frame of ~100k token ids (~40 ms per MiB to decode and hash) runs on a worker
    thread, so it stalls no other client; its ack comes once its result is in. A short one
    stays inline (a hand-off would cost more than it saves)."""
    import threading

    from lmcache_core.server.lmcache import translate
    from lmcache_core.server.lmcache.front import INLINE_LOOKUP_BYTES

    srv, _, _ = kv_server
    threads: list[str] = []
    chain = translate.chain_hashes

    def where(tokens: Any, *args: Any) -> list[bytes]:
        threads.append(threading.current_thread().name)
        return chain(tokens, *args)

    monkeypatch.setattr(translate, "chain_hashes", where)
    long_key = {**key("long", end=640), "token_ids": list(range(100_000))}
    assert len(enc(long_key)) > INLINE_LOOKUP_BYTES
    sock = dealer(srv.url)
    try:
        assert call(sock, [enc(1), enc(8), enc(long_key), enc(1)]) == [enc(1), enc(8)]
        assert call(sock, [enc(2), enc(9), enc("long")]) == [enc(2), enc(9), enc(0)]
        assert call(sock, [enc(3), enc(8), enc(key("short")), enc(1)]) == [enc(3), enc(8)]
        assert call(sock, [enc(4), enc(9), enc("short")]) == [enc(4), enc(9), enc(0)]
    finally:
        sock.close(0)
    assert len(threads) == 2 and "worker" in threads[0] and threads[1].endswith("-loop"), threads


ENGINE_DRIVEN = [(14, [{"instance_id": 7}]), (15, [7]), (16, [key("e", worker_id=0), 7]),
                 (17, [key("e", worker_id=0), 7, b""]), (18, [key("e", worker_id=0), 7]),
                 (19, [key("e", worker_id=0), 7]),
                 ("register_kv_cache_engine_driven_context", [{"instance_id": 7}])]


@pytest.mark.parametrize(("op", "payloads"), ENGINE_DRIVEN, ids=[str(o) for o, _ in ENGINE_DRIVEN])
def test_engine_driven_ops_fail_at_once_naming_the_variable(kv_server, caplog,
                                                            op: Any, payloads: list[Any]) -> None:
    """LMCache's engine-driven path is not served: each of its ops is answered at once with a
    failure its client raises, naming what to set; the server logs it once per client."""
    srv, _, _ = kv_server
    set_levels(caplog)
    sock = dealer(srv.url)
    try:
        for uid in (1, 2):
            reply = call(sock, [enc(uid), enc(op), *map(enc, payloads)])
            assert reply is not None and reply[0] == enc(uid) and failure(reply), reply
            assert "LMCACHE_MP_TRANSFER_MODE=lmcache_driven" in msgspec.msgpack.decode(reply[1])
    finally:
        sock.close(0)
    told = [r for r in _dialect_records(caplog) if "LMCACHE_MP_TRANSFER_MODE=lmcache_driven"
            in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(told) == 1  # one warning per client (beside the rationed INFO of each refusal)


#: (frames after the uid, what answers them): every LMCache op and name this server does not
#: serve, and malformed requests of served ones, each with LMCache's own failure of that op.
UNANSWERABLE = [
    ([enc(11), enc("r")], "failure"),  # the retired legacy id
    ([enc(29), enc([]), enc({})], "failure"),  # p2p_lookup_and_lock
    ([enc(3), enc(7), enc([]), enc("m"), enc(1), enc("vllm"), enc({}), enc([])], "failure"),
    ([enc(25), enc(1)], "failure"),  # cb_register_rope
    ([enc("subscribe_kv_events"), enc(7), enc("m"), enc(0), enc(16)], "failure"),
    ([enc("server_module_call"), enc({"method": "x", "payload": b""})], "failure"),
    ([enc(22)], "failure"),  # ping without its payload
    ([enc(24), enc(1)], "failure"),  # noop with one
    ([enc(1), enc(7), b"\xc1", enc("m"), enc(1), enc("vllm"), enc({}), enc([])], "failure"),
    ([enc(13), enc(5)], "failure"),  # end_session of an int
    ([enc(8), enc({"model_name": "tiny"}), enc(1)], "ack"),  # lookup: its status is then 0
    ([enc(8), enc(key("z", num_kv_readers=0)), enc(1)], "ack"),
    ([enc(9), enc(5)], "zero"),  # query_prefetch_status
    ([enc(10), enc("r"), enc(-1.0)], "zero"),
    ([enc(6), enc(key("s", worker_id=0)), enc(7), enc("blocks"), enc(b"")], "not ok"),
    ([enc(7), enc(key("s", worker_id=0)), enc(7), enc([[0]]), enc(b"")], "not ok"),
]


@pytest.mark.parametrize(("frames", "answer"), UNANSWERABLE,
                         ids=[f"{i}-{a}" for i, (_, a) in enumerate(UNANSWERABLE)])
def test_every_lmcache_request_is_answered_at_once(kv_server, frames: list[bytes], answer: str) -> None:
    srv, _, _ = kv_server
    sock = dealer(srv.url)
    try:
        reply = call(sock, [enc(5), *frames])
        assert reply is not None, "no reply"
        assert reply[0] == enc(5)
        expected = {"ack": [enc(5), frames[0]], "zero": [enc(5), frames[0], enc(0)],
                    "not ok": [enc(5), frames[0], enc([b"", False])]}
        assert failure(reply) if answer == "failure" else reply == expected[answer], reply
        if frames[0] == enc(8) and answer == "ack":
            assert call(sock, [enc(6), enc(9), enc("z")]) == [enc(6), enc(9), enc(0)]
    finally:
        sock.close(0)


def test_a_streams_credit_is_not_answered(kv_server) -> None:
    """``[uid, b"", b"ack" | b"cancel"]``: the one frame LMCache's protocol defines no reply to
    (no stream is served: get_experimental offers none). An empty op frame with anything else
    is no LMCache frame: our typed error answers it."""
    srv, _, _ = kv_server
    sock = dealer(srv.url)
    try:
        sock.send_multipart([enc(1), b"", b"ack"])
        sock.send_multipart([enc(2), b"", b"cancel"])
        assert call(sock, [enc(3), enc(24)]) == [enc(3), enc(24), enc("OK")]
        assert not sock.poll(100)
        reply = call(sock, [enc(4), b"", b"more"])
        assert reply is not None and reply[:2] == [enc(4), enc(None)] and b"errorreply" in reply[2]
    finally:
        sock.close(0)


def test_a_cuda_registration_reaches_the_cuda_path_and_fails_at_once_without_cuda(
        kv_server) -> None:
    """LMCache's ``cuda`` descriptors go our CUDA path (its handle checks first): on a host
    without CUDA the register fails at once saying so (it was "unsupported KV descriptor")."""
    import os
    import secrets

    from lmcache_core.kv.cuda_ipc import REF_COUNTERS_PER_FILE

    srv, _, _ = kv_server
    name = f"/torch_{os.getpid()}_{secrets.randbelow(10**9)}_0"
    with open(f"/dev/shm{name}", "wb") as f:
        f.truncate(8 * REF_COUNTERS_PER_FILE + 64)
    shape, stride = [2, 32, 16, 4, 32], [32 * 16 * 4 * 32, 16 * 4 * 32, 4 * 32, 32, 1]
    layer = msgspec.msgpack.Ext(1, enc({
        "type": "cuda", "version": 1,
        "handle": [0, b"h" * 64, 1 << 20, 0, name.encode(), 3, b"e" * 64, True],
        "metadata": {"dtype": "float16", "shape": shape, "stride": stride, "storage_offset": 0,
                     "device_uuid": "GPU-8f7c1a2e-0000-4000-8000-000000000001"}}))
    sock = dealer(srv.url)
    try:
        reply = call(sock, [enc(1), enc(1), enc(7), enc([layer]), enc("tiny"), enc(1),
                            enc("vllm"), enc({}), enc([])])
        assert reply is not None and failure(reply), reply
        assert "needs CUDA" in msgspec.msgpack.decode(reply[1]), reply
    finally:
        sock.close(0)
        os.unlink(f"/dev/shm{name}")
