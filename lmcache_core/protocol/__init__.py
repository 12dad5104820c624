"""Wire protocol: message structs, op table and the I/O-free frame codec."""

from lmcache_core.protocol.codec import (
    DecodedRequest,
    Limits,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    error_reply,
)
from lmcache_core.protocol.ops import OPS, OpSpec, RequestType

__all__ = [
    "OPS",
    "DecodedRequest",
    "Limits",
    "OpSpec",
    "RequestType",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "error_reply",
]
