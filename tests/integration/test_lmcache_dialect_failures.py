"""LMCache 0.5.6's wire on a real in-process server: what a client can make go wrong costs a few
log lines, never one per request."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest

from tests.integration.test_lmcache_dialect_waits import (  # noqa: F401 (fixtures)
    call,
    dealer,
    key,
    kv_server,
    short_tmp,
)

enc = msgspec.msgpack.encode
DIALECT_LOGGER = "lmcache_core.server.lmcache_dialect"


def _dialect_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == DIALECT_LOGGER]


def test_bad_hnd_registers_are_bad_frames_and_cost_few_lines(kv_server,  # noqa: F811
                                                             caplog) -> None:
    srv, _, _ = kv_server
    caplog.set_level(logging.INFO, logger=DIALECT_LOGGER)
    layer = msgspec.msgpack.Ext(1, enc({"type": "cpu_shm", "version": 1, "metadata": {
        "dtype": "float16", "shape": [2, 4, 16, 64], "stride": [1, 1, 1], "storage_offset": 0,
        "device_uuid": "cpu"}, "shm_name": "/lmcache_kv_1_0", "nbytes": 100}))
    sock = dealer(srv.url)
    try:
        for uid in range(60):
            sock.send_multipart([enc(uid), enc(1), enc(7), enc([layer]), enc("tiny"), enc(1),
                                 enc("vllm"), enc({"kv_layout": "HND"}), enc([])])
        assert not sock.poll(300)  # silence, as for any bad frame
        assert call(sock, [enc(99), enc(24)]) == [enc(99), enc(24), enc("OK")]
    finally:
        sock.close(0)
    records = _dialect_records(caplog)
    assert records and not any(r.exc_info for r in records)  # refused, not failed
    assert len(records) <= 20


def test_unexpected_failures_are_logged_rationed(kv_server, caplog,  # noqa: F811
                                                 monkeypatch) -> None:
    srv, _, _ = kv_server
    caplog.set_level(logging.INFO, logger=DIALECT_LOGGER)

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("a bug any client can reach")

    monkeypatch.setattr(srv.transport.dialect, "_op_noop", broken)
    sock = dealer(srv.url)
    try:
        for uid in range(60):
            sock.send_multipart([enc(uid), enc(24)])
        assert not sock.poll(300)
        assert call(sock, [enc(99), enc(21)]) == [enc(99), enc(21), enc(64)]  # still serving
    finally:
        sock.close(0)
    failed = [r for r in _dialect_records(caplog) if r.exc_info]
    assert 1 <= len(failed) <= 20  # with their traceback, but not one per request


def test_keys_over_the_request_limit_are_refused_before_hashing(kv_server,  # noqa: F811
                                                               monkeypatch) -> None:
    """TINY allows 1000 keys (chunks) per request: a key whose tokens up to ``end`` make more is
    refused unhashed (a lookup with silence, a store or retrieve in-band), not chain-hashed
    on the loop thread (a 4 MiB frame of token ids took ~0.2 s there, stalling every client)."""
    from lmcache_core.protocol import lmcache_wire

    srv, _, descs = kv_server
    hashed: list[int] = []
    chain = lmcache_wire.chain_hashes

    def counted(tokens: Any, *args: Any) -> list[bytes]:
        hashed.append(len(tokens))
        return chain(tokens, *args)

    monkeypatch.setattr(lmcache_wire, "chain_hashes", counted)
    over = {"token_ids": list(range(1001 * 64)), "end": 1001 * 64}
    sock = dealer(srv.url)
    try:
        assert call(sock, [enc(1), enc(1), enc(7), enc(descs), enc("tiny"), enc(1), enc("vllm"),
                           enc({}), enc([])]) == [enc(1), enc(1)]
        assert call(sock, [enc(2), enc(8), enc({**key("big"), **over}), enc(1)],
                    timeout_ms=500) is None
        assert call(sock, [enc(3), enc(9), enc("big")]) == [enc(3), enc(9), enc(0)]
        stored = {**key("s", worker_id=0), **over}
        assert call(sock, [enc(4), enc(6), enc(stored), enc(7), enc([list(range(8))]),
                           enc(b"")]) == [enc(4), enc(6), enc([b"", False])]
        assert call(sock, [enc(5), enc(7), enc(stored), enc(7), enc([list(range(8))]), enc(b""),
                           enc(0)]) == [enc(5), enc(7), enc([b"", False])]
        assert call(sock, [enc(6), enc(12), enc({**key("big"), **over}), enc(1)],
                    timeout_ms=500) is None  # free_lookup_locks hashes its key too
        assert hashed == []
        # At the limit: served.
        at = {"token_ids": list(range(1000 * 64)), "end": 1000 * 64}
        assert call(sock, [enc(7), enc(8), enc({**key("ok"), **at}), enc(1)]) == [enc(7), enc(8)]
        assert hashed == [1000 * 64]
    finally:
        sock.close(0)


def test_a_long_prompts_lookup_is_decoded_and_hashed_off_the_loop_thread(kv_server,  # noqa: F811
                                                                         monkeypatch) -> None:
    """A lookup frame of ~100k token ids (~40 ms per MiB to decode and hash) runs on a worker
    thread, so it stalls no other client; its ack comes once its result is in. A short one
    stays inline (a hand-off would cost more than it saves)."""
    import threading

    from lmcache_core.protocol import lmcache_wire
    from lmcache_core.server.lmcache_dialect import INLINE_LOOKUP_BYTES

    srv, _, _ = kv_server
    threads: list[str] = []
    chain = lmcache_wire.chain_hashes

    def where(tokens: Any, *args: Any) -> list[bytes]:
        threads.append(threading.current_thread().name)
        return chain(tokens, *args)

    monkeypatch.setattr(lmcache_wire, "chain_hashes", where)
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
