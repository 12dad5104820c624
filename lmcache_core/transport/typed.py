"""The typed surface of ``MessageQueueClient``: every reply type comes from the op table.

- ``call(ops.X, msg)`` / ``submit(ops.X, msg)``: any op, by its ``Op`` descriptor
  (:mod:`lmcache_core.protocol.ops`); mypy checks ``msg`` against the op and types the reply.
- ``request(msg)`` / ``request_async(msg)``: the op follows from the request's type, for the
  request types that belong to one op only (``ops.BY_REQUEST``).
- Named methods for the ops that share a request type (``server_info``, ``chunk_size``,
  ``free_lookup_locks``, ``end_session``, ``pin``, ``unpin``) and for ``ping``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, overload

from lmcache_core.protocol import explain_messages as xm
from lmcache_core.protocol import messages as m
from lmcache_core.protocol import ops
from lmcache_core.protocol import pin_messages as pm
from lmcache_core.protocol.ops import Op, RequestType
from lmcache_core.transport.future import MessagingFuture

Q = TypeVar("Q", bound=m.Message)
P = TypeVar("P", bound=m.Reply)
R = TypeVar("R", bound=m.Reply)


class TypedRequests:
    """Mixed into a client that provides the two raw primitives below."""

    def submit_request(self, op: RequestType, payloads: Sequence[Any],
                       timeout_s: float | None = None, *,
                       polled: bool = False) -> MessagingFuture[Any]:
        raise NotImplementedError

    def _call(self, op: RequestType, payload: Any, reply_type: type[R],
              timeout_s: float | None = None) -> R:
        raise NotImplementedError

    # ------------------------------------------------------------------ by op

    def call(self, op: Op[Q, P], payload: Q, timeout_s: float | None = None) -> P:
        """Send one request and wait for its reply (at most the request timeout)."""
        return self._call(op.type, payload, op.reply, timeout_s)

    def submit(self, op: Op[Q, P], payload: Q, timeout_s: float | None = None, *,
               polled: bool = False) -> MessagingFuture[P]:
        """Send one request; returns at once (see ``submit_request`` for ``polled``)."""
        return self.submit_request(op.type, [payload], timeout_s, polled=polled)

    # ------------------------------------------------------------------ by request type

    @overload
    def request(self, msg: m.PingRequest, timeout_s: float | None = ...) -> m.PingReply: ...
    @overload
    def request(self, msg: m.RegisterKVCacheRequest,
                timeout_s: float | None = ...) -> m.RegisterKVCacheReply: ...
    @overload
    def request(self, msg: m.UnregisterKVCacheRequest,
                timeout_s: float | None = ...) -> m.OkReply: ...
    @overload
    def request(self, msg: m.StoreRequest, timeout_s: float | None = ...) -> m.StoreReply: ...
    @overload
    def request(self, msg: m.RetrieveRequest, timeout_s: float | None = ...) -> m.RetrieveReply: ...
    @overload
    def request(self, msg: m.LookupRequest, timeout_s: float | None = ...) -> m.LookupReply: ...
    @overload
    def request(self, msg: m.ClearRequest, timeout_s: float | None = ...) -> m.ClearReply: ...
    @overload
    def request(self, msg: m.ListChunksRequest,
                timeout_s: float | None = ...) -> m.ChunkListReply: ...
    @overload
    def request(self, msg: m.PeekRequest, timeout_s: float | None = ...) -> m.PeekReply: ...
    @overload
    def request(self, msg: xm.ExplainRequest, timeout_s: float | None = ...) -> xm.ExplainReply: ...

    def request(self, msg: m.Message, timeout_s: float | None = None) -> m.Reply:
        """Send ``msg`` (its type names the op) and wait for the reply."""
        op = _op_of(msg)
        return self._call(op.type, msg, op.reply, timeout_s)

    @overload
    def request_async(self, msg: m.PingRequest,
                      timeout_s: float | None = ...) -> MessagingFuture[m.PingReply]: ...
    @overload
    def request_async(self, msg: m.RegisterKVCacheRequest, timeout_s: float | None = ...
                      ) -> MessagingFuture[m.RegisterKVCacheReply]: ...
    @overload
    def request_async(self, msg: m.UnregisterKVCacheRequest,
                      timeout_s: float | None = ...) -> MessagingFuture[m.OkReply]: ...
    @overload
    def request_async(self, msg: m.StoreRequest,
                      timeout_s: float | None = ...) -> MessagingFuture[m.StoreReply]: ...
    @overload
    def request_async(self, msg: m.RetrieveRequest,
                      timeout_s: float | None = ...) -> MessagingFuture[m.RetrieveReply]: ...
    @overload
    def request_async(self, msg: m.LookupRequest,
                      timeout_s: float | None = ...) -> MessagingFuture[m.LookupReply]: ...
    @overload
    def request_async(self, msg: m.ClearRequest,
                      timeout_s: float | None = ...) -> MessagingFuture[m.ClearReply]: ...
    @overload
    def request_async(self, msg: m.ListChunksRequest,
                      timeout_s: float | None = ...) -> MessagingFuture[m.ChunkListReply]: ...
    @overload
    def request_async(self, msg: m.PeekRequest,
                      timeout_s: float | None = ...) -> MessagingFuture[m.PeekReply]: ...
    @overload
    def request_async(self, msg: xm.ExplainRequest,
                      timeout_s: float | None = ...) -> MessagingFuture[xm.ExplainReply]: ...

    def request_async(self, msg: m.Message, timeout_s: float | None = None
                      ) -> MessagingFuture[Any]:
        """Send ``msg`` (its type names the op); the future resolves to the reply."""
        return self.submit_request(_op_of(msg).type, [msg], timeout_s)

    # ------------------------------------------------------------------ ops sharing a request type

    def ping(self, timeout_s: float | None = None) -> m.PingReply:
        return self.call(ops.PING, m.PingRequest(), timeout_s)

    def server_info(self, timeout_s: float | None = None) -> m.ServerInfoReply:
        return self.call(ops.SERVER_INFO, m.NoArgs(), timeout_s)

    def chunk_size(self, timeout_s: float | None = None) -> int:
        return self.call(ops.GET_CHUNK_SIZE, m.NoArgs(), timeout_s).chunk_size

    def free_lookup_locks(self, lookup_id: str, timeout_s: float | None = None) -> m.ReleasedReply:
        return self.call(ops.FREE_LOOKUP_LOCKS, m.LookupIdRequest(lookup_id=lookup_id), timeout_s)

    def end_session(self, lookup_id: str, timeout_s: float | None = None) -> m.ReleasedReply:
        return self.call(ops.END_SESSION, m.LookupIdRequest(lookup_id=lookup_id), timeout_s)

    def pin(self, msg: pm.PinRequest, timeout_s: float | None = None) -> pm.PinReply:
        return self.call(ops.PIN, msg, timeout_s)

    def unpin(self, msg: pm.PinRequest, timeout_s: float | None = None) -> pm.UnpinReply:
        return self.call(ops.UNPIN, msg, timeout_s)


def _op_of(msg: m.Message) -> Op[Any, Any]:
    op = ops.BY_REQUEST.get(type(msg))
    if op is None:
        raise TypeError(f"{type(msg).__name__} names no single op: use call(ops.X, msg) or the "
                        "client's named method")
    return op
