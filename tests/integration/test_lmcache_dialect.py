"""LMCache 0.5.6's wire on a real ``lmcache serve``, from a raw DEALER (no lmcache package needed):
its replies, its failures at once for bad frames (where LMCache's server is silent), and our own
ops beside it on the same socket."""

from __future__ import annotations

import random

import msgspec
import pytest

from lmcache_core.transport.client import MessageQueueClient
from tests.integration import dialect
from tests.integration.dialect import call, enc, key


@pytest.fixture
def dealer(server):
    sock = dialect.dealer(server.url)
    yield sock
    sock.close(0)


def test_lmcache_ops_answer_as_lmcache_does(dealer):
    assert call(dealer, [enc(0), enc(24)]) == [enc(0), enc(24), enc("OK")]
    assert call(dealer, [enc(1), enc("noop")]) == [enc(1), enc("noop"), enc("OK")]
    assert call(dealer, [enc(2), enc(21)]) == [enc(2), enc(21), enc(64)]
    assert call(dealer, [enc(3), enc(22), enc(None)]) == [enc(3), enc(22), enc(True)]
    assert call(dealer, [enc(4), enc(8), enc(key("a")), enc(1)]) == [enc(4), enc(8)]  # void ack
    assert call(dealer, [enc(5), enc(9), enc("a")]) == [enc(5), enc(9), enc(0)]  # a miss, once
    assert call(dealer, [enc(6), enc(9), enc("never")]) == [enc(6), enc(9), enc(0)]
    assert call(dealer, [enc(7), enc(13), enc("a")]) == [enc(7), enc(13)]
    unknown = {**key("s"), "worker_id": 0}
    assert call(dealer, [enc(8), enc(6), enc(unknown), enc(42), enc([[1, 2]]), enc(b"")]) == \
        [enc(8), enc(6), enc([b"", False])]  # an unregistered instance: in-band failure


def test_bad_lmcache_frames_get_one_reply_each_and_the_server_keeps_serving(server, dealer):
    rng = random.Random(15)
    ops = [rng.choice([enc(i) for i in range(1, 34)] + [enc("lookup"), enc("store")])
           for _ in range(2000)]
    for i, op in enumerate(ops):
        payloads = [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(0, 8))]
        if i % 3 == 0:
            payloads = [enc(key()), enc(rng.randint(-5, 5))]
        dealer.send_multipart([enc(1000 + i), op, *payloads])
    # One reply each, at once: a result for the frames that happen to be valid, else LMCache's
    # failure of its op (never silence, which leaves LMCache's client waiting 300 s).
    uids = []
    while len(uids) < len(ops) and dealer.poll(5000):
        uids.append(msgspec.msgpack.decode(dealer.recv_multipart()[0]))
    assert sorted(uids) == list(range(1000, 1000 + len(ops)))
    assert call(dealer, [enc(9), enc(24)]) == [enc(9), enc(24), enc("OK")]
    with MessageQueueClient(server.url, connect_timeout_s=2) as client:
        reply = client.ping()
        assert reply.chunk_size == 64
    # A lookup it cannot serve is acknowledged (LMCache's server sends nothing): 0 hits.
    assert call(dealer, [enc(10), enc(8), enc({**key("z"), "num_kv_readers": 0}), enc(1)]) == \
        [enc(10), enc(8)]
    assert call(dealer, [enc(11), enc(9), enc("z")]) == [enc(11), enc(9), enc(0)]
