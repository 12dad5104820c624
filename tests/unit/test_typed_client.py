"""The typed client's surface follows the op table: ``request``'s overloads name each op's reply,
named methods cover the request types several ops share, and mypy rejects a wrong request."""

from __future__ import annotations

import shutil
import subprocess
import sys
import typing
from pathlib import Path
from unittest.mock import NonCallableMock

import pytest

from lmcache_core.protocol import OPS, RequestType, ops
from lmcache_core.protocol import explain_messages as xm
from lmcache_core.protocol import messages as m
from lmcache_core.transport.future import MessagingFuture
from lmcache_core.transport.typed import TypedRequests

ROOT = Path(__file__).resolve().parents[2]


def test_every_op_has_a_typed_descriptor_and_the_table_follows_it():
    assert set(ops.TYPED) == set(RequestType) == set(OPS)
    for op_type, op in ops.TYPED.items():
        assert op.type is op_type
        assert OPS[op_type] == ops.OpSpec(op.request, op.reply)


def test_request_overloads_agree_with_the_op_table():
    for name, wrap in (("request", lambda t: t), ("request_async", lambda t: MessagingFuture[t])):
        overloads = typing.get_overloads(getattr(TypedRequests, name))
        seen = {}
        for fn in overloads:
            hints = typing.get_type_hints(fn, globalns=vars(m) | {"MessagingFuture": MessagingFuture,
                                                                 "m": m, "xm": xm})
            seen[hints["msg"]] = hints["return"]
        assert seen == {req: wrap(op.reply) for req, op in ops.BY_REQUEST.items()}, name


class _Recorder(TypedRequests):
    def __init__(self) -> None:
        self.sent: list[tuple[RequestType, object, object]] = []

    def submit_request(self, op, payloads, timeout_s=None, *, polled=False):
        self.sent.append((op, payloads[0], polled))
        return MessagingFuture.completed(NonCallableMock(spec=ops.TYPED[op].reply))

    def _call(self, op, payload, reply_type, timeout_s=None):
        assert reply_type is ops.TYPED[op].reply
        self.sent.append((op, payload, timeout_s))
        return NonCallableMock(spec=reply_type)


def test_the_op_follows_from_the_request_or_the_method_name():
    client = _Recorder()
    lookup = m.LookupRequest(model_name="x", world_size=1, lookup_id="a", chunk_hashes=[])
    assert isinstance(client.request(lookup), m.LookupReply)
    assert isinstance(client.request_async(m.ClearRequest()).result(0), m.ClearReply)
    client.submit(ops.LOOKUP, lookup, 1.0, polled=True)
    client.server_info()
    client.end_session("a")
    client.free_lookup_locks("b", timeout_s=2.0)
    client.ping()
    assert [(op, payload) for op, payload, _ in client.sent] == [
        (RequestType.LOOKUP, lookup), (RequestType.CLEAR, m.ClearRequest()),
        (RequestType.LOOKUP, lookup), (RequestType.SERVER_INFO, m.NoArgs()),
        (RequestType.END_SESSION, m.LookupIdRequest(lookup_id="a")),
        (RequestType.FREE_LOOKUP_LOCKS, m.LookupIdRequest(lookup_id="b")),
        (RequestType.PING, m.PingRequest())]
    assert client.sent[2][2] is True and client.sent[5][2] == 2.0


def test_a_request_type_of_several_ops_needs_its_name():
    with pytest.raises(TypeError, match="NoArgs names no single op"):
        _Recorder().request(m.NoArgs())  # type: ignore[call-overload]


_SNIPPET = '''
from lmcache_core.protocol import messages as m, ops
from lmcache_core.transport.client import MessageQueueClient

def use(c: MessageQueueClient, q: m.LookupRequest) -> None:
    reveal_type(c.request(q))
    reveal_type(c.submit(ops.LOOKUP, q))
    c.call(ops.CLEAR, q)
    c.request(m.NoArgs())
    bad: m.ClearReply = c.request(q)
'''


@pytest.mark.skipif(shutil.which("mypy") is None and not (Path(sys.prefix) / "bin/mypy").exists(),
                    reason="mypy is not installed")
def test_mypy_types_replies_from_the_op_table(tmp_path):
    snippet = tmp_path / "typed_use.py"
    snippet.write_text(_SNIPPET)
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                          "--cache-dir", str(tmp_path / "cache"), str(snippet)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    assert 'Revealed type is "lmcache_core.protocol.messages.LookupReply"' in out, out
    assert "MessagingFuture[lmcache_core.protocol.messages.LookupReply]" in out, out
    assert ":8: error: " in out, out  # a ClearRequest op with a LookupRequest
    assert ':9: error: No overload variant of "request"' in out, out
    assert ":10: error: Incompatible types in assignment" in out, out
