"""The operations our server serves, and which request/reply message each one carries.

Our op names live in their own namespace (``lmc.*`` strings) so that one ROUTER socket can later also
serve LMCache 0.5.6 clients, whose ops are integers 1-33 or bare snake_case names.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

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


class OpSpec(NamedTuple):
    """The payload a request carries and the reply it is answered with."""

    request: type[m.Message]
    reply: type[m.Reply]


OPS: dict[RequestType, OpSpec] = {
    RequestType.PING: OpSpec(m.PingRequest, m.PingReply),
    RequestType.GET_CHUNK_SIZE: OpSpec(m.NoArgs, m.ChunkSizeReply),
    RequestType.REGISTER_KV_CACHE: OpSpec(m.RegisterKVCacheRequest, m.RegisterKVCacheReply),
    RequestType.UNREGISTER_KV_CACHE: OpSpec(m.UnregisterKVCacheRequest, m.OkReply),
    RequestType.STORE: OpSpec(m.StoreRequest, m.StoreReply),
    RequestType.RETRIEVE: OpSpec(m.RetrieveRequest, m.RetrieveReply),
    RequestType.LOOKUP: OpSpec(m.LookupRequest, m.LookupReply),
    RequestType.FREE_LOOKUP_LOCKS: OpSpec(m.LookupIdRequest, m.ReleasedReply),
    RequestType.END_SESSION: OpSpec(m.LookupIdRequest, m.ReleasedReply),
    RequestType.CLEAR: OpSpec(m.ClearRequest, m.ClearReply),
    RequestType.SERVER_INFO: OpSpec(m.NoArgs, m.ServerInfoReply),
    RequestType.LIST_CHUNKS: OpSpec(m.ListChunksRequest, m.ChunkListReply),
    RequestType.PIN: OpSpec(pm.PinRequest, pm.PinReply),
    RequestType.UNPIN: OpSpec(pm.PinRequest, pm.UnpinReply),
}
