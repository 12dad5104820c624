"""The operations our server serves, and which request/reply message each one carries.

Our op names live in their own namespace (``lmc.*`` strings) so that one ROUTER socket can later also
serve LMCache 0.5.6 clients, whose ops are integers 1-33 or bare snake_case names.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Generic, NamedTuple, TypeVar

from lmcache_core.protocol import explain_messages as em
from lmcache_core.protocol import messages as m
from lmcache_core.protocol import pin_messages as pm


class RequestType(str, Enum):
    """Every request our clients send; the value is the op frame's msgpack string."""

    PING = "lmc.ping"
    GET_CHUNK_SIZE = "lmc.get_chunk_size"
    REGISTER_KV_CACHE = "lmc.register_kv_cache"
    UNREGISTER_KV_CACHE = "lmc.unregister_kv_cache"
    STORE = "lmc.store"
    RETRIEVE = "lmc.retrieve"
    LOOKUP = "lmc.lookup"
    FREE_LOOKUP_LOCKS = "lmc.free_lookup_locks"
    END_SESSION = "lmc.end_session"
    CLEAR = "lmc.clear"
    SERVER_INFO = "lmc.server_info"
    LIST_CHUNKS = "lmc.list_chunks"
    PIN = "lmc.pin"
    UNPIN = "lmc.unpin"
    PEEK = "lmc.peek"
    EXPLAIN = "lmc.explain"


class OpSpec(NamedTuple):
    """The payload a request carries and the reply it is answered with."""

    request: type[m.Message]
    reply: type[m.Reply]


Q = TypeVar("Q", bound=m.Message)
P = TypeVar("P", bound=m.Reply)


class Op(Generic[Q, P]):
    """One op with its request and reply types, for a typed client: ``client.call(ops.LOOKUP,
    m.LookupRequest(...))`` is a ``LookupReply`` to mypy, and a request of another type is an
    error (``Op`` is invariant in both)."""

    __slots__ = ("reply", "request", "type")

    def __init__(self, op: RequestType, request: type[Q], reply: type[P]) -> None:
        self.type = op
        self.request = request
        self.reply = reply

    def __repr__(self) -> str:
        return f"Op({self.type.value}: {self.request.__name__} -> {self.reply.__name__})"


PING = Op(RequestType.PING, m.PingRequest, m.PingReply)
GET_CHUNK_SIZE = Op(RequestType.GET_CHUNK_SIZE, m.NoArgs, m.ChunkSizeReply)
REGISTER_KV_CACHE = Op(RequestType.REGISTER_KV_CACHE, m.RegisterKVCacheRequest,
                       m.RegisterKVCacheReply)
UNREGISTER_KV_CACHE = Op(RequestType.UNREGISTER_KV_CACHE, m.UnregisterKVCacheRequest, m.OkReply)
STORE = Op(RequestType.STORE, m.StoreRequest, m.StoreReply)
RETRIEVE = Op(RequestType.RETRIEVE, m.RetrieveRequest, m.RetrieveReply)
LOOKUP = Op(RequestType.LOOKUP, m.LookupRequest, m.LookupReply)
FREE_LOOKUP_LOCKS = Op(RequestType.FREE_LOOKUP_LOCKS, m.LookupIdRequest, m.ReleasedReply)
END_SESSION = Op(RequestType.END_SESSION, m.LookupIdRequest, m.ReleasedReply)
CLEAR = Op(RequestType.CLEAR, m.ClearRequest, m.ClearReply)
SERVER_INFO = Op(RequestType.SERVER_INFO, m.NoArgs, m.ServerInfoReply)
LIST_CHUNKS = Op(RequestType.LIST_CHUNKS, m.ListChunksRequest, m.ChunkListReply)
PIN = Op(RequestType.PIN, pm.PinRequest, pm.PinReply)
UNPIN = Op(RequestType.UNPIN, pm.PinRequest, pm.UnpinReply)
PEEK = Op(RequestType.PEEK, m.PeekRequest, m.PeekReply)
EXPLAIN = Op(RequestType.EXPLAIN, em.ExplainRequest, em.ExplainReply)

#: Every op, by its ``RequestType`` (the one table: the server's routes and the codec read it).
TYPED: dict[RequestType, Op[Any, Any]] = {op.type: op for op in (
    PING, GET_CHUNK_SIZE, REGISTER_KV_CACHE, UNREGISTER_KV_CACHE, STORE, RETRIEVE, LOOKUP,
    FREE_LOOKUP_LOCKS, END_SESSION, CLEAR, SERVER_INFO, LIST_CHUNKS, PIN, UNPIN, PEEK, EXPLAIN)}

OPS: dict[RequestType, OpSpec] = {t: OpSpec(op.request, op.reply) for t, op in TYPED.items()}

#: The op of each request type that belongs to one op only (``client.request(msg)``); NoArgs,
#: LookupIdRequest and PinRequest serve several and have named client methods instead.
BY_REQUEST: dict[type[m.Message], Op[Any, Any]] = {
    op.request: op for op in TYPED.values()
    if sum(other.request is op.request for other in TYPED.values()) == 1}
